"""The controller's decisions: for every message a worker sends, what changes and what to
send in return. Synchronous code over the components, with no I/O: each decision writes
what must go out into an Outbox, which the async shell (controller.py) sends.

    Register       -> Welcome (config, version, weights; stream mode: the chunks so far)
    Ready          -> the worker takes work (collective mode: after the weights group
                      re-formed with it and the version broadcast again)
    Generated      -> checked (checks.py), recorded in the ledger; strict bound: its group
                      dropped if too stale; an episode: judged with its environment's reward;
                      the group's last sample: one Score for the group (scoring.py)
    Completions    -> each of its completions as a Generated (reward.num_workers=0: each
                      with the outcome its rollout worker found, judged at once, no Score)
    Scored         -> each outcome judged (scoring.py); a whole group done -> the buffer,
                      its evaluation round, or dropped by a group filter
    Trained        -> a step's rank answered (trainers.py); rank 0 publishes the version
                      (weight_sync.py; strict bound: groups too stale for it dropped first)
                      and reports its checkpoint (train_driver.py)
    WeightsChunk   -> relayed (stream mode)
    WeightsUpdated -> the worker serves that version, or its load is retried (weight_sync.py)
    GroupStatus    -> the trainer group's formation, or the weights group's failure
    WorkerError    -> fatal: the worker is lost; a failed Score: each check judged; a failed
                      training step: diagnosed by the shell (Outbox.step_failures)
after each message: the sender is offered work again, and whatever can be dispatched is

and the decisions that span components: dropping a group (never trained: its generations
cancelled, its staleness slots freed, its queued Scores forgotten) and losing a worker (its
work re-queued, never lost; its process is the shell's to restart).

Like vLLM's scheduler, this owns no sockets and no processes; it owns what is decided about
messages that no single component owns: the count of malformed messages and the workers
whose loss is being handled.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable, Collection

from areal.config import RunConfig
from areal.controller import strict_staleness
from areal.controller.admission import Admission
from areal.controller.checks import completions_fit, generated_problem, sender_problem
from areal.controller.evaluations import Evaluations
from areal.controller.generation import Generation
from areal.controller.ledger import Group, Ledger, Purpose, Sample, Stage
from areal.controller.outbox import Outbox
from areal.controller.peer_log import PeerLog, peer_name
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.controller.scoring import Scoring
from areal.controller.setup import RunSetup
from areal.controller.signal import Changed
from areal.controller.train_driver import TrainDriver
from areal.controller.trainers import RunFailed, Trainers
from areal.controller.weight_sync import WeightSync
from areal.messages import (
    Completions,
    Generated,
    GroupName,
    GroupStatus,
    Heartbeat,
    Ready,
    Register,
    Scored,
    Shutdown,
    Trained,
    Welcome,
    WeightsChunk,
    WeightsUpdated,
    WorkerError,
    WorkerKind,
)
from areal.transport import PeerMessageError

log = logging.getLogger("areal.controller")


class Core:
    def __init__(
        self,
        cfg: RunConfig,
        setup: RunSetup,
        ledger: Ledger,
        pool: WorkerPool,
        admission: Admission,
        generation: Generation,
        scoring: Scoring,
        evaluations: Evaluations,
        weights: WeightSync,
        trainers: Trainers,
        driver: TrainDriver,
        peer_log: PeerLog,
        changed: Changed,
        record_event: Callable[..., None],
        group_filters: list[Callable[[Group], str | None]],
        vocab_size: int | None,
    ) -> None:
        """`changed`: the loops' wake-up signal (admission waits for dropped groups' slots
        and new versions)."""
        self.cfg = cfg
        self.setup = setup
        self.ledger = ledger
        self.pool = pool
        self.admission = admission
        self.generation = generation
        self.scoring = scoring
        self.evaluations = evaluations
        self.weights = weights
        self.trainers = trainers
        self.driver = driver
        self.report = driver.report
        self.peer_log = peer_log
        self.changed = changed
        self.record_event = record_event
        self.group_filters = group_filters
        """Checks of every training group once it is complete, in order: the first that
        names a reason drops the group instead of training on it."""
        self.vocab_size = vocab_size
        self.num_malformed = 0
        """Messages dropped undecoded: malformed, too large, or not a Register from an
        unregistered peer."""
        self.losing: set[str] = set()
        """Worker ids whose loss is being handled (until the shell has restarted them)."""
        self._handlers: dict[type, Callable[[bytes, Any, Any, list[bytes], Outbox], None]] = {
            Register: self._on_register,
            Ready: self._on_ready,
            Heartbeat: self._on_heartbeat,
            Generated: self._on_generated,
            Completions: self._on_completions,
            Scored: self._on_scored,
            Trained: self._on_trained,
            WeightsChunk: self._on_weights_chunk,
            WeightsUpdated: self._on_weights_updated,
            WorkerError: self._on_worker_error,
            GroupStatus: self._on_group_status,
        }
        self._rooms = {WorkerKind.ROLLOUT: generation.room, WorkerKind.REWARD: scoring.room}

    # -- routing --------------------------------------------------------------------------------

    def probe(self, identity: bytes, msg: Any) -> list[WorkerHandle]:
        """Rollout workers whose connection the decision on `msg` needs checked first (the
        shell sends each a Heartbeat and passes the reachable ones to `on_message`)."""
        if isinstance(msg, Trained) and msg.rank == 0 and not msg.replay:
            return self.weights.candidates()
        if isinstance(msg, Ready):
            handle = self.pool.get(identity)
            if handle is not None and not sender_problem(msg, handle):
                return self.weights.candidates(joining=handle)
        return []

    def on_message(
        self, identity: bytes, msg: Any, now: float, members: list[bytes] | None = None
    ) -> Outbox:
        """Everything that follows from `msg` arriving from `identity` at `now`; `members`:
        the reachable ones of `probe`'s workers."""
        out = Outbox()
        handle = self.pool.get(identity)
        if handle is not None:
            handle.last_seen = now
        handler = self._handlers.get(type(msg))
        problem = (
            sender_problem(msg, handle)
            if handler is not None
            else f"{type(msg).__name__} is not a message to the controller"
        )
        if handler is None or problem:
            self.refuse(identity, "unexpected message", problem)
            return out
        handler(identity, handle, msg, members or [], out)
        if handle is not None and handle.kind in self._rooms:
            self._rooms[handle.kind].offer(handle)  # it may have finished work or be ready
        if self.can_dispatch():
            self.dispatch(out)
        return out

    def malformed(self, err: PeerMessageError) -> None:
        """A message that could not be decoded (or was not a Register from a stranger)."""
        self.num_malformed += 1
        self.refuse(err.identity, err.reason, str(err))

    def refuse(self, identity: bytes, reason: str, detail: str) -> None:
        """A message dropped: logged and recorded, rate-limited per peer and reason."""
        handle = self.pool.get(identity)
        self.peer_log.report(handle.worker_id if handle else peer_name(identity), reason, detail)

    def registration_refused(self, identity: bytes, msg: Register, why: str) -> None:
        self.peer_log.report(
            peer_name(identity),
            "registration refused",
            f"{why}: worker_id={msg.worker_id[:100]!r} host={msg.host[:100]!r} pid={msg.pid}",
            worker_id=msg.worker_id[:100],
        )

    def can_dispatch(self) -> bool:
        return self.scoring.can_dispatch() or self.generation.can_dispatch()

    def dispatch(self, out: Outbox) -> None:
        """Queued Scores, then pending Generates, while a worker has room."""
        self.scoring.dispatch(out)
        self.generation.dispatch(out)

    # -- the messages ---------------------------------------------------------------------------

    def _on_register(
        self,
        identity: bytes,
        handle: WorkerHandle | None,
        msg: Register,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        registered = self.pool.register(identity, msg)
        if isinstance(registered, str):  # why it was refused: the peer's log says it too
            out.send(identity, Shutdown(reason=f"registration refused: {registered}"))
            return
        trainer = registered.kind is WorkerKind.TRAINER
        version, weights_path = self.weights.welcome(registered)
        out.send(
            identity,
            Welcome(
                config=self.setup.config_dict,
                version=version,
                weights_path=weights_path,
                run_dir=str(self.setup.run_dir),
                checkpoint=self.trainers.recovery.checkpoint if trainer else "",
            ),
        )
        self.weights.after_welcome(registered, out)

    def _on_ready(
        self, identity: bytes, handle: WorkerHandle, msg: Ready, members: list[bytes], out: Outbox
    ) -> None:
        handle.version = msg.version
        self.trainers.group.on_ready(handle, msg.store)
        self.weights.on_ready(handle, members, out)
        handle.ready = True
        self.record_event("worker_ready", worker_id=handle.worker_id)

    def _on_group_status(
        self,
        identity: bytes,
        handle: WorkerHandle,
        msg: GroupStatus,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        self.record_event(
            f"{msg.group.value}_group_{msg.state.value}",
            worker_id=handle.worker_id,
            generation=msg.generation,
            error=msg.error,
        )
        if msg.group is GroupName.TRAINER:
            self.trainers.group.on_status(handle, msg)
        else:
            self.weights.on_group_status(handle, msg)

    def _on_heartbeat(
        self,
        identity: bytes,
        handle: WorkerHandle,
        msg: Heartbeat,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        pass  # last_seen is updated for every message

    def _on_generated(
        self,
        identity: bytes,
        handle: WorkerHandle,
        msg: Generated,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        self.report.on_answer(1)
        self._completion(identity, handle, msg, out, checked=False)

    def _on_completions(
        self,
        identity: bytes,
        handle: WorkerHandle,
        msg: Completions,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        """Each completion as if it had come alone; a message whose parts do not fit
        together is refused whole and each of its requests generated again."""
        self.report.on_answer(len(msg.request_ids))
        try:
            if not msg.parts_fit:  # not checked by the intake (or refused there: worded here)
                msg.check()
        except ValueError as err:
            self.refuse(identity, "contradicts the ledger", f"Completions: {err}; generated again")
            for request_id in msg.request_ids:
                handle.in_flight.discard(request_id)
                self._generate_again(request_id, identity)
            return
        checked = completions_fit(
            msg,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            version=self.weights.version,
            vocab_size=self.vocab_size,
        )
        if not checked or self.cfg.staleness.strict:  # each judged, or dropped, on its own
            for completion in msg.completions():
                self._completion(identity, handle, completion, out, checked)
            return
        # What `_completion` does for each, the message's bookkeeping done once.
        rollout_scored = not self.scoring.has_reward_workers
        # reward.num_workers=0: the outcomes recorded with the completions when all accepted
        with_outcomes = rollout_scored and self.scoring.all_accepted(msg)
        handle.in_flight.difference_update(msg.request_ids)
        recorded = self.ledger.finish_completions(msg, identity, with_outcomes)
        samples = recorded.samples
        if not samples:
            return
        handle.num_restarts = 0  # it delivers: a later death is not a crash loop
        if len(samples) == len(msg.request_ids):  # all recorded: the message's own counts
            self.report.on_generated_tokens(sum(msg.lengths), sum(msg.num_interruptions))
        else:  # of the completions recorded (a stale one is not)
            trajectories = [s.generated for s in samples]
            self.report.on_generated_tokens(
                sum(t.num_model_tokens for t in trajectories),
                int(sum(t.timings["interruptions"] for t in trajectories)),
            )
        self.admission.generated(recorded.num_training)
        if with_outcomes:
            self.scoring.on_accepted_completions(recorded, msg, out)
        elif rollout_scored:  # some outcome failed, or none came: each judged on its own
            self.scoring.on_scored_completions(samples, msg, identity, out)
        else:
            for group in recorded.generated:  # each group's last generation: all its
                unscored = self.ledger.unscored(group)  # samples scored in one message
                if unscored:
                    self.scoring.score(unscored, out)

    def _completion(
        self, identity: bytes, handle: WorkerHandle, msg: Generated, out: Outbox, checked: bool
    ) -> None:
        """A finished generation: checked (unless `checked` already), recorded; the group's
        last one sent for scoring."""
        handle.in_flight.discard(msg.request_id)
        problem = (
            ""
            if checked
            else generated_problem(
                msg,
                max_new_tokens=self.cfg.rollout.max_new_tokens,
                version=self.weights.version,
                vocab_size=self.vocab_size,
            )
        )
        if problem:
            self.refuse(
                identity,
                "contradicts the ledger",
                f"Generated {msg.request_id[:60]!r}: {problem}; generated again",
            )
            self._generate_again(msg.request_id, identity)
            return
        sample = self.ledger.finish_generation(msg, identity)
        if sample is None:
            log.debug("ignored a stale result %s from %s", msg.request_id, handle.worker_id)
            return
        handle.num_restarts = 0  # it delivers: a later death is not a crash loop
        self.report.on_generated(sample.generated, msg)
        group = self.ledger.groups[sample.group_id]
        if group.purpose is Purpose.TRAIN:
            self.admission.generated()
            if self.cfg.staleness.strict and strict_staleness.expired(
                group, self.weights.version, self.cfg.eta
            ):
                self.drop_group(group, strict_staleness.STALE, out)
                return
        if msg.episode_end is not None or not self.scoring.has_reward_workers:
            # an episode (its environment gave the reward), or scored by its rollout worker
            self.scoring.on_rollout_scored(sample, msg, identity, out)
            return
        unscored = self.ledger.unscored(group)
        if unscored:  # the group's last generation: score them all in one message
            self.scoring.score(unscored, out)

    def _generate_again(self, request_id: str, identity: bytes) -> None:
        """A refused answer: the request, if this worker still holds it, is generated again
        under a new attempt id."""
        held = self.ledger.held(request_id, identity, Stage.GENERATING)
        if held is not None:
            self.ledger.requeue(held)

    def _on_scored(
        self, identity: bytes, handle: WorkerHandle, msg: Scored, members: list[bytes], out: Outbox
    ) -> None:
        self.scoring.on_scored(identity, handle, msg, out)

    def group_done(self, group: Group | None, out: Outbox) -> None:
        """A sample was scored; `group` (None: not complete yet) has a reward for every
        sample: a training group is kept unless a filter drops it, an evaluation group
        counts for its round."""
        if group is None:
            return
        if group.purpose is Purpose.TRAIN:
            reason = next(filter(None, (check(group) for check in self.group_filters)), None)
            if reason is not None:
                self.drop_group(group, reason, out)
            else:
                self.report.completed(group)
        else:
            self.evaluations.group_scored(group, out)

    def _on_trained(
        self, identity: bytes, handle: WorkerHandle, msg: Trained, members: list[bytes], out: Outbox
    ) -> None:
        if not self.trainers.answer(msg):
            self.refuse(
                identity,
                "unexpected message",
                f"Trained for step {msg.step}, which no step in progress expects",
            )
            return
        if not msg.replay:
            handle.num_restarts = 0  # it delivers: a later loss is not a crash loop
        if msg.rank == 0 and not msg.replay:
            # Announced here, in the receive loop: in stream mode the trainer's WeightsChunks
            # are the next messages, and they must reach the rollout workers after the
            # UpdateWeights that tells them to expect the chunks.
            self.publish(msg, members, out)
        if msg.rank == 0 and msg.checkpoint:
            self.driver.checkpointed(msg)
        out.wake(self.trainers.finish_if_complete)  # the train driver, after the publication

    def publish(self, trained: Trained, members: list[bytes], out: Outbox) -> None:
        """The trainer published `trained.version`; strict bound: what it can no longer train
        is dropped first."""
        if self.cfg.staleness.strict:
            self.driver.drop_expired(
                [
                    *self.ledger.buffer,
                    *(g for g in self.ledger.groups.values() if g.purpose is Purpose.TRAIN),
                ],
                out,
                version=trained.version,
            )
        self.weights.publish(trained, members, out)
        out.wake(self.changed.notify)

    def _on_weights_chunk(
        self,
        identity: bytes,
        handle: WorkerHandle,
        msg: WeightsChunk,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        problem = self.weights.on_chunk(msg, out)
        if problem:
            self.refuse(identity, "unexpected message", problem)

    def _on_weights_updated(
        self,
        identity: bytes,
        handle: WorkerHandle,
        msg: WeightsUpdated,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        self.weights.on_updated(handle, msg)
        if not msg.error:
            self.report.on_weights_updated(msg)

    def _on_worker_error(
        self,
        identity: bytes,
        handle: WorkerHandle,
        msg: WorkerError,
        members: list[bytes],
        out: Outbox,
    ) -> None:
        log.error(
            "%s reported: %s%s",
            handle.worker_id,
            msg.error,
            f" (request {msg.request_id})" if msg.request_id else "",
        )
        self.record_event(
            "worker_error", worker_id=handle.worker_id, error=msg.error, fatal=msg.fatal
        )
        if msg.fatal:
            self.lose(handle, f"fatal error: {msg.error}", out)
        elif msg.request_id and handle.kind is WorkerKind.TRAINER and self.trainers.busy:
            out.step_failures.append((handle, msg.error))
        elif handle.kind is WorkerKind.REWARD and msg.request_ids:
            self.scoring.on_failed(identity, handle, msg, out)
        elif handle.kind is WorkerKind.ROLLOUT and msg.request_id in self.ledger.by_request:
            # The engine refused or failed a generation (e.g. prompt + rollout.max_new_tokens
            # beyond the model's length): sent again it would fail again, and left alone its
            # group would never finish and the run would wait forever.
            raise RunFailed(
                f"{handle.worker_id} could not generate request {msg.request_id}: {msg.error}"
            )

    # -- decisions spanning components ----------------------------------------------------------

    def drop_group(self, group: Group, reason: str, out: Outbox) -> None:
        """Never train on `group` (wherever it is): its generations are cancelled, its queued
        Scores forgotten, its slots in the staleness window freed (admission replaces it),
        the cost counted per reason."""
        dropped = self.ledger.drop_group(group)
        self.scoring.forget_group(group.group_id)
        self.generation.cancel(dropped.generating, out)
        self.admission.released(dropped)
        self.report.on_dropped(reason, dropped)
        out.wake(self.changed.notify)

    def lose(self, handle: WorkerHandle, why: str, out: Outbox) -> None:
        """`handle` is lost: everything it held is re-queued (generations) or judged as an
        infrastructure failure (checks), and it is forgotten; its process is the shell's to
        stop and start again (`out.restarts`). Once: the liveness loop and a failed trainer
        step may both find the same dead rank; and a trainer rank stopped by the restart of
        its group (`trainers.restarting`) is not lost again."""
        if handle.worker_id in self.losing or handle.worker_id in self.trainers.restarting:
            return
        self.losing.add(handle.worker_id)
        requeued: list[Sample] = []
        rescore: list[Sample] = []
        if handle.identity is not None:
            requeued, rescore = self.ledger.release_worker(handle.identity)
        log.warning(
            "lost %s (%s): re-queued %d generations, %d scorings",
            handle.worker_id,
            why,
            len(requeued),
            len(rescore),
        )
        self.record_event(
            "worker_lost",
            worker_id=handle.worker_id,
            reason=why,
            requeued=len(requeued),
            rescored=len(rescore),
        )
        self.weights.member_lost(handle)
        self.pool.forget(handle)
        self.scoring.worker_lost(rescore, out)
        out.restart(handle, why)

    def restarted(self, handle: WorkerHandle) -> None:
        """The shell is done with `handle`'s process (restarted, or not ours)."""
        self.losing.discard(handle.worker_id)

    def heartbeat_targets(self, sent_to: Collection[bytes] = ()) -> list[bytes]:
        """The registered workers that need a Heartbeat: those not in `sent_to`, the ones
        sent something else since the last round (any message proves the controller alive;
        remote workers exit when it falls silent)."""
        return [identity for identity in self.pool.by_identity if identity not in sent_to]

    def heard(self, identity: bytes, now: float) -> bool:
        """A Heartbeat from `identity` at `now`, when it is a registered worker's: its last
        sign of life noted, nothing else to decide (False: a stranger's, for `on_message`
        to refuse)."""
        handle = self.pool.get(identity)
        if handle is None:
            return False
        handle.last_seen = now
        return True
