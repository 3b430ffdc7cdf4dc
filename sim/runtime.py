"""The simulation as a controller runtime (areal.controller.runtime): its channel, its pool.

    Controller(cfg, runtime=SimRuntime(...))
        prepare_run  -> SimSetup (synthetic prompts of sampled lengths; no model, no tokenizer)
        connect      -> SimRouter (in-process ROUTER) and SimPool, whose `spawn` starts a
                        simulated worker coroutine where WorkerPool starts a process

Everything else is the controller's own code. A simulated worker is registered, watched
and shut down by the real pool logic; its "process" (`SimProcess`) is its task.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any
from collections.abc import Coroutine

from areal.config import RunConfig
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.controller.runtime import Connection
from areal.controller.setup import RunSetup
from areal.messages import WorkerKind

from areal.sim.accounting import as_worker
from areal.sim.channel import SimRouter
from areal.sim.rollout import SimRollout
from areal.sim.workers import SECRET, SimEnv, SimReward, SimTrainer, SimWorker
from areal.sim.workload import SimSetup, prepare_sim_run

log = logging.getLogger(__name__)

_WORKERS: dict[WorkerKind, type[SimWorker]] = {
    WorkerKind.ROLLOUT: SimRollout,
    WorkerKind.REWARD: SimReward,
    WorkerKind.TRAINER: SimTrainer,
}


class SimProcess:
    """A simulated worker's task, seen through the few `Popen` methods the pool uses."""

    pid = 0

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.killed = False

    def poll(self) -> int | None:
        if self.killed:
            return -9
        if not self.task.done():
            return None
        return 1 if self.task.cancelled() or self.task.exception() else self.task.result()

    def kill(self) -> None:
        self.killed = True
        self.task.get_loop().call_soon_threadsafe(self.task.cancel)

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()


class SimPool(WorkerPool):
    """A WorkerPool whose workers are coroutines talking through a SimRouter."""

    def __init__(self, cfg: RunConfig, run_dir: Path, router: SimRouter, env: SimEnv) -> None:
        super().__init__(cfg, run_dir, router.address, SECRET)
        self.router = router
        self.env = env

    async def start(self, kind: WorkerKind, index: int, rank: int = 0) -> WorkerHandle:
        """`spawn` on the loop: a simulated worker is a task of this loop, started at once."""
        return self.spawn(kind, index, rank)

    def spawn(self, kind: WorkerKind, index: int, rank: int = 0) -> WorkerHandle:
        worker_id = f"{kind.value}-{index}"
        handle = self.expected.get(worker_id) or WorkerHandle(
            worker_id=worker_id, kind=kind, rank=rank
        )
        handle.process = SimProcess(
            as_worker(asyncio.get_running_loop(), self.worker(kind, worker_id, rank), worker_id)
        )
        handle.ready, handle.identity = False, None
        self.expected[worker_id] = handle
        return handle

    def worker(self, kind: WorkerKind, worker_id: str, rank: int) -> Coroutine[Any, Any, Any]:
        """What the worker's "process" runs: a simulated worker on its own connection."""
        return _WORKERS[kind](
            self.env, worker_id, rank, self.router.connect(worker_id.encode())
        ).run()

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Workers exit on Shutdown; cancel any that did not (thread-safe)."""
        for proc in self.local_processes():
            if proc.poll() is None:
                proc.kill()


class SimRuntime:
    """Plugs the simulated cluster into a real controller."""

    def __init__(self, env: SimEnv, wire: bool, recorder: Any = None) -> None:
        self.env = env
        self.wire = wire
        self.recorder = recorder
        """sim/alone.py's Recording of the controller's messages, or None."""
        self.router: SimRouter | None = None

    def prepare_run(self, cfg: RunConfig) -> SimSetup:
        return prepare_sim_run(cfg, self.env.workload)

    def connect(self, cfg: RunConfig, setup: RunSetup) -> Connection:
        self.router = SimRouter(self.wire, self.recorder)
        return Connection(
            channel=self.router,
            close=self.router.close,
            pool=SimPool(cfg, setup.run_dir, self.router, self.env),
        )
