"""The controller actor: one asyncio process that owns all run state and drives the pipeline.

    task prompts --> [admission loop] --G samples--> ledger.pending
                       waits: staleness bound (areal.algorithms.staleness) and data;
                       unblocked by: a training step (version + 1)
    ledger.pending --> [dispatch loop] --Generate--> least-loaded rollout worker
                       waits: a rollout worker below rollout.max_concurrent;
                       unblocked by: Generated, Ready, a lost worker's re-queue (after a
                       received message the receive loop dispatches itself)
    Generated --> (handler) --> the group's last one generated --Score(the whole group)-->
                       least-loaded reward worker (queued if none is ready)
    Scored    --> (handler) --> each outcome; whole group done --> ledger.buffer (replay buffer)
    ledger.buffer --> [train driver] --Train(shard r of B trajectories, whole groups)--> rank r
                       waits: B trajectories in the buffer, then Trained from every rank;
                       staleness.strict: earliest deadline first, none past it; groups
                       that missed it are dropped (strict_staleness.py)
                       then: version + 1, UpdateWeights to every rollout worker (stream mode:
                       the trainer's WeightsChunks are relayed; collective: rank 0 broadcasts
                       in the weights group, see groups.py), metrics, periodic eval
    [recv loop]     every message from the ROUTER socket -> handler; malformed, unexpected
                    or contradicting the ledger (checks.py) -> drop, re-queue its work,
                    rate-limited log (peer_log.py); unregistered peers: a small Register only
    [liveness loop] Heartbeat to every worker; a silent or exited worker is lost: its work
                    is re-queued (never lost), a local worker is restarted; a lost trainer
                    rank: every rank restarts from the newest checkpoint, the steps trained
                    since are replayed, then the step in progress is sent again
                    (trainers.py, recovery.py); a failed weights group is re-formed; a
                    failed weight load gets the newest weights again (faults.py)
    Scored with an infrastructure failure, or a reward worker lost mid-check: the check is
                    retried, then the group dropped or the sample scored 0 (faults.py)

Each message kind's handler is in handlers.py, the steps the train driver takes in
training.py, the repairs of faults that workers survive in faults.py: mixins of Controller,
one concern each. Every loop is a named task; one that fails or returns on its own brings
the run down loudly. Shutdown: Shutdown to every worker (final=True after a finished run: the trainer
writes final_model) -> cancel loops -> gather -> reap processes. Local workers die with
this process (areal.workers.parent); the CLI turns SIGTERM/SIGINT into `stop()`.
Workers hold no state that must survive; everything here does (data cursor, ledger, version).
At each trainer checkpoint the controller writes its part (resume.py: data position, untrained
groups), so that `Controller(cfg, resume=True)` (`--resume RUN_DIR`) continues the run there,
after removing what the stopped run wrote past the checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import zmq
import zmq.asyncio

from areal import clock
from areal.algorithms.staleness import StalenessController
from areal.auth import ZapHandler, run_keys, watch_handshakes
from areal.config import RunConfig, is_loopback
from areal.messages import (
    Generate, Generated, GroupStatus, Heartbeat, Ready, Register, Score, Scored, Shutdown,
    Trained, WeightsChunk, WeightsUpdated, WorkerError, WorkerKind,
)
from areal.transport import PeerMessageError, RouterChannel
from areal.controller import dynamic_sampling
from areal.controller.collector import collection_thresholds
from areal.controller.checks import model_vocab_size, sender_problem
from areal.controller.episodes import episode_fields
from areal.controller.groups import Groups
from areal.controller.ledger import Group, Ledger, Purpose, Sample
from areal.controller.metrics import MetricsSink, closed_marker, is_closed
from areal.controller.peer_log import PeerLog
from areal.controller.pool import WorkerHandle, WorkerPool, stop_process
from areal.controller.recovery import TrainerRecovery
from areal.controller.resume import (
    ResumeState, clear_after, find_state, kept_dropped_groups, write_state,
)
from areal.controller.room import WorkerRoom
from areal.controller.runtime import Runtime
from areal.controller.report import StepReport, eval_record, summary_lines
from areal.controller.setup import RunSetup, prepare_run
from areal.controller.trainers import MAX_RESTARTS, RunFailed, Trainers
from areal.controller.weight_retry import WeightRetries
from areal.controller.reward_faults import RewardFaults
from areal.controller.faults import FaultRepairs
from areal.controller.handlers import MessageHandlers
from areal.controller.training import TrainingSteps
from areal.controller.signal import Changed

log = logging.getLogger("areal.controller")

ADMISSION_LOG_SIZE = 10_000
"""Admission entries kept (for tests and inspection; a long run must not grow with them)."""



class Controller(MessageHandlers, TrainingSteps, FaultRepairs):
    """Run one training job. Embeddable: `await Controller(cfg).run()` inside any event loop,
    with `events()` streaming every metrics record while it runs."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False,
                 runtime: Runtime | None = None) -> None:
        """`resume`: continue the run in cfg.run_dir from its newest checkpoint (resume.py).
        `runtime`: where the workers live and how they are reached (runtime.py); None: local
        processes and remote peers over ZeroMQ."""
        self.cfg = cfg
        self.resume = resume
        self.runtime = runtime
        self.resumed: ResumeState | None = None
        self._start_step = 0
        self._eval_before: dict[str, Any] | None = None
        self.version = 0
        self.ledger = Ledger()
        self.changed = Changed()
        self.admission_log: collections.deque[dict[str, int]] = collections.deque(
            maxlen=ADMISSION_LOG_SIZE)
        """One entry per admitted training group (the newest ADMISSION_LOG_SIZE): its id,
        the version at admission, the trajectories generated or in flight after admitting it
        (N_r), and the prompt's draw position in the task's stream."""
        self.num_malformed = 0
        """Messages dropped undecoded: malformed, too large, or not a Register from an
        unregistered peer."""
        self.peer_log: PeerLog | None = None
        self._vocab_size: int | None = None
        self._setup: RunSetup | None = None
        self._metrics: MetricsSink | None = None
        self._subscribers: list[asyncio.Queue] = []
        """One queue per `events()` iterator; MetricsSink feeds them (the same list)."""
        self._stopping = False
        self._admission_open = True
        self.recovery = TrainerRecovery(cfg.trainer.checkpoint_every)
        self.weight_retries = WeightRetries()
        self.reward_faults = RewardFaults(cfg.reward)
        self.trainers: Trainers | None = None
        self._losing: set[str] = set()
        """Worker ids whose loss is being handled."""
        self.zap: ZapHandler | None = None
        self.handshake_failures: list[str] = []
        self._auth_tasks: list[asyncio.Task] = []
        self._checkpointed: Trained | None = None
        """Rank 0's answer for the newest checkpointed step, until its resume state is
        written (`_save_resume_state`)."""
        self._score_queue: list[list[Sample]] = []
        """Samples to score (each entry one Score: samples of one group), waiting for a
        reward worker with room."""
        self.group_filters: list[Callable[[Group], str | None]] = []
        """Checks of every training group once it is complete, in order: the first that
        names a reason drops the group (`_drop_group`) instead of training on it."""
        self.group_filters += dynamic_sampling.group_filters(cfg)
        self._room = {WorkerKind.ROLLOUT: WorkerRoom(cfg.rollout.max_concurrent),
                      WorkerKind.REWARD: WorkerRoom(None)}
        """Rollout workers below rollout.max_concurrent and reward workers, least loaded
        first (room.py)."""
        self._stream_chunks: list[WeightsChunk] = []
        self._latest_weights: str | None = None
        """Weights a joining rollout worker loads first: the newest published version (disk
        mode), or a resumed checkpoint's."""
        self._eval_rounds: dict[int, dict[str, Any]] = {}
        """Evaluations in progress, by round id."""
        self._num_eval_rounds = 0
        self._periodic_evals: list[asyncio.Task] = []
        self._report = StepReport()
        self._started = clock.now()
        self._summary: dict[str, Any] | None = None

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
        self._stopping = True
        self.changed.notify()

    @property
    def run_dir(self) -> Path | None:
        return self._setup.run_dir if self._setup else None

    async def run(self) -> dict[str, Any]:
        """Run to completion; returns the summary (also written to summary.json)."""
        with collection_thresholds(self.cfg.controller.gc_thresholds):
            return await self._run()

    async def _run(self) -> dict[str, Any]:
        self._started = clock.now()
        try:
            self._setup = await asyncio.to_thread(
                prepare_run if self.runtime is None else self.runtime.prepare_run, self.cfg)
        except BaseException as err:
            self._close_subscribers()
            if isinstance(err, ValueError):  # the task, its data or the model do not fit
                raise RunFailed(f"cannot set up the run: {err}") from err
            raise
        self.cfg = self._setup.cfg
        if self.resume:
            try:
                self.resumed = find_state(self._setup.run_dir)
            except ValueError as err:
                self._close_subscribers()
                raise RunFailed(f"cannot resume: {err}") from err
        self._metrics = MetricsSink(self.cfg, self._setup.run_dir, self.cfg.trainer.total_steps,
                                    self._subscribers)
        self.peer_log = PeerLog(self._record_event, clock=clock.now)
        self._vocab_size = await asyncio.to_thread(model_vocab_size, self.cfg.model.path)
        self.staleness = StalenessController(self.cfg.trainer.batch_size, self.cfg.eta)
        if self.resumed is not None:
            self._restore_state(self.resumed)
        self.channel, self.pool, disconnect = self._connect() if self.runtime is None \
            else self.runtime.connect(self.cfg, self._setup)
        self.pool.on_refused = self._registration_refused
        self.channel.registered = lambda identity: self.pool.get(identity) is not None
        self.groups = Groups(self.cfg, self.channel, self.pool, self._record_event)
        self.trainers = Trainers(self.cfg, self.channel, self.pool, self.groups, self.changed,
                                 self.recovery, self._record_event, self._metrics.console,
                                 self._log_of)
        self._metrics.console(f"run directory: {self._setup.run_dir}  |  controller at "
                              f"{self.channel.address}")
        self._record_event("data_loaded", **getattr(self._setup.task, "counts", {}))
        try:
            return await self._supervise()
        finally:
            await self._shutdown()
            for task in self._auth_tasks:
                task.cancel()
            await asyncio.gather(*self._auth_tasks, return_exceptions=True)
            disconnect()
            self._metrics.close()

    def _connect(self) -> tuple[RouterChannel, WorkerPool, Callable[[], None]]:
        """The ROUTER socket and the pool of worker processes; and what closes them."""
        ctx = zmq.asyncio.Context()
        secret, keys, keys_dir = self._credentials(ctx)
        channel = RouterChannel(ctx, self.cfg.controller.host, self.cfg.controller.port,
                                self.cfg.controller.max_message_mb << 20, curve=keys)
        if keys is not None:
            self._auth_tasks.append(asyncio.create_task(
                watch_handshakes(channel.socket, self.handshake_failures), name="handshakes"))
        pool = WorkerPool(self.cfg, self._setup.run_dir, channel.address, secret, keys_dir)

        def disconnect() -> None:
            channel.close()
            ctx.term()

        return channel, pool, disconnect

    def _close_subscribers(self) -> None:
        """The run ends before it started: end every `events()` iteration."""
        for queue in self._subscribers:
            queue.put_nowait(closed_marker())

    def _restore_state(self, state: ResumeState) -> None:
        """Continue after step `state.step`: its version, its checkpoint for the trainer, its
        weights for the rollout workers, and the task's prompts from where they stopped."""
        self.version, self._start_step = state.version, state.step
        self.recovery.checkpoint = state.path
        self._latest_weights = str(state.weights)
        self._eval_before = state.eval_before
        self._setup.redraw(state.drawn, state.untrained)
        self.staleness.resume(state.step * self.cfg.trainer.batch_size)
        self._report.dropped_total.update(kept_dropped_groups(self._setup.run_dir, state))
        removed = clear_after(self._setup.run_dir, state)
        self._metrics.console(f"resuming after step {state.step} (version {state.version}) "
                              f"from {state.path}; {len(state.untrained)} untrained prompt "
                              "groups are generated again"
                              + (f"; removed {len(removed)} newer weight versions and "
                                 "checkpoints" if removed else ""))
        # Marks the records of the stopped run that this one supersedes (areal.records).
        self._record_event("resumed", step=state.step, checkpoint=state.path,
                           regenerated_groups=len(state.untrained), removed=removed)

    def _credentials(self, ctx: zmq.asyncio.Context):
        """(Register secret or None, CurveZMQ server keys or None, key directory or None).
        Under CurveZMQ the ZAP handler starts here, before the socket binds."""
        cfg = self.cfg.controller
        if not cfg.uses_curve:
            if not is_loopback(cfg.host):
                log.warning("controller.auth=secret on %s: traffic and the secret travel "
                            "unencrypted; use controller.auth=curve off a trusted network",
                            cfg.host)
            return cfg.secret or secrets.token_hex(16), None, None
        keys, keys_dir = run_keys(cfg.keys_dir, self._setup.run_dir)
        self.zap = ZapHandler(ctx, keys)
        self._auth_tasks.append(asyncio.create_task(self.zap.serve(), name="zap"))
        return cfg.secret, keys, keys_dir

    # -- supervision ----------------------------------------------------------------------------

    async def _supervise(self) -> dict[str, Any]:
        self._spawn_local_workers()
        loops = {name: asyncio.create_task(coro, name=name) for name, coro in (
            ("recv", self._recv_loop()),
            ("liveness", self._liveness_loop()),
            ("dispatch", self._dispatch_loop()),
            ("admission", self._admission_loop()),
        )}
        driver = asyncio.create_task(self._train_driver(), name="train-driver")
        try:
            done, _ = await asyncio.wait([driver, *loops.values(), *self._auth_tasks],
                                         return_when=asyncio.FIRST_COMPLETED)
            if driver not in done:
                (task,) = [t for t in done][:1]
                exc = task.exception()
                if isinstance(exc, RunFailed):
                    raise exc
                raise RunFailed(f"controller loop {task.get_name()!r} "
                                f"{'failed: ' + repr(exc) if exc else 'returned on its own'}") from exc
            return driver.result()
        finally:
            for task in [driver, *loops.values(), *self._periodic_evals]:
                task.cancel()
            await asyncio.gather(driver, *loops.values(), *self._periodic_evals,
                                 return_exceptions=True)

    def _spawn_local_workers(self) -> None:
        remote = set(self.cfg.controller.remote_kinds)
        if "rollout" not in remote:
            for i in range(self.cfg.rollout.num_workers):
                self.pool.spawn(WorkerKind.ROLLOUT, i, rank=i)
        if "reward" not in remote:
            for i in range(self.cfg.reward.num_workers):
                self.pool.spawn(WorkerKind.REWARD, i)
        if "trainer" not in remote:
            for rank in range(self.cfg.trainer.num_ranks):
                self.pool.spawn(WorkerKind.TRAINER, rank, rank=rank)
        if remote:
            self._metrics.console(f"waiting for remote workers ({', '.join(sorted(remote))}) "
                                  f"to join at {self.channel.address}")

    async def _shutdown(self) -> None:
        """Shutdown to every worker; `final` (write final_model) only after a finished run."""
        final = self._summary is not None
        for handle in list(self.pool.by_identity.values()):
            await self.channel.send(handle.identity, Shutdown(
                reason="run finished" if final else "run ended", final=final))
        await asyncio.to_thread(self.pool.stop_all)

    # -- the training driver --------------------------------------------------------------------

    async def _train_driver(self) -> dict[str, Any]:
        await self._wait_ready()
        before = await self._evaluate()
        if self._eval_before is None:
            self._eval_before = before
        self._report.start_training()
        groups_per_step = self.cfg.trainer.batch_size // self.cfg.task.group_size
        step = self._start_step
        while step < self.cfg.trainer.total_steps and not self._stopping:
            step += 1
            waited = clock.now()
            groups = await self._take_batch(groups_per_step)
            if groups is None:  # stopped while waiting: this step was not trained
                step -= 1
                break
            waited = clock.now() - waited
            self.staleness.consume(self.cfg.trainer.batch_size)
            result = await self._train_step(step, groups)
            if result is None:  # stopped while a lost trainer was being restored
                step -= 1
                break
            trained, train_s = result
            record = self._report.step_record(step, self.version, groups, trained.stats,
                                              train_s, waited, self)
            record.update(self.reward_faults.window_metrics())
            self._metrics.record("step", record, step=step)
            self._save_resume_state(step)
            self._metrics.progress(step, {k.split("/")[-1]: record[k] for k in (
                "rollout/reward_mean", "train/loss") if k in record})
            if self._eval_due(step):
                # Finished ones are let go (a long run would keep every record); a failed
                # one fails the run here.
                for task in [t for t in self._periodic_evals if t.done()]:
                    task.result()
                self._periodic_evals = [t for t in self._periodic_evals if not t.done()]
                self._periodic_evals.append(
                    asyncio.create_task(self._evaluate(), name=f"eval-{step}"))
        self._admission_open = False
        await self._cancel_training_requests()
        await asyncio.gather(*self._periodic_evals)  # their records precede the summary
        after = await self._evaluate()
        summary = self._report.summary(self._eval_before, after,
                                       clock.now() - self._started, step, self)
        if self.resumed is not None:
            summary["resumed_after_step"] = self.resumed.step
        self.peer_log.flush()
        summary["peer_refusals"] = dict(self.peer_log.totals)
        self._metrics.record("summary", summary)
        for line in summary_lines(summary):
            self._metrics.console(line)
        self._setup.write_summary(summary)
        self._summary = summary
        return summary

    # -- evaluation -----------------------------------------------------------------------------

    async def _evaluate(self) -> dict[str, Any]:
        """Generate and score the held-out prompts at the current version; record and return."""
        version = self.version
        round_id = self._num_eval_rounds
        self._num_eval_rounds += 1
        state: dict[str, Any] = {"pending": 0, "groups": [], "done": asyncio.Event()}
        self._eval_rounds[round_id] = state
        for prompt, prompt_ids in self._setup.eval_prompts:
            self.ledger.add_group(prompt, prompt_ids, self.cfg.eval.num_samples, version,
                                  Purpose.EVAL, eval_round=round_id, front=True)
            state["pending"] += 1
        self.changed.notify()
        start = clock.now()
        await state["done"].wait()
        del self._eval_rounds[round_id]  # its groups (every trajectory) are not kept
        record = eval_record(state["groups"], version, clock.now() - start)
        record["perf/train_elapsed_s"] = self._report.train_elapsed()
        self._metrics.record("eval", record, step=version)
        self._metrics.console(
            f"eval @ version {version}: pass@1 {record['eval/pass@1']:.3f} "
            f"over {int(record['eval/num_problems'])} held-out problems")
        return record

    # -- admission and dispatch -----------------------------------------------------------------

    async def _admission_loop(self) -> None:
        size = self.cfg.task.group_size
        while True:
            await self.changed.wait_for(
                lambda: self._admission_open and not self._stopping
                and self.staleness.capacity(self.version) >= size, at_notify=True)
            position, prompt, prompt_ids = await self._setup.next_train_prompt()
            self.staleness.admit(size, self.version)
            group = self.ledger.add_group(prompt, prompt_ids, size, self.version,
                                          position=position)
            self.admission_log.append({"group_id": group.group_id, "version": self.version,
                                       "num_admitted": self.staleness.num_live,
                                       "position": position})
            self.changed.notify()

    async def _dispatch_loop(self) -> None:
        """Dispatches when something other than a received message made work or room (an
        admission, a re-queue, an evaluation). After a received message the receive loop
        dispatches itself: waking this task for each of them (about 8,000 a step at 512
        accelerators) cost a task switch each."""
        while True:
            await self.changed.wait_for(self._can_dispatch, at_notify=True)
            await self._dispatch()

    def _can_dispatch(self) -> bool:
        return bool((self.ledger.pending and self._room[WorkerKind.ROLLOUT].peek())
                    or (self._score_queue and self._room[WorkerKind.REWARD].peek()))

    async def _dispatch(self) -> None:
        """Send queued Scores, then pending Generates, while a worker has room. Safe to run
        in two tasks at once: what is sent is taken from its queue before any await."""
        while self._score_queue and self._room[WorkerKind.REWARD].peek():
            await self._send_score(self._score_queue.pop(0))
        while self.ledger.pending:
            worker = self._room[WorkerKind.ROLLOUT].take()
            if worker is None:
                break
            await self._send_generate(self.ledger.pending.popleft(), worker)
            self._room[WorkerKind.ROLLOUT].offer(worker)

    async def _send_generate(self, sample: Sample, worker: WorkerHandle) -> None:
        group = self.ledger.groups[sample.group_id]
        rollout = self.cfg.rollout
        temperature = rollout.temperature if group.purpose is Purpose.TRAIN \
            else self.cfg.eval.temperature
        self.ledger.start_generation(sample, worker.identity, clock.now())
        worker.in_flight.add(sample.request_id)
        await self.channel.send(worker.identity, Generate(
            request_id=sample.request_id, prompt_ids=group.prompt_ids,
            max_new_tokens=rollout.max_new_tokens, temperature=temperature,
            top_p=rollout.top_p if group.purpose is Purpose.TRAIN else 1.0,
            stop_token_ids=self._setup.stop_token_ids,
            **episode_fields(self.cfg, group.prompt)))

    async def _send_score(self, samples: list[Sample]) -> None:
        """Score `samples` (generated, of one group) in one message to the least-loaded reward
        worker, or queue them until one has room."""
        worker = self._room[WorkerKind.REWARD].take()
        if worker is None:
            self._score_queue.append(samples)
            return
        group = self.ledger.groups[samples[0].group_id]
        for sample in samples:
            self.ledger.start_scoring(sample, worker.identity)
            worker.in_flight.add(sample.request_id)
        await self.channel.send(worker.identity, Score(
            request_ids=[s.request_id for s in samples], prompt_id=group.prompt.prompt_id,
            completion_ids=[s.trajectory.output_ids for s in samples],
            reference=group.prompt.reference))
        self._room[WorkerKind.REWARD].offer(worker)

    # -- receiving ------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        handlers = {Register: self._on_register, Ready: self._on_ready,
                    Heartbeat: self._on_heartbeat, Generated: self._on_generated,
                    Scored: self._on_scored, Trained: self._on_trained,
                    WeightsChunk: self._on_weights_chunk, WeightsUpdated: self._on_weights_updated,
                    WorkerError: self._on_worker_error, GroupStatus: self._on_group_status}
        while True:
            try:
                identity, msg = await self.channel.recv()
            except PeerMessageError as err:
                self.num_malformed += 1
                self._refuse(err.identity, err.reason, str(err))
                continue
            handle = self.pool.get(identity)
            if handle is not None:
                handle.last_seen = clock.now()
            handler = handlers.get(type(msg))
            problem = sender_problem(msg, handle) if handler else f"{type(msg).__name__} is not " \
                "a message to the controller"
            if problem:
                self._refuse(identity, "unexpected message", problem)
                continue
            await handler(identity, handle, msg)
            if handle is not None and handle.kind in self._room:
                self._room[handle.kind].offer(handle)  # it may have finished work or be ready
            if self._can_dispatch():
                await self._dispatch()
            self.changed.notify()

    def _interrupt(self) -> bool:
        return self.cfg.mode == "async" and self.cfg.rollout.interrupt

    def _save_resume_state(self, step: int) -> None:
        """The controller's part of `step`'s checkpoint (resume.py), once the step's record is
        written: a run killed between the two resumes from the checkpoint before and trains
        the step again, instead of resuming after a step whose record never reached
        metrics.jsonl."""
        msg = self._checkpointed
        if msg is None or msg.step != step:
            return
        self._checkpointed = None
        write_state(ResumeState(
            step=msg.step, version=msg.version, drawn=self._setup.num_drawn,
            untrained=sorted(self.ledger.untrained_positions()
                             + self._setup.requeued_positions()),
            eval_before=self._eval_before, path=msg.checkpoint))
        self._record_event("checkpoint", step=msg.step, path=msg.checkpoint,
                           seconds=msg.stats.get("checkpoint_s"))

    # -- liveness -------------------------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        cfg = self.cfg.controller
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            for handle in list(self.pool.by_identity.values()):
                await self.channel.send(handle.identity, Heartbeat())
            for handle in self.pool.lost(cfg.heartbeat_timeout_s):
                if handle not in self.pool.lost(cfg.heartbeat_timeout_s):
                    continue  # restarted meanwhile, with its trainer group
                await self._lose(handle, "process exited" if handle.process is not None
                                 and handle.process.poll() is not None else "silent")
            await self._retry_weight_loads()
            await self.groups.tick(self.version, self._interrupt())
            self.peer_log.flush_if_due()
            self.changed.notify()

    async def _lose(self, handle: WorkerHandle, why: str) -> None:
        """Re-queue everything `handle` held, forget it, and restart it if it is ours. Once:
        the liveness loop and a failed trainer step may both find the same dead rank."""
        if handle.worker_id in self._losing:
            return
        self._losing.add(handle.worker_id)
        try:
            await self._lose_once(handle, why)
        finally:
            self._losing.discard(handle.worker_id)

    async def _lose_once(self, handle: WorkerHandle, why: str) -> None:
        requeued, rescore = [], []
        if handle.identity is not None:
            requeued, rescore = self.ledger.release_worker(handle.identity)
        log.warning("lost %s (%s): re-queued %d generations, %d scorings", handle.worker_id,
                    why, len(requeued), len(rescore))
        self._record_event("worker_lost", worker_id=handle.worker_id, reason=why,
                           requeued=len(requeued), rescored=len(rescore))
        self.groups.member_lost(handle)
        self.pool.forget(handle)
        self.weight_retries.loaded(handle.worker_id)  # a new process starts afresh
        for sample in rescore:  # an infrastructure failure of each of their checks
            if self.ledger.scoring(sample.request_id, None) is sample:  # group not dropped
                await self._judge_score(sample, None, None)
        if handle.kind is WorkerKind.TRAINER:
            await self.trainers.lost(handle, why)
            return
        if handle.process is None:
            return
        await stop_process(handle)
        if handle.num_restarts >= MAX_RESTARTS:
            raise RunFailed(f"{handle.worker_id} died {handle.num_restarts + 1} times; see "
                            f"{self._log_of(handle.worker_id)}")
        handle.num_restarts += 1
        index = int(handle.worker_id.rsplit("-", 1)[1])
        self.pool.spawn(handle.kind, index, handle.rank)

    def _log_of(self, worker_id: str) -> Path:
        return self._setup.run_dir / "logs" / f"{worker_id}.log"

    def _record_event(self, event: str, **values: Any) -> None:
        self._metrics.record("event", {"event": event, "version": self.version, **values})
