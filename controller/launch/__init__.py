"""Launchers: where a controller's workers run, chosen by `launcher` (docs/design.md section 12).

    local  child processes of the controller (areal.controller.pool.WorkerPool), the default
    ray    Ray actors in placement groups on a Ray cluster (ray_runtime.py); each actor runs
           the same worker entry point, `python -m areal.workers.<kind>`, as its child

A launcher only places, starts, watches and replaces processes: ZeroMQ stays the data plane,
and admission, dispatch, the ledger and the fault handling are the controller's, unchanged.
`make_runtime(cfg)` is the controller runtime (areal.controller.runtime) of cfg.launcher;
`Controller(cfg)` uses it unless given a runtime of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal.config import RunConfig
    from areal.controller.runtime import Runtime


def make_runtime(cfg: RunConfig) -> Runtime:
    """The runtime that starts `cfg`'s workers (LocalRuntime: local processes)."""
    if cfg.launcher == "local":
        from areal.controller.runtime import LocalRuntime

        return LocalRuntime()
    if cfg.launcher == "ray":
        from areal.controller.launch.ray_runtime import RayRuntime

        return RayRuntime()
    raise ValueError(f"launcher={cfg.launcher!r} is not one of local, ray")
