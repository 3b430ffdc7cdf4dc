"""Starting local workers (controller/pool.py): a run that starts them, or a replacement of
a lost one, leaves its event loop free while the fork waits for the fork server's imports,
and the handle is written on the loop, where a Register may come before the fork returns."""

from __future__ import annotations

import asyncio
import threading

from areal import clock
from areal.config import load_config
from areal.controller import preload
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.messages import PROTOCOL_VERSION, Register, WorkerKind


class _Started:
    """What `preload.start` returns, as far as the pool reads it."""

    pid = 4242

    def poll(self) -> None:
        return None


class _Exited:
    """A lost worker's process, as far as the pool reads it: exited."""

    pid = 1111

    def poll(self) -> int:
        return 1


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


async def test_a_replacement_that_registers_before_its_fork_returns_keeps_its_identity(
    tmp_path, monkeypatch
):
    """A lost worker started again while the fork server restarts (seconds): meanwhile its
    handle holds no process, so the liveness check does not find it lost again, and the new
    process's Register, which can come before the fork's reply, is not undone by it."""
    forked = threading.Event()
    reply = threading.Event()

    def fork(module, args, env, log_path):
        forked.set()
        reply.wait(30)
        return _Started()

    monkeypatch.setattr(preload, "start", fork)
    pool = WorkerPool(load_config(None, ["worker_start=preload"]), tmp_path, "tcp://x:1", "s")
    # rollout-0 as the controller leaves it when lost: unregistered, its process exited
    lost = pool.expected["rollout-0"] = WorkerHandle(
        worker_id="rollout-0", kind=WorkerKind.ROLLOUT, process=_Exited()
    )
    starting = asyncio.create_task(pool.start(WorkerKind.ROLLOUT, 0))
    while not forked.is_set():
        await asyncio.sleep(0.01)
    assert lost.process is None and pool.lost(timeout_s=0) == []
    register = Register(
        kind=WorkerKind.ROLLOUT,
        worker_id="rollout-0",
        pid=4242,
        host="h",
        secret="s",
        protocol=PROTOCOL_VERSION,
    )
    assert pool.register(b"new", register) is lost
    reply.set()
    assert await starting is lost
    assert lost.identity == b"new" and pool.get(b"new") is lost
    assert lost.process is not None and lost.process.pid == 4242


class _Polled:
    """A process that counts its polls; `code` is what poll returns (None: running)."""

    pid = 2222

    def __init__(self, code: int | None) -> None:
        self.code, self.polls = code, 0

    def poll(self) -> int | None:
        self.polls += 1
        return self.code


def test_still_lost_names_what_lost_would_name_polling_that_handle_alone(tmp_path):
    pool = WorkerPool(load_config(), tmp_path, "tcp://x:1", secret=None)

    def handle(name: str, code: int | None, identity: bytes | None, ready: bool, seen: float):
        h = WorkerHandle(worker_id=name, kind=WorkerKind.ROLLOUT, process=_Polled(code))
        h.identity, h.ready, h.last_seen = identity, ready, seen
        pool.expected[name] = h
        if identity is not None:
            pool.by_identity[identity] = h
        return h

    now = clock.now()
    exited = handle("rollout-0", 1, b"a", True, now)
    silent = handle("rollout-1", None, b"b", True, now - 100)
    setting_up = handle("rollout-2", None, b"c", False, now - 100)  # silence not counted yet
    heard = handle("rollout-3", None, b"d", True, now)
    restarted = handle("rollout-4", None, None, False, now)  # its process started again
    replaced = WorkerHandle(  # an earlier handle of rollout-0, no longer the pool's
        worker_id="rollout-0", kind=WorkerKind.ROLLOUT, process=_Polled(1)
    )
    handles = [exited, silent, setting_up, heard, restarted, replaced]
    lost = pool.lost(timeout_s=10)
    assert lost == [exited, silent]
    for h in handles:
        h.process.polls = 0
    assert [pool.still_lost(h, timeout_s=10) for h in handles] == [h in lost for h in handles]
    # each asked polled its own process at most once, no other
    assert [h.process.polls for h in handles] == [1, 1, 1, 1, 1, 0]
