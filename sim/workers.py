"""Simulated workers: the real protocol, with compute replaced by waiting on the virtual clock.

Each speaks the messages of its real counterpart (areal.workers.*) over an in-process
channel (sim/channel.py):

    connect --Register--> controller --Welcome--> --Ready--> serve until Shutdown;
    Heartbeat in each heartbeat interval (RunConfig.heartbeat_interval) in which it sent
    nothing else
    reward:   Score (a group) -> (reward_latency_s each, up to reward.max_concurrency at once)
              -> Scored
    trainer:  JoinGroup -> GroupStatus(JOINED); Train(shard) -> (cost.train_s of the shard
              + rank 0: publishing the weights) -> Trained(version + 1)
    rollout:  sim/rollout.py (continuous batching under the KV-cache limit, interruption)

How long anything takes is the cost model's (sim/cost.py); nothing here decides what work
is done: that is the controller's. `Host` models the one place where simulated workers
affect each other's speed: processes sharing the CPU cores of one machine (`contention`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import numpy as np

from areal.config import RunConfig
from areal.messages import (
    GroupState,
    GroupStatus,
    Heartbeat,
    JoinGroup,
    PROTOCOL_VERSION,
    Ready,
    Register,
    Score,
    Scored,
    Shutdown,
    Train,
    Trained,
    Welcome,
    WorkerKind,
)
from areal.tasks.base import Verdict

from areal.sim.channel import SimDealer
from areal.sim.cost import CostModel
from areal.sim.workload import Workload, reward_key, sample_name

log = logging.getLogger(__name__)

SECRET = "sim"
"""The simulated run's shared secret (the real registration check runs on it)."""


class Host:
    """Generation and training that share one machine's cores slow each other down:
    generation by `contention` while training runs, training by `train_contention` (default:
    the same) while generation runs (an accelerator entry's own efficiency; 1 on a GPU
    cluster: nothing happens).

    `cores` (an accelerator entry's own `cores`: the CPU machine, where one "accelerator" is
    a worker's thread): the busy workers' threads share that many cores, so while more
    threads are busy than there are cores each runs at cores / busy threads of its speed, on
    top of the contention above. None: every worker has its accelerators to itself."""

    def __init__(
        self, contention: float, train_contention: float | None = None, cores: int | None = None
    ) -> None:
        self.contention = contention
        self.train_contention = contention if train_contention is None else train_contention
        self.cores = cores
        self._active = {WorkerKind.ROLLOUT: 0, WorkerKind.TRAINER: 0}
        self._threads = 0
        """Threads of the busy workers."""
        self._listeners: list[Callable[[], None]] = []

    @property
    def shared(self) -> bool:
        return self.contention != 1.0 or self.train_contention != 1.0 or self.cores is not None

    def slowdown(self, kind: WorkerKind) -> float:
        other = WorkerKind.TRAINER if kind is WorkerKind.ROLLOUT else WorkerKind.ROLLOUT
        factor = max(1.0, self._threads / self.cores) if self.cores else 1.0
        if not (self.shared and self._active[other]):
            return factor
        return factor * (self.contention if kind is WorkerKind.ROLLOUT else self.train_contention)

    def listen(self, callback: Callable[[], None]) -> None:
        """`callback()` whenever the speed of some work may have changed (re-plan your work)."""
        self._listeners.append(callback)

    def set_busy(self, kind: WorkerKind, busy: bool, threads: int = 1) -> None:
        """A worker of `kind` running `threads` threads starts (busy) or stops working."""
        before = bool(self._active[kind])
        crowded = self._crowded()
        self._active[kind] += 1 if busy else -1
        self._threads += threads if busy else -threads
        if self.shared and (before != bool(self._active[kind]) or crowded or self._crowded()):
            for callback in list(self._listeners):
                callback()

    def _crowded(self) -> bool:
        """More threads busy than cores: a change in them changes everyone's speed."""
        return self.cores is not None and self._threads > self.cores

    async def work(self, kind: WorkerKind, seconds: float, threads: int = 1) -> None:
        """Spend `seconds` of undisturbed work of `kind`, slowed while the other kind runs
        (and while the cores are crowded)."""
        if not self.shared:
            await asyncio.sleep(seconds)
            return
        loop = asyncio.get_running_loop()
        self.set_busy(kind, True, threads)
        changed = asyncio.Event()
        self.listen(changed.set)
        try:
            left = seconds
            while left > 1e-12:
                rate = 1.0 / self.slowdown(kind)
                start = loop.time()
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), left / rate)
                except TimeoutError:
                    return
                left -= (loop.time() - start) * rate
        finally:
            self._listeners.remove(changed.set)
            self.set_busy(kind, False, threads)


@dataclass(kw_only=True)
class SimEnv:
    """What every simulated worker of one run shares."""

    cfg: RunConfig
    cost: CostModel
    workload: Workload
    host: Host
    rollout_tp: int
    colocated: bool
    num_trainer_ranks: int
    switch_s: float = 0.0
    """Seconds each trainer rank's step also spends switching its colocated accelerator
    between generation and training (cost.switch_s; 0: not priced)."""
    generated_tokens: list[int] = field(default_factory=lambda: [0])
    """Tokens generated by every rollout server (finished or not), for generation throughput."""
    multi_version: int = 0
    """Trained trajectories whose completion tokens come from more than one version."""
    interrupted: list[int] = field(default_factory=lambda: [0])
    """Interruptions of sequences in flight by weight updates, counted when they happen: a
    sequence that has not finished when the run ends is counted too (its Generated, which
    reports them to the controller, never came)."""


