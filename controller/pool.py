"""Which workers exist, which are alive and how loaded they are; starting local ones.

A worker is known by its ZeroMQ identity once it has registered (with the run's secret
where one is in force; under CurveZMQ the connection itself is already authenticated).
A worker must speak this release's protocol (`PROTOCOL_VERSION`, stated in its Register).
Trainer ranks are unique and below trainer.num_ranks. Local workers are started here
(`python -m areal.workers.<kind>`, or forked from the fork server that has imported that
code once: `worker_start`, controller/preload.py), with their credentials (secret or key
directory) in their environment, their output in `<run_dir>/logs/<worker_id>.log` and their
devices and CPU cores set from the config; they die with the controller
(areal.workers.parent). A worker is lost when its process exits or when it has been
silent for `controller.heartbeat_timeout_s` after it became ready (its set-up may block it
for longer: imports, model loading; it holds no work then); the controller then re-queues
its work and, for a local worker, starts a replacement. A worker that registers again under
the identity of one still setting up replaces it (it restarted). Refusals go to
`on_refused` (the controller rate-limits them, see peer_log.py); only the first
MAX_REFUSED worker ids are kept in `refused`. This module decides nothing about work.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from collections.abc import Callable

from areal import clock
from areal.config import RunConfig
from areal.controller import preload
from areal.messages import PROTOCOL_VERSION, Register, WorkerKind
from areal.workers.parent import PARENT_ENV, spawning

log = logging.getLogger(__name__)

MAX_REFUSED = 100
"""Refused worker ids kept for inspection (`WorkerPool.refused`); the rest are counted."""


class WorkerProcess(Protocol):
    """What the pool and the controller use of a worker's process: a local
    `subprocess.Popen`, one forked by the fork server (preload.PreloadedProcess), a Ray
    actor (launch/ray_pool.RayProcess) or a simulated worker's task (areal.sim)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


@dataclass(kw_only=True, slots=True)
class WorkerHandle:
    worker_id: str
    kind: WorkerKind
    rank: int = 0
    identity: bytes | None = None
    process: WorkerProcess | None = None
    ready: bool = False
    version: int = 0
    last_seen: float = field(default_factory=clock.now)
    in_flight: set[str] = field(default_factory=set)
    num_restarts: int = 0
    pid: int = 0
    host: str = ""

    @property
    def address(self) -> bytes:
        """Its identity, to send it something: only a registered worker is sent anything."""
        if self.identity is None:
            raise RuntimeError(f"{self.worker_id} has not registered: nothing can be sent to it")
        return self.identity


def protocol_mismatch(protocol: int) -> str:
    """Why a worker stating `protocol` in its Register is refused (not PROTOCOL_VERSION)."""
    theirs = "0 (a release from before protocol versions)" if protocol == 0 else str(protocol)
    return (
        f"the worker speaks protocol {theirs}, this controller {PROTOCOL_VERSION}: install the "
        "same areal release on the worker's machine as on the controller's"
    )


async def stop_process(handle: WorkerHandle) -> None:
    """Kill a local worker's process if it still runs, and reap it."""
    if handle.process is not None and handle.process.poll() is None:
        handle.process.kill()
        await asyncio.to_thread(handle.process.wait)


def _silent(handle: WorkerHandle, now: float, timeout_s: float) -> bool:
    """A ready worker not heard from for more than `timeout_s` (one still setting up may be
    quiet for as long as it needs)."""
    return handle.ready and now - handle.last_seen > timeout_s


