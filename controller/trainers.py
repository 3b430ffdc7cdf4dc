"""The trainer ranks as the controller drives them: each step out to every rank and back,
their group formed before the first step, and every rank replaced when one is lost.

    run_step(step, messages)  Train to each rank -> Trained from each (the controller
                              publishes rank 0's as it arrives) -> rank 0's Trained
    ensure (before a step, when not formed): wait for R ready ranks -> form their group
                              (R > 1) -> replay the steps since the checkpoint they resumed
                              from (recovery.py; none at the start of a run) -> formed
    lost(rank)                checkpoint_every = 0, or lost too often: RunFailed. Else every
                              rank stops (local ones are killed and started again, remote
                              ones get Shutdown(rejoin) and are started again by their
                              launcher), the group is formed again before the next step, and
                              the step in progress ends: done if rank 0 already published it
                              (it is replayed), else TrainerLost and it is sent again
    step_failed(rank, error)  one rank alone: RunFailed (it would fail again). Several: the
                              usual cause is a peer that died in a collective, which is lost
                              instead; else the reporting rank is

Owns the step out on the ranks (their answers so far), the data-parallel group
(trainer_group.py) and what a restarted trainer needs (recovery.py: the newest checkpoint
and the steps trained since). What it sends goes through the shell's `send`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from collections.abc import Awaitable, Callable

from areal import clock
from areal.config import RunConfig
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool, stop_process
from areal.controller.recovery import TrainerRecovery
from areal.controller.signal import Changed
from areal.controller.trainer_group import GroupError, TrainerGroup
from areal.messages import Shutdown, Train, Trained, WorkerKind

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
"""A worker that dies more often than this in a row, without delivering a result (a
generation, a score, a trained step) in between, fails the run (its log is named): a crash
loop. Occasional losses over a long run are each survived."""


class RunFailed(RuntimeError):
    """The run cannot go on (a worker keeps dying, the trainer failed, ...)."""


class TrainerLost(RuntimeError):
    """A trainer rank was lost during a step: the step is sent again after the restart."""


class Trainers:
    def __init__(
        self,
        cfg: RunConfig,
        pool: WorkerPool,
        changed: Changed,
        send: Callable[[Outbox], Awaitable[None]],
        address: str,
        record_event: Callable[..., None],
        console: Callable[[str], None],
        log_of: Callable[[str], Any],
        all_lost: Callable[[], None],
    ) -> None:
        """`send`: the shell's, for what this component decides to send; `address`: where
        remote ranks connect (for messages); `all_lost`: every rank is being restarted (the
        collective weights group, whose sender is rank 0, must be re-formed)."""
        self.cfg = cfg
        self.pool = pool
        self.group = TrainerGroup(cfg, pool, send)
        self.changed = changed
        self.recovery = TrainerRecovery(cfg.trainer.checkpoint_every)
        self.send = send
        self.address = address
        self.record_event = record_event
        self.console = console
        self.log_of = log_of
        """Where a worker's log is, by worker id (for error messages)."""
        self.all_lost = all_lost
        self.formed = False
        """The ranks are ready, in one group, and hold the run's current version."""
        self.restarting: set[str] = set()
        """The ranks (worker ids) a loss in progress stops and starts again: a process of
        theirs found exited meanwhile was stopped by that loss, not lost anew."""
        self._pending: asyncio.Future | None = None
        self._answers: dict[int, Trained] = {}

    @property
    def busy(self) -> bool:
        """A step (or replay) is out on the ranks."""
        return self._in_progress() is not None

    def _in_progress(self) -> asyncio.Future | None:
        """The answer awaited for the step out on the ranks, if one is."""
        pending = self._pending
        return pending if pending is not None and not pending.done() else None

    # -- steps ----------------------------------------------------------------------------------

    async def run_step(
        self, step: int, messages: list[Train], stopping: Callable[[], bool]
    ) -> Trained | None:
        """Rank 0's Trained for `step`, whatever ranks are lost meanwhile (None: the run was
        stopped while waiting for them)."""
        self.recovery.record(messages)
        while True:
            try:
                if not self.formed and not await self._ensure(step, stopping):
                    return None
                return await self._send(messages)
            except TrainerLost as lost:
                log.warning("step %d: %s; it is sent again once the trainer is back", step, lost)

    def answer(self, msg: Trained) -> bool:
        """Record one rank's Trained; False (changing nothing) if no step expects it."""
        if not self.busy or msg.rank in self._answers:
            return False
        self._answers[msg.rank] = msg
        return True

    def finish_if_complete(self) -> None:
        pending = self._in_progress()
        if pending is not None and len(self._answers) == self.cfg.trainer.num_ranks:
            pending.set_result(self._answers[0])

    async def _send(self, messages: list[Train]) -> Trained:
        ranks = sorted(self.pool.ready(WorkerKind.TRAINER), key=lambda h: h.rank)
        if len(ranks) != len(messages):
            raise TrainerLost(f"{len(ranks)} of {len(messages)} trainer ranks ready")
        pending = self._pending = asyncio.get_running_loop().create_future()
        self._answers = {}
        out = Outbox()
        for handle, msg in zip(ranks, messages, strict=True):
            out.send(handle.address, msg)
        await self.send(out)
        return await pending

    async def _ensure(self, step: int, stopping: Callable[[], bool]) -> bool:
        restores = self.recovery.num_restores
        start = clock.now()
        await self.changed.wait_for(
            lambda: (
                stopping() or len(self.pool.ready(WorkerKind.TRAINER)) >= self.cfg.trainer.num_ranks
            )
        )
        if stopping():
            return False
        if self.cfg.trainer.num_ranks > 1:
            try:
                await self.group.form()
            except GroupError as err:
                if self.recovery.num_restores != restores:  # a rank was lost while forming
                    raise TrainerLost(str(err)) from err
                raise RunFailed(str(err)) from err
        replays = self.recovery.replays(step)
        last = None
        for messages in replays:
            last = await self._send(messages)
        self.formed = True
        if restores:
            seconds = clock.now() - start
            self.record_event(
                "trainer_restored",
                checkpoint=self.recovery.checkpoint,
                replayed_steps=len(replays),
                restore_s=round(seconds, 3),
                replay_max_abs_diff=last.stats.get("replay_max_abs_diff") if last else None,
            )
            self.console(
                f"trainer restored from {self.recovery.checkpoint or 'the initial model'}"
                f" (+{len(replays)} replayed steps) in {seconds:.1f} s"
            )
        return True

    # -- faults ---------------------------------------------------------------------------------

    async def step_failed(
        self,
        handle: WorkerHandle,
        error: str,
        losing: set[str],
        lose: Callable[[WorkerHandle, str], Awaitable[Any]],
    ) -> None:
        """A rank reported that the step failed; `losing`: worker ids whose loss is being
        handled; `lose`: the controller's handling of a lost worker."""
        if self.cfg.trainer.num_ranks == 1 or not self.recovery.enabled:
            pending = self._in_progress()
            if pending is not None:
                pending.set_exception(RunFailed(f"trainer failed: {error}"))
            return
        for _ in range(20):
            if any(h.worker_id in losing for h in self.pool.trainers()):
                return  # the liveness loop found the dead rank first; it ends the step
            dead = [
                h
                for h in self.pool.trainers()
                if h.process is not None and h.process.poll() is not None
            ]
            if dead:
                await lose(dead[0], "process exited")
                return
            await asyncio.sleep(0.1)
        await lose(handle, f"step failed: {error}")

    async def lost(self, handle: WorkerHandle, why: str) -> None:
        """`handle` (already forgotten by the pool) is gone: restart every rank, or fail."""
        where = f"{self.log_of(handle.worker_id)} (local) or that worker's own log (remote)"
        lost = (
            f"trainer rank {handle.rank} ({handle.worker_id} on {handle.host or '?'}) lost ({why})"
        )
        if not self.recovery.enabled or handle.num_restarts >= MAX_RESTARTS:
            failure = RunFailed(
                f"{lost}; the trainer group cannot continue without it "
                + (
                    "(trainer.checkpoint_every=0: no checkpoint to restart from)"
                    if not self.recovery.enabled
                    else f"(lost {handle.num_restarts + 1} times)"
                )
                + f"; see {where}"
            )
            pending = self._in_progress()
            if pending is not None:
                pending.set_exception(failure)
            await stop_process(handle)
            raise failure
        handle.num_restarts += 1
        others = [h for h in self.pool.trainers() if h is not handle]
        ranks = {h.worker_id for h in [handle, *others]}
        self.restarting |= ranks
        try:
            await self._restart_all(handle, others, lost)
        finally:
            self.restarting -= ranks

    async def _restart_all(
        self, handle: WorkerHandle, others: list[WorkerHandle], lost: str
    ) -> None:
        """Stop every rank (`handle` is lost, `others` go with it) and start the local ones
        again; the step in progress ends as far as rank 0 got."""
        for other in others:
            if other.identity is not None and other.process is None:
                out = Outbox()
                out.send(
                    other.identity,
                    Shutdown(
                        reason="a trainer rank was lost: start this rank again to resume the run "
                        "from the checkpoint",
                        rejoin=True,
                    ),
                )
                await self.send(out)
            self.pool.forget(other)
            await stop_process(other)
        await stop_process(handle)
        self.group.lost()
        self.all_lost()
        self.formed = False
        self.recovery.num_restores += 1
        pending = self._in_progress()
        if pending is not None:
            published = self._answers.get(0)
            if published is not None and not published.replay:
                # Rank 0 finished the step and published it: the step is done, and the
                # restarted ranks replay it (it is kept) before the next one.
                pending.set_result(published)
            else:
                pending.set_exception(TrainerLost(lost))
        remote = [h.rank for h in [handle, *others] if h.process is None]
        for local in [h for h in [handle, *others] if h.process is not None]:
            await self.pool.start(WorkerKind.TRAINER, local.rank, local.rank)
        self.console(
            f"{lost}: restarting the trainer from {self.recovery.checkpoint or 'the initial model'}"
            + (
                f"; waiting for remote trainer ranks {remote} to join again at {self.address}"
                if remote
                else ""
            )
        )