class SimWorker:
    """Register, get Welcome, announce Ready, serve messages until Shutdown."""

    kind: WorkerKind

    def __init__(self, env: SimEnv, worker_id: str, rank: int, channel: SimDealer) -> None:
        self.env = env
        self.worker_id = worker_id
        self.rank = rank
        self.channel = channel
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> int:
        await self.channel.send(
            Register(
                kind=self.kind,
                worker_id=self.worker_id,
                pid=0,
                host="sim",
                secret=SECRET,
                rank=self.rank,
                protocol=PROTOCOL_VERSION,
            )
        )
        welcome = await self.channel.recv()
        if not isinstance(welcome, Welcome):
            return 1
        version = self.setup(welcome)
        await self.channel.send(self.ready_message(version))
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            while True:
                msg = await self.channel.recv()
                if isinstance(msg, Shutdown):
                    return 0
                if not isinstance(msg, Heartbeat):
                    self.handle(msg)
        finally:
            heartbeat.cancel()
            for task in list(self._tasks):
                task.cancel()
            self.channel.close()

    def setup(self, welcome: Welcome) -> int:
        return welcome.version

    def ready_message(self, version: int) -> Ready:
        return Ready(version=version)

    def handle(self, msg: Any) -> None:
        """React to one message; quick (long work goes to `spawn`)."""
        log.warning("%s ignores %s", self.worker_id, type(msg).__name__)

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error  # a simulator bug: surfaces through the loop's handler

    async def _heartbeat(self) -> None:
        """As a real worker's (workers/base.py): a Heartbeat in each interval in which it
        sent nothing else."""
        interval = self.env.cfg.heartbeat_interval()
        while True:
            await asyncio.sleep(interval)
            if not self.channel.sent_since_beat:
                await self.channel.send(Heartbeat())
            self.channel.sent_since_beat = False


class SimReward(SimWorker):
    kind = WorkerKind.REWARD

    def setup(self, welcome: Welcome) -> int:
        self._slots = asyncio.Semaphore(self.env.cfg.reward.max_concurrency)
        return welcome.version

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Score):
            self.spawn(self._score(msg))
        else:
            super().handle(msg)

    async def _score(self, msg: Score) -> None:
        await asyncio.gather(*(self._check() for _ in msg.request_ids))
        key = reward_key(msg.reference)
        correct = [self.env.workload.correct(key, sample_name(r)) for r in msg.request_ids]
        n = len(correct)
        await self.channel.send(
            Scored(
                request_ids=msg.request_ids,
                rewards=[1.0 if ok else 0.0 for ok in correct],
                verdicts=[Verdict.OK if ok else Verdict.WRONG for ok in correct],
                details=[""] * n,
                check_s=[self.env.workload.reward_latency_s] * n,
            )
        )

    async def _check(self) -> None:
        async with self._slots:
            await asyncio.sleep(self.env.workload.reward_latency_s)


class SimTrainer(SimWorker):
    kind = WorkerKind.TRAINER

    def ready_message(self, version: int) -> Ready:
        return Ready(version=version, store="sim:0" if self.rank == 0 else "")

    def setup(self, welcome: Welcome) -> int:
        self._lock = asyncio.Lock()
        return welcome.version

    def handle(self, msg: Any) -> None:
        if isinstance(msg, JoinGroup):
            self.spawn(
                self.channel.send(
                    GroupStatus(group=msg.group, generation=msg.generation, state=GroupState.JOINED)
                )
            )
        elif isinstance(msg, Train):
            self.spawn(self._train(msg))
        else:
            super().handle(msg)

    async def _train(self, msg: Train) -> None:
        env = self.env
        lengths = np.diff(msg.cu_seqlens)
        env.multi_version += _count_multi_version(msg.versions, msg.cu_seqlens)
        seconds = env.cost.train_s(
            lengths,
            len(msg.minibatch_sizes) or env.cfg.trainer.num_minibatches,
            env.num_trainer_ranks,
            env.cfg.trainer.ppo.prox_logp == "recompute",
            env.cfg.trainer.micro_batch_tokens,
        )
        seconds += env.switch_s  # a synchronous step: nothing else runs meanwhile
        publish = self.rank == 0 and not msg.replay
        if publish:
            seconds += env.cost.publish_s(env.colocated)
        async with self._lock:
            await env.host.work(WorkerKind.TRAINER, seconds)
            version = msg.version + 1
            await self.channel.send(
                Trained(
                    step=msg.step,
                    version=version,
                    rank=self.rank,
                    replay=msg.replay,
                    stats={"sim_train_s": seconds, "sim_tokens": float(lengths.sum())},
                    weights_path=f"sim://weights/v{version}" if publish else None,
                )
            )


def _count_multi_version(versions: np.ndarray, cu_seqlens: np.ndarray) -> int:
    """Sequences of a packed batch whose sampled tokens (version >= 0) span several versions."""
    sampled = np.where(versions >= 0, versions, np.iinfo(np.int32).max)
    low = np.minimum.reduceat(sampled, cu_seqlens[:-1])
    high = np.maximum.reduceat(np.where(versions >= 0, versions, -1), cu_seqlens[:-1])
    return int(np.sum((high >= 0) & (high > low)))
