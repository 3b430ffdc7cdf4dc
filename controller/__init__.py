"""The controller process: owns all run state and drives the asynchronous pipeline.

Embedding (inside your own asyncio application):

    controller = Controller(load_config(overrides=["trainer.total_steps=5"]))
    run = asyncio.create_task(controller.run())
    async for record in controller.events():   # steps, evaluations, events, the summary
        ...
    summary = await run
"""

from areal.controller.controller import Controller, RunFailed

__all__ = ["Controller", "RunFailed"]
