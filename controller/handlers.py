"""The controller's answers to each kind of message a worker sends. A mixin of `Controller`
(controller.py), whose receive loop checks the sender (checks.py) and hands each message to
one of these; they change the ledger, the worker pool and the run's version, and send what
follows (a group's Score once its last sample is generated, the weights to a worker that
registers late). Kept apart so that the actor's module stays about its loops.

    Register       -> Welcome (config, version, weights; stream mode: the chunks so far)
    Ready          -> the worker takes work (collective mode: joins the weights group first)
    Generated      -> checked, recorded; the group's last one -> one Score for the group
    Scored         -> each outcome judged (faults.py); a whole group done -> the buffer
    Trained        -> a step's rank answered; rank 0 publishes the version and checkpoints
    WeightsChunk   -> relayed to every rollout worker (stream mode)
    WeightsUpdated -> the worker serves that version, or its load is retried (faults.py)
    WorkerError    -> fatal: the worker is lost; a failed Score: each check retried
"""

from __future__ import annotations

import logging

from areal.controller import strict_staleness
from areal.controller.checks import generated_problem, reward_problem, scored_problem
from areal.controller.episodes import episode_scored
from areal.controller.ledger import Group, Purpose, Stage
from areal.controller.peer_log import peer_name
from areal.controller.pool import WorkerHandle
from areal.controller.trainers import RunFailed
from areal.controller.weight_retry import newest_on_disk
from areal.messages import (
    Generated, GroupStatus, Heartbeat, Ready, Register, Scored, Shutdown, Trained,
    UpdateWeights, Welcome, WeightsChunk, WeightsUpdated, WorkerError, WorkerKind,
)
from areal.tasks.base import RewardOutcome, Verdict

log = logging.getLogger("areal.controller")


