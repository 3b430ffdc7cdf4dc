"""The controller actor: one asyncio process that owns all run state and drives the pipeline.

    task prompts --> [admission] --G samples--> ledger.pending             (admission.py)
                       waits: the staleness bound and data; unblocked by: a training step
                       (version + 1), a dropped group
    ledger.pending --> [dispatch] --Generate--> least-loaded rollout worker (generation.py)
                       waits: a rollout worker below rollout.max_concurrent, or a reward
                       worker for a queued Score; unblocked by: an admission, a re-queue,
                       an evaluation (after a received message [receive] dispatches itself)
    Generated, Scored, Trained, ... --> [receive] --> Core.on_message    (core.py)
                       the decision on each message: ledger, scoring, buffer, publication
                       of a new version; malformed, unexpected or contradicting the ledger
                       (checks.py) -> dropped, its work re-queued, a rate-limited log line;
                       a large Completions' tokens read beforehand on the channel's intake
                       thread (areal/intake.py)
    ledger.buffer  --> [train-driver] --Train(shard r, whole groups)--> rank r
                       waits: B trajectories in the buffer, then Trained from every rank
                       (trainers.py); records steps and evaluations (train_driver.py)
    [liveness]         Heartbeat to every worker sent nothing else since its last round
                       (any message is a sign of life); a silent or exited worker is lost (its
                       work re-queued, never lost; a local one restarted; a trainer rank:
                       every rank restarts from the newest checkpoint); failed weight loads
                       retried (weight_sync.py)

Each loop is a named task of one `asyncio.TaskGroup`; a loop that fails, or returns on its
own, ends the run with that error. The loops only wait, receive and send: every decision is
synchronous code of a component that owns the state it changes (core.py routes messages to
them), which writes what to send into an Outbox (outbox.py) and never touches a socket:

    admission.py    staleness window, admission log          generation.py  rollout room
    scoring.py      score queue, reward room, reward faults  evaluations.py eval rounds
    weight_sync.py  version, weights, chunks, load retries   trainers.py    the step on
    (weights_group.py: the collective mode's group)                         the ranks
    train_driver.py steps, their records, resume state       ledger.py      every sample
    core.py         routing, drops and losses that span components

`Controller` is the public face: set-up (the run directory, the task, the model), the
transport and the workers (a `Runtime`, runtime.py: local processes by default, a
simulated cluster in areal.sim), the components built in one place (`_build`), the task
group, shutdown. Embeddable: `await Controller(cfg).run()` inside any event loop, with
`events()` streaming every metrics record. Shutdown: Shutdown to every worker (final=True
after a finished run: the trainer writes final_model) -> reap processes. Local workers die
with this process (areal.workers.parent); the CLI turns SIGTERM/SIGINT into `stop()`.
At each trainer checkpoint the controller writes its part (resume.py), so that
`Controller(cfg, resume=True)` (`--resume RUN_DIR`) continues the run there, after removing
what the stopped run wrote past the checkpoint.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any, cast
from collections.abc import AsyncIterator, Callable, Coroutine

from areal import clock
from areal.config import RunConfig
from areal.controller import dynamic_sampling
from areal.controller.checks import intake_reading, model_vocab_size, worth_the_intake
from areal.controller.collector import collection_thresholds
from areal.controller.components import build_core
from areal.controller.core import Core
from areal.controller.ledger import Group, Ledger
from areal.controller.metrics import MetricsSink, closed_marker, is_closed
from areal.controller.outbox import Item, Outbox
from areal.controller.pool import WorkerHandle, WorkerPool, stop_process
from areal.controller.resume import (
    ResumeState,
    clear_after,
    find_state,
    kept_dropped_groups,
    previous_run,
)
from areal.controller.launch import make_runtime
from areal.controller.runtime import Runtime
from areal.controller.setup import RunSetup, resolve_run_dir
from areal.controller.signal import Changed
from areal.controller.trainers import MAX_RESTARTS, RunFailed
from areal.intake import Intake
from areal.messages import Heartbeat, Shutdown, WorkerKind
from areal.transport import PeerMessageError

log = logging.getLogger("areal.controller")

Loop = Coroutine[Any, Any, Any]


class Controller:
    """Run one training job. Embeddable: `await Controller(cfg).run()` inside any event loop,
    with `events()` streaming every metrics record while it runs."""

    def __init__(
        self, cfg: RunConfig, *, resume: bool = False, runtime: Runtime | None = None
    ) -> None:
        """`resume`: continue the run in cfg.run_dir from its newest checkpoint (resume.py).
        `runtime`: where the workers live and how they are reached (runtime.py); by default
        the one of `cfg.launcher` (launch/: local processes and remote peers over ZeroMQ,
        or Ray actors)."""
        self.cfg = cfg
        self.resume = resume
        self.runtime: Runtime = runtime or make_runtime(cfg)
        self.changed = Changed()
        """The loops' wake-up signal: every change of state they wait on notifies it."""
        self.group_filters: list[Callable[[Group], str | None]] = dynamic_sampling.group_filters(
            cfg
        )
        """Checks of every training group once it is complete, in order: the first that
        names a reason drops the group instead of training on it (add your own before
        `run`)."""
        self.stopping = False
        """`stop()` was called: no more admissions; the current step is the last."""
        self.core: Core | None = None
        """The run's components and their decisions, once the run is set up (`_build`)."""
        self._channel: Any = None
        """The controller's end of the transport, once connected: where `_send` sends."""
        self._sent_to: set[bytes] = set()
        """Workers sent a message since the liveness loop's last round: they need no
        Heartbeat in the next (any message proves the controller alive)."""
        self._subscribers: list[asyncio.Queue] = []
        """One queue per `events()` iterator; the metrics sink feeds them (the same list)."""

    # -- public API -----------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every record (steps, evals, events, the summary) as it happens, until the run ends."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        while True:
            record = await queue.get()
            if is_closed(record):
                return
            yield record

    def stop(self) -> None:
        """Ask the run to finish early (after the current step, with a final evaluation)."""
        self.stopping = True
        self.changed.notify()

    @property
    def run_dir(self) -> Path | None:
        return self.core.setup.run_dir if self.core else None

    @property
    def ledger(self) -> Ledger:
        """Every sample and group of the run (controller/ledger.py)."""
        return self._running().ledger

    @property
    def address(self) -> str | None:
        """Where workers connect (once the run is set up)."""
        return self._channel.address if self._channel is not None else None

    async def drop_group(self, group: Group, reason: str) -> None:
        """Never train on `group`, wherever it is (its generations cancelled, its staleness
        slots freed, counted under rollout/dropped_groups/<reason>)."""
        out = Outbox()
        self._running().drop_group(group, reason, out)
        await self._send(out)

    @property
    def version(self) -> int:
        """The policy version in force (0 before the run is set up)."""
        return self.core.weights.version if self.core else 0

    async def run(self) -> dict[str, Any]:
        """Run to completion; returns the summary (also written to summary.json)."""
        with collection_thresholds(self.cfg.controller.gc_thresholds):
            return await self._run()

    # -- set-up ---------------------------------------------------------------------------------

    async def _run(self) -> dict[str, Any]:
        started = clock.now()
        setup, resumed = await self._prepare()
        self.cfg = setup.cfg
        metrics = MetricsSink(
            self.cfg, setup.run_dir, self.cfg.trainer.total_steps, self._subscribers
        )
        vocab_size = await asyncio.to_thread(model_vocab_size, self.cfg.model.path)
        connection = self.runtime.connect(self.cfg, setup)
        channel, pool = connection.channel, connection.pool
        try:
            core = self._build(setup, metrics, channel, pool, vocab_size, started)
            if resumed is not None:
                self._restore(core, resumed, metrics)
            metrics.console(f"run directory: {setup.run_dir}  |  controller at {channel.address}")
            core.record_event("data_loaded", **getattr(setup.task, "counts", {}))
            await self._start_local_workers(core.pool, channel.address, metrics)
            return await self._supervise(core, channel, connection.loops)
        finally:
            for loop in connection.loops.values():
                loop.close()  # a no-op once it ran; else it never will (the run failed first)
            if self.core is not None:
                await self._shutdown(self.core, channel)
            connection.close()
            metrics.close()

    async def _prepare(self) -> tuple[RunSetup, ResumeState | None]:
        """The run's set-up (in a thread: it tokenizes, may build a model) and, when
        resuming, the checkpoint's state. RunFailed saying why when either cannot be had, or
        when a new run's directory holds another run (mixed in, that run's newer checkpoints
        and weight versions would be kept and this run's pruned)."""
        if not self.resume:
            run_dir = resolve_run_dir(self.cfg)
            held = previous_run(run_dir)
            if held:
                self._close_subscribers()
                raise RunFailed(
                    f"run_dir={str(run_dir)!r} holds a previous run ({', '.join(held)}): "
                    f"continue it with --resume {run_dir}, or give this run another run_dir "
                    "(or remove that one)"
                )
        try:
            setup = await asyncio.to_thread(self.runtime.prepare_run, self.cfg)
        except BaseException as err:
            self._close_subscribers()
            if isinstance(err, ValueError):  # the task, its data or the model do not fit
                raise RunFailed(f"cannot set up the run: {err}") from err
            raise
        if not self.resume:
            return setup, None
        try:
            return setup, find_state(setup.run_dir)
        except ValueError as err:
            self._close_subscribers()
            raise RunFailed(f"cannot resume: {err}") from err

    def _build(
        self,
        setup: RunSetup,
        metrics: MetricsSink,
        channel: Any,
        pool: WorkerPool,
        vocab_size: int | None,
        started: float,
    ) -> Core:
        if self.cfg.controller.intake_thread:
            channel.intake = Intake(intake_reading(channel.max_bytes), worth_the_intake)
        intake = channel.intake
        core = build_core(
            self.cfg,
            setup,
            pool,
            metrics,
            changed=self.changed,
            send=self._send,
            address=channel.address,
            group_filters=self.group_filters,
            stopping=lambda: self.stopping,
            vocab_size=vocab_size,
            started=started,
            intake_cpu_s=lambda: intake.cpu_s if intake is not None else 0.0,
        )
        channel.registered = lambda identity: pool.get(identity) is not None
        self.core, self._channel = core, channel
        return core

    def _restore(self, core: Core, state: ResumeState, metrics: MetricsSink) -> None:
        """Continue after step `state.step`: its version, its checkpoint for the trainer, its
        weights for the rollout workers, and the task's prompts from where they stopped."""
        run_dir = core.setup.run_dir
        core.weights.restore(state.version, str(state.weights))
        core.trainers.recovery.checkpoint = state.path
        core.driver.resume(state)
        core.setup.redraw(state.drawn, state.untrained)
        core.admission.resume(state.step * self.cfg.trainer.batch_size)
        core.report.dropped_total.update(kept_dropped_groups(run_dir, state))
        removed = clear_after(run_dir, state)
        metrics.console(
            f"resuming after step {state.step} (version {state.version}) "
            f"from {state.path}; {len(state.untrained)} untrained prompt "
            "groups are generated again"
            + (f"; removed {len(removed)} newer weight versions and checkpoints" if removed else "")
        )
        # Marks the records of the stopped run that this one supersedes (areal.records).
        core.record_event(
            "resumed",
            step=state.step,
            checkpoint=state.path,
            regenerated_groups=len(state.untrained),
            removed=removed,
        )

    def _close_subscribers(self) -> None:
        """The run ends before it started: end every `events()` iteration."""
        for queue in self._subscribers:
            queue.put_nowait(closed_marker())

    @staticmethod
    def _log_of(setup: RunSetup, worker_id: str) -> Path:
        return setup.run_dir / "logs" / f"{worker_id}.log"

    # -- the loops ------------------------------------------------------------------------------

    async def _supervise(self, core: Core, channel: Any, auth: dict[str, Loop]) -> dict[str, Any]:
        """Every loop in one task group until the train driver is done; a loop that fails or
        returns ends the run with its error."""
        loops: dict[str, Loop] = {
            **auth,
            "recv": self._receive(core, channel),
            "liveness": self._liveness(core),
            "dispatch": self._dispatch(core),
            "admission": core.admission.run(core.setup.next_train_prompt),
        }
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(_forever(name, loop), name=name)
                    for name, loop in loops.items()
                ]
                summary = await group.create_task(core.driver.run(), name="train-driver")
                for task in tasks:
                    task.cancel()
            return summary
        except BaseExceptionGroup as failed:
            raise _first(failed) from None

    async def _start_local_workers(
        self, pool: WorkerPool, address: str, metrics: MetricsSink
    ) -> None:
        """Every worker not left to join from elsewhere (`controller.remote_kinds`), started
        with `WorkerPool.start`: the event loop keeps running while they start."""
        remote = set(self.cfg.controller.remote_kinds)
        if "rollout" not in remote:
            for i in range(self.cfg.rollout.num_workers):
                await pool.start(WorkerKind.ROLLOUT, i, rank=i)
        if "reward" not in remote:
            for i in range(self.cfg.reward.num_workers):
                await pool.start(WorkerKind.REWARD, i)
        if "trainer" not in remote:
            for rank in range(self.cfg.trainer.num_ranks):
                await pool.start(WorkerKind.TRAINER, rank, rank=rank)
        if remote:
            metrics.console(
                f"waiting for remote workers ({', '.join(sorted(remote))}) to join at {address}"
            )

    async def _receive(self, core: Core, channel: Any) -> None:
        """Every message from the workers, decided on by the core; what it decides is sent
        before the next message is read."""
        while True:
            try:
                identity, msg = await channel.recv()
            except PeerMessageError as err:
                core.malformed(err)
                continue
            if type(msg) is Heartbeat and core.heard(identity, clock.now()):
                continue  # a sign of life changes nothing the loops wait on: no notify
            probe = core.probe(identity, msg)
            members = await self._reachable(probe) if probe else None
            out = core.on_message(identity, msg, clock.now(), members)
            if out.items or out.restarts or out.step_failures:
                await self._send(out)
            self.changed.notify()

    async def _dispatch(self, core: Core) -> None:
        """Dispatches when something other than a received message made work or room (an
        admission, a re-queue, an evaluation); after a received message the receive loop
        has dispatched already, without a task switch."""
        while True:
            await self.changed.wait_for(core.can_dispatch, at_notify=True)
            out = Outbox()
            core.dispatch(out)
            await self._send(out)

    async def _liveness(self, core: Core) -> None:
        cfg = self.cfg.controller
        pool, weights = core.pool, core.weights
        interval = self.cfg.heartbeat_interval()
        while True:
            await asyncio.sleep(interval)
            targets = core.heartbeat_targets(self._sent_to)
            self._sent_to.clear()  # what is sent from now on counts for the next round
            await self._channel.broadcast(targets, _HEARTBEAT)
            for handle in pool.lost(cfg.heartbeat_timeout_s):
                if not pool.still_lost(handle, cfg.heartbeat_timeout_s):
                    continue  # restarted meanwhile, with its trainer group
                await self._lose(
                    handle,
                    "process exited"
                    if handle.process is not None and handle.process.poll() is not None
                    else "silent",
                )
            out = Outbox()
            for handle, why in weights.retry(out):
                await self._lose(handle, why)
            await self._send(out)
            out = Outbox()
            weights.tick(await self._reachable(weights.tick_candidates()), out)
            await self._send(out)
            core.peer_log.flush_if_due()
            self.changed.notify()

    # -- carrying decisions out -----------------------------------------------------------------

    async def _send(self, out: Outbox) -> None:
        """What a decision wrote: its messages and wake-ups in order, then the restarts of
        the workers it lost, then the diagnosis of failed training steps. One message
        written to several workers in a row (a new version's UpdateWeights, to every rollout
        worker) is encoded once and broadcast."""
        channel, sent_to = self._channel, self._sent_to
        for _, same in itertools.groupby(out.items, key=_same_message):
            run = list(same)
            if not isinstance(run[0], tuple):  # wake-ups (the same one, if several)
                for wake_up in cast(list[Callable[[], Any]], run):
                    wake_up()
                continue
            sends = cast(list[tuple[bytes, Any]], run)
            if len(sends) == 1:
                sent_to.add(sends[0][0])
                await channel.send(*sends[0])
            else:
                identities = [identity for identity, _ in sends]
                sent_to.update(identities)
                await channel.broadcast(identities, sends[0][1])
        for handle, why in out.restarts:
            await self._restart(handle, why)
        for handle, error in out.step_failures:
            core = self._running()
            await core.trainers.step_failed(handle, error, core.losing, self._lose)

    async def _reachable(self, handles: list[WorkerHandle]) -> list[bytes]:
        """The identities among `handles` still connected: a Heartbeat to a peer whose
        connection closed fails at once (ROUTER_MANDATORY)."""
        return [h.address for h in handles if await self._channel.send(h.address, Heartbeat())]

    async def _lose(self, handle: WorkerHandle, why: str) -> None:
        out = Outbox()
        self._running().lose(handle, why, out)
        await self._send(out)

    def _running(self) -> Core:
        if self.core is None:
            raise RuntimeError("the run is not set up yet")
        return self.core

    async def _restart(self, handle: WorkerHandle, why: str) -> None:
        """Stop a lost worker's process and start it again (a trainer rank: every rank, from
        the newest checkpoint); a worker that keeps dying fails the run."""
        core = self._running()
        try:
            if handle.kind is WorkerKind.TRAINER:
                await core.trainers.lost(handle, why)
                return
            if handle.process is None:
                return
            await stop_process(handle)
            if handle.num_restarts >= MAX_RESTARTS:
                raise RunFailed(
                    f"{handle.worker_id} died {handle.num_restarts + 1} times; see "
                    f"{self._log_of(core.setup, handle.worker_id)}"
                )
            handle.num_restarts += 1
            index = int(handle.worker_id.rsplit("-", 1)[1])
            await core.pool.start(handle.kind, index, handle.rank)
        finally:
            core.restarted(handle)

    async def _shutdown(self, core: Core, channel: Any) -> None:
        """Shutdown to every worker; `final` (write final_model) only after a finished run."""
        final = core.driver.summary is not None
        for handle in list(core.pool.by_identity.values()):
            await channel.send(
                handle.identity,
                Shutdown(reason="run finished" if final else "run ended", final=final),
            )
        await asyncio.to_thread(core.pool.stop_all)


def _same_message(item: Item) -> int:
    """Groups an Outbox's items: a message sent to several workers in a row (the same
    object) together."""
    return id(item[1]) if isinstance(item, tuple) else id(item)


_HEARTBEAT = Heartbeat()
"""The controller's Heartbeat: always the same, encoded once per round."""


async def _forever(name: str, loop: Loop) -> None:
    """Run a loop that must not end: an error in it, or its return, fails the run."""
    try:
        await loop
    except RunFailed:
        raise
    except Exception as exc:
        raise RunFailed(f"controller loop {name!r} failed: {exc!r}") from exc
    raise RunFailed(f"controller loop {name!r} returned on its own")


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first error of a task group's (nested) exception group."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