class WorkerPool:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        address: str,
        secret: str | None,
        keys_dir: Path | None = None,
        on_refused: Callable[[bytes, Register, str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.address = address
        self.secret = secret
        """Register.secret every peer must present; None: not checked (CurveZMQ only)."""
        self.keys_dir = keys_dir
        self.by_identity: dict[bytes, WorkerHandle] = {}
        self.expected: dict[str, WorkerHandle] = {}
        """Local workers by id, registered or not yet."""
        self.refused: list[str] = []
        """Worker ids of refused registrations (the first MAX_REFUSED)."""
        self.on_refused = on_refused or (
            lambda identity, msg, why: log.warning(
                "refused %r from %r (pid %d): %s", msg.worker_id, msg.host, msg.pid, why
            )
        )

    # -- local processes ------------------------------------------------------------------------

    async def start(self, kind: WorkerKind, index: int, rank: int = 0) -> WorkerHandle:
        """Start worker `index` of `kind` (again, if it ran before) without blocking the
        event loop: a run's workers and the replacements of lost ones. The handle is reset
        here, on the loop, and only the process is started in a thread beside it: forking
        may wait seconds for the fork server's imports (the run's first worker, or the first
        after the server died), while the loop goes on hearing the other workers (and an
        embedding application's tasks run). Until its process is started the handle holds
        none, so it cannot be found lost meanwhile; a Register that comes first finds it."""
        worker_id = f"{kind.value}-{index}"
        handle = self.expected.get(worker_id) or WorkerHandle(
            worker_id=worker_id, kind=kind, rank=rank
        )
        handle.process, handle.ready, handle.identity = None, False, None
        handle.last_seen = clock.now()
        self.expected[worker_id] = handle
        handle.process = await asyncio.to_thread(self._launcher(handle, index))
        log.info("started %s (pid %d)", worker_id, handle.process.pid)
        return handle

    def _launcher(self, handle: WorkerHandle, index: int) -> Callable[[], WorkerProcess]:
        """What starts `handle`'s process (forked, or a fresh interpreter) and returns it,
        touching no handle or pool state: it may run in another thread."""
        kind, worker_id = handle.kind, handle.worker_id
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            AREAL_LOG_LEVEL=self.cfg.logging.level,
            TOKENIZERS_PARALLELISM="false",
        )
        env[PARENT_ENV] = str(os.getpid())  # it dies with this process (workers/parent.py)
        if self.secret is not None:
            env["AREAL_SECRET"] = self.secret
        if self.keys_dir is not None:
            env["AREAL_KEYS"] = str(self.keys_dir)
        env.update(self._placement_env(kind, index))
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{worker_id}.log"
        module = f"areal.workers.{kind.value}"
        args = ["--connect", self.address, "--worker-id", worker_id, "--rank", str(handle.rank)]
        if self.forks_workers:
            return lambda: preload.start(module, args, env, log_path)

        def execute() -> WorkerProcess:
            with open(log_path, "ab") as out:
                return spawning(  # in a thread that lasts (areal.workers.parent)
                    lambda: subprocess.Popen(
                        [sys.executable, "-m", module, *args],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )

        return execute

    @property
    def forks_workers(self) -> bool:
        """Whether workers are forked from the fork server (controller/preload.py)."""
        return preload.forks_workers(self.cfg)

    def _placement_env(self, kind: WorkerKind, index: int) -> dict[str, str]:
        """Thread counts, device visibility and CPU cores of one worker."""
        threads = {
            WorkerKind.ROLLOUT: self.cfg.rollout.threads,
            WorkerKind.TRAINER: self.cfg.trainer.threads,
        }.get(kind, 1)
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        devices = {
            WorkerKind.ROLLOUT: self.cfg.rollout.devices,
            WorkerKind.TRAINER: self.cfg.trainer.devices,
        }.get(kind, [])
        if devices and devices[index].startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = devices[index].removeprefix("cuda:")
        cpus = {
            WorkerKind.ROLLOUT: self.cfg.rollout.cpus,
            WorkerKind.TRAINER: self.cfg.trainer.cpus,
        }.get(kind, [])
        if cpus:
            env["AREAL_CPUS"] = cpus[index]  # the worker pins itself (sched_setaffinity)
        return env

    # -- registration ---------------------------------------------------------------------------

    def register(self, identity: bytes, msg: Register) -> WorkerHandle | str:
        """Admit a peer presenting the right secret: its handle; otherwise why it was
        refused (also handed to `on_refused`), which the controller tells the peer."""
        if self.secret is not None and not hmac.compare_digest(
            msg.secret.encode(), self.secret.encode()
        ):
            return self._refuse(identity, msg, "wrong secret")
        if msg.protocol != PROTOCOL_VERSION:
            return self._refuse(identity, msg, protocol_mismatch(msg.protocol))
        earlier = self.by_identity.get(identity)
        if earlier is not None and earlier.ready:
            return self._refuse(
                identity, msg, f"a second registration of {earlier.worker_id}, which is ready"
            )
        if earlier is not None:  # it restarted during set-up: the new process replaces it
            log.warning("%s registered again before it was ready; replacing it", earlier.worker_id)
            self.forget(earlier)
        if msg.kind is WorkerKind.TRAINER:
            why = self._rank_taken(msg)
            if why:
                return self._refuse(identity, msg, why)
        handle = self.expected.get(msg.worker_id)
        if handle is None or handle.identity is not None:
            handle = WorkerHandle(worker_id=msg.worker_id, kind=msg.kind, rank=msg.rank)
            if msg.worker_id in self.expected:  # a remote worker reusing a name: make it unique
                handle.worker_id = f"{msg.worker_id}@{identity.hex()[-8:]}"
        handle.identity, handle.kind, handle.rank = identity, msg.kind, msg.rank
        handle.pid, handle.host, handle.last_seen = msg.pid, msg.host, clock.now()
        self.by_identity[identity] = handle
        log.info("%s registered (%r, pid %d)", handle.worker_id, msg.host, msg.pid)
        return handle

    def _refuse(self, identity: bytes, msg: Register, why: str) -> str:
        if len(self.refused) < MAX_REFUSED:
            self.refused.append(msg.worker_id)
        self.on_refused(identity, msg, why)
        return why

    def _rank_taken(self, msg: Register) -> str:
        """Why a trainer may not take `msg.rank`; '' if it may."""
        num_ranks = self.cfg.trainer.num_ranks
        if not 0 <= msg.rank < num_ranks:
            return f"trainer rank {msg.rank} outside 0..{num_ranks - 1} (trainer.num_ranks={num_ranks})"
        for handle in self.by_identity.values():
            if handle.kind is WorkerKind.TRAINER and handle.rank == msg.rank:
                return f"trainer rank {msg.rank} is held by {handle.worker_id}"
        return ""

    def get(self, identity: bytes) -> WorkerHandle | None:
        return self.by_identity.get(identity)

    def forget(self, handle: WorkerHandle) -> None:
        if handle.identity is not None:
            self.by_identity.pop(handle.identity, None)
        handle.identity, handle.ready = None, False
        handle.in_flight.clear()

    # -- queries --------------------------------------------------------------------------------

    def ready(self, kind: WorkerKind) -> list[WorkerHandle]:
        return [h for h in self.by_identity.values() if h.kind is kind and h.ready]

    def lost(self, timeout_s: float) -> list[WorkerHandle]:
        """Ready workers silent for too long, and local processes that exited."""
        now, out = clock.now(), self.exited()
        for handle in self.by_identity.values():
            if handle not in out and _silent(handle, now, timeout_s):
                out.append(handle)
        return out

    def still_lost(self, handle: WorkerHandle, timeout_s: float) -> bool:
        """Whether `lost(timeout_s)` would still name `handle`, polling its process alone:
        the liveness loop asks this of each handle a round found lost, since losing one
        may have restarted others (a trainer group's ranks) meanwhile. Asking `lost` again
        instead polled every process once more per loss (on Ray, a `ray.wait` over every
        actor: milliseconds at thousands of them)."""
        if (
            self.expected.get(handle.worker_id) is handle
            and handle.process is not None
            and handle.process.poll() is not None
        ):
            return True
        return (
            handle.identity is not None
            and self.by_identity.get(handle.identity) is handle
            and _silent(handle, clock.now(), timeout_s)
        )

    def exited(self) -> list[WorkerHandle]:
        """The workers started here whose process has exited."""
        return [
            h
            for h in self.expected.values()
            if h.process is not None and h.process.poll() is not None
        ]

    def trainers(self) -> list[WorkerHandle]:
        """Every trainer rank known: local ones (running or not) and registered remote ones."""
        handles = {id(h): h for h in self.expected.values() if h.kind is WorkerKind.TRAINER}
        handles.update(
            (id(h), h) for h in self.by_identity.values() if h.kind is WorkerKind.TRAINER
        )
        return list(handles.values())

    def local_processes(self) -> list[WorkerProcess]:
        return [h.process for h in self.expected.values() if h.process is not None]

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Wait for local workers to exit after Shutdown; kill stragglers (they ignore
        SIGTERM: areal.workers.parent)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.local_processes():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