class MessageHandlers:
    """Methods of Controller (self is the Controller)."""

    def _refuse(self, identity: bytes, reason: str, detail: str) -> None:
        """A message dropped: logged and recorded, rate-limited per peer and reason."""
        handle = self.pool.get(identity)
        self.peer_log.report(handle.worker_id if handle else peer_name(identity), reason, detail)

    def _registration_refused(self, identity: bytes, msg: Register, why: str) -> None:
        self.peer_log.report(peer_name(identity), "registration refused",
                             f"{why}: worker_id={msg.worker_id[:100]!r} host={msg.host[:100]!r} "
                             f"pid={msg.pid}", worker_id=msg.worker_id[:100])

    async def _on_register(self, identity: bytes, handle: WorkerHandle | None,
                           msg: Register) -> None:
        handle = self.pool.register(identity, msg)
        if handle is None:
            await self.channel.send(identity, Shutdown(reason="registration refused"))
            return
        trainer = handle.kind is WorkerKind.TRAINER
        # Disk mode: the newest published version (the newest there is, if it was deleted);
        # after a resume, until the first new version: the checkpoint's weights, any mode.
        from_disk = self.cfg.weight_sync.mode == "disk" or (
            self.resumed is not None and self.version == self.resumed.version)
        version, latest = self.version, self._latest_weights
        if from_disk and not trainer and self.version > 0:
            version, latest = newest_on_disk(self._setup.run_dir, latest, self.version) \
                or (self.version, latest)
        await self.channel.send(identity, Welcome(
            config=self._setup.config_dict, version=version,
            weights_path=latest if from_disk and not trainer else None,
            run_dir=str(self._setup.run_dir),
            checkpoint=self.recovery.checkpoint if trainer else ""))
        if handle.kind is WorkerKind.ROLLOUT and self._stream_chunks \
                and self.cfg.weight_sync.mode == "stream":
            await self.channel.send(identity, UpdateWeights(
                version=self.version, mode="stream", num_chunks=len(self._stream_chunks)))
            for chunk in self._stream_chunks:
                await self.channel.send(identity, chunk)

    async def _on_ready(self, identity: bytes, handle: WorkerHandle, msg: Ready) -> None:
        self.groups.on_ready(handle, msg.store)
        if handle.kind is WorkerKind.ROLLOUT and self.version > 0 \
                and self.cfg.weight_sync.mode == "collective":
            # Before it is ready for work: its first Generate must wait for this version.
            await self.groups.publish(self.version, [], self._interrupt(), joining=handle)
        handle.ready, handle.version = True, msg.version
        self._record_event("worker_ready", worker_id=handle.worker_id)

    async def _on_group_status(self, identity: bytes, handle: WorkerHandle,
                               msg: GroupStatus) -> None:
        self.groups.on_status(handle, msg)

    async def _on_heartbeat(self, identity: bytes, handle: WorkerHandle, msg: Heartbeat) -> None:
        pass  # last_seen is updated for every message

    async def _on_generated(self, identity: bytes, handle: WorkerHandle, msg: Generated) -> None:
        handle.in_flight.discard(msg.request_id)
        problem = generated_problem(msg, max_new_tokens=self.cfg.rollout.max_new_tokens,
                                    version=self.version, vocab_size=self._vocab_size)
        if problem:
            self._refuse(identity, "contradicts the ledger", f"Generated {msg.request_id[:60]!r}: "
                         f"{problem}; generated again")
            held = self.ledger.held(msg.request_id, identity, Stage.GENERATING)
            if held is not None:
                self.ledger.requeue(held)
            return
        sample = self.ledger.finish_generation(msg, identity)
        if sample is None:
            log.debug("ignored a stale result %s from %s", msg.request_id, handle.worker_id)
            return
        handle.num_restarts = 0  # it delivers: a later death is not a crash loop
        self._report.on_generated(sample.trajectory, msg)
        group = self.ledger.groups[sample.group_id]
        if group.purpose is Purpose.TRAIN:
            self.staleness.finish(1)
            if self.cfg.staleness.strict and strict_staleness.expired(group, self.version,
                                                                      self.cfg.eta):
                await self._drop_group(group, strict_staleness.STALE)
                return
        if msg.episode_end is not None:  # an episode: its environment gave the reward
            self.ledger.start_scoring(sample, identity)
            outcome = episode_scored(msg)
            self._report.on_scored(outcome.verdict)
            await self._judge_score(sample, outcome, identity)
            return
        unscored = self.ledger.unscored(group)
        if unscored:  # the group's last generation: score them all in one message
            await self._send_score(unscored)

    async def _on_scored(self, identity: bytes, handle: WorkerHandle, msg: Scored) -> None:
        for request_id in msg.request_ids:
            handle.in_flight.discard(request_id)
        problem = scored_problem(msg)
        if problem:
            self._refuse(identity, "contradicts the ledger",
                         f"Scored {msg.request_ids[:1]!r}...: {problem}; scored again")
            for request_id in msg.request_ids:
                await self._score_again(self.ledger.scoring(request_id, identity))
            return
        for request_id, reward, verdict, detail in zip(msg.request_ids, msg.rewards,
                                                       msg.verdicts, msg.details):
            problem = reward_problem(reward)
            if problem:
                self._refuse(identity, "contradicts the ledger",
                             f"Scored {request_id[:60]!r}: {problem}; scored again")
                await self._score_again(self.ledger.scoring(request_id, identity))
                continue
            self._report.on_scored(verdict)
            sample = self.ledger.scoring(request_id, identity)
            if sample is not None:
                handle.num_restarts = 0  # it delivers: a later death is not a crash loop
                await self._judge_score(sample, RewardOutcome(reward=reward, verdict=verdict,
                                                              detail=detail), identity)

    async def _scored(self, group: Group | None) -> None:
        """`group` (None: not complete yet) has a reward for every sample."""
        if group is not None and group.purpose is Purpose.TRAIN:
            reason = next(filter(None, (check(group) for check in self.group_filters)), None)
            if reason is not None:
                await self._drop_group(group, reason)
        if group is not None and group.purpose is Purpose.EVAL:
            state = self._eval_rounds[group.eval_round]
            state["groups"].append(group)
            state["pending"] -= 1
            if state["pending"] == 0:
                state["done"].set()

    async def _on_trained(self, identity: bytes, handle: WorkerHandle, msg: Trained) -> None:
        if not self.trainers.answer(msg):
            self._refuse(identity, "unexpected message", f"Trained for step {msg.step}, which "
                         "no step in progress expects")
            return
        if not msg.replay:
            handle.num_restarts = 0  # it delivers: a later loss is not a crash loop
        if msg.rank == 0 and not msg.replay:
            # Announce the version here, in the receive loop: in stream mode the trainer's
            # WeightsChunks are the next messages, and they must reach the rollout workers
            # after the UpdateWeights that tells them to expect the chunks.
            await self._publish(msg)
        if msg.rank == 0 and msg.checkpoint:
            self.recovery.checkpointed(msg.step, msg.checkpoint)
            self._checkpointed = msg
            if msg.replay:  # a replayed step's record was written when it was first trained
                self._save_resume_state(msg.step)
        self.trainers.finish_if_complete()

    async def _on_weights_chunk(self, identity: bytes, handle: WorkerHandle,
                                msg: WeightsChunk) -> None:
        """Stream mode: relay each bucket to every rollout worker, keep it for late joiners."""
        self._stream_chunks.append(msg)
        for worker in self.pool.ready(WorkerKind.ROLLOUT):
            await self.channel.send(worker.identity, msg)

    async def _on_weights_updated(self, identity: bytes, handle: WorkerHandle,
                                  msg: WeightsUpdated) -> None:
        if msg.error:
            self._weights_failed(handle, msg)
            return
        handle.version = msg.version
        self.weight_retries.loaded(handle.worker_id)
        self._report.on_weights_updated(msg)

    async def _on_worker_error(self, identity: bytes, handle: WorkerHandle,
                               msg: WorkerError) -> None:
        log.error("%s reported: %s%s", handle.worker_id, msg.error,
                  f" (request {msg.request_id})" if msg.request_id else "")
        self._record_event("worker_error", worker_id=handle.worker_id, error=msg.error,
                           fatal=msg.fatal)
        if msg.fatal:
            await self._lose(handle, f"fatal error: {msg.error}")
        elif msg.request_id and handle.kind is WorkerKind.TRAINER and self.trainers.busy:
            await self.trainers.step_failed(handle, msg.error, self._losing, self._lose)
        elif handle.kind is WorkerKind.REWARD and msg.request_ids:
            await self._scoring_failed(identity, handle, msg)
        elif handle.kind is WorkerKind.ROLLOUT and msg.request_id in self.ledger.by_request:
            # The engine refused or failed a generation (e.g. prompt + rollout.max_new_tokens
            # beyond the model's length): sent again it would fail again, and left alone its
            # group would never finish and the run would wait forever.
            raise RunFailed(f"{handle.worker_id} could not generate request {msg.request_id}: "
                            f"{msg.error}")

    async def _scoring_failed(self, identity: bytes, handle: WorkerHandle,
                              msg: WorkerError) -> None:
        """A reward worker's Score failed as a whole (anything but one completion's check,
        which it answers itself): an infrastructure failure of each check it held, retried
        elsewhere or settled by reward.on_error; left alone, the group would wait forever."""
        outcome = RewardOutcome(reward=0.0, verdict=Verdict.ERROR,
                                detail=f"the reward worker failed: {msg.error}"[:2000])
        for request_id in msg.request_ids:
            handle.in_flight.discard(request_id)
            sample = self.ledger.scoring(request_id, identity)
            if sample is not None:
                await self._judge_score(sample, outcome, identity)
