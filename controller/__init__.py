"""The controller process: owns all run state and drives the asynchronous pipeline.

Embedding (inside your own asyncio application):

    controller = Controller(load_config(overrides=["trainer.total_steps=5"]))
    run = asyncio.create_task(controller.run())
    async for record in controller.events():   # steps, evaluations, events, the summary
        ...
    summary = await run

`Controller` and `RunFailed` are imported on first use, not with the package: the
package's other modules (the fork server, `python -m areal.controller` before it has read
its config) then start without the controller's imports, torch among them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal.controller.controller import Controller, RunFailed

__all__ = ["Controller", "RunFailed"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from areal.controller import controller

        return getattr(controller, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
