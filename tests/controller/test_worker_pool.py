"""Starting local workers (controller/pool.py): a run that starts them leaves its event loop
free while the first fork waits for the fork server's imports."""

from __future__ import annotations

import asyncio
import threading

from areal.config import load_config
from areal.controller import preload
from areal.controller.pool import WorkerPool
from areal.messages import WorkerKind


class _Started:
    """What `preload.start` returns, as far as the pool reads it."""

    pid = 4242

    def poll(self) -> None:
        return None


async def test_a_worker_starts_beside_the_event_loop(tmp_path, monkeypatch):
    """The fork stands in for the fork server's first one (seconds of imports): it returns
    only once a callback of the event loop has run. Started on the loop's own thread, it
    would wait for that callback in vain."""
    loop_ran = threading.Event()
    forks: list[tuple[str, bool]] = []

    def fork(module, args, env, log_path):
        forks.append((module, loop_ran.wait(30)))
        return _Started()

    monkeypatch.setattr(preload, "start", fork)
    pool = WorkerPool(load_config(None, ["worker_start=preload"]), tmp_path, "tcp://x:1", None)
    asyncio.get_running_loop().call_soon(loop_ran.set)
    handle = await pool.start(WorkerKind.REWARD, 0)
    assert forks == [("areal.workers.reward", True)]
    assert handle.process is not None and handle.process.pid == 4242
    assert pool.expected["reward-0"] is handle and not handle.ready
