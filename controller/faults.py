"""The controller's repairs of two faults that workers survive: a weight load that failed
and a reward that could not be computed. A mixin of `Controller` (controller.py), kept apart
so that the actor's module stays about the pipeline; the policies themselves are
weight_retry.py and reward_faults.py, pure decisions.

    WeightsUpdated(error) -> _weights_failed: kept, one retry owed
    liveness tick         -> _retry_weight_loads: the newest weights there are, sent again;
                             a worker failing too often in a row is lost (restarted)
    an outcome of a Scored, or a reward worker lost mid-check -> _judge_score: accept the
                             reward, score the sample again (alone), or drop its group
                             (reason reward_error)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from areal.controller.ledger import Purpose, Sample
from areal.controller.pool import WorkerHandle
from areal.controller.reward_faults import REWARD_ERROR, Action
from areal.controller.weight_retry import newest_on_disk
from areal.messages import UpdateWeights, WeightsUpdated, WorkerKind
from areal.tasks.base import RewardOutcome, Verdict

if TYPE_CHECKING:
    from areal.controller.controller import Controller

log = logging.getLogger("areal.controller")


class FaultRepairs:
    """Methods of Controller (self is the Controller)."""

    # -- weight loads ---------------------------------------------------------------------------

    def _weights_failed(self: Controller, handle: WorkerHandle, msg: WeightsUpdated) -> None:
        failure = self.weight_retries.failed(handle.worker_id, msg.version, msg.error)
        log.warning("%s could not load weights version %d (%d in a row): %s; sending the "
                    "newest weights again", handle.worker_id, msg.version, failure.attempts,
                    msg.error)
        self._record_event("weights_load_failed", worker_id=handle.worker_id,
                           failed_version=msg.version, error=msg.error,
                           attempt=failure.attempts)

    async def _retry_weight_loads(self: Controller) -> None:
        """Send the newest weights there are again to workers whose load failed, once per
        failure (weight_retry.py); lose those that failed too often in a row."""
        retry, lose = self.weight_retries.due()
        ready = {h.worker_id: h for h in self.pool.ready(WorkerKind.ROLLOUT)}
        for worker_id, failure in lose:
            if worker_id in ready:
                await self._lose(ready[worker_id], f"could not load weights ({failure.attempts}"
                                 f" failures in a row, the last of version {failure.version}):"
                                 f" {failure.error}")
        for worker_id, failure in retry:
            handle = ready.get(worker_id)
            if handle is None:
                self.weight_retries.loaded(worker_id)  # gone; a new process starts afresh
            elif self.cfg.weight_sync.mode == "collective":
                self.groups.request_resend()
            elif not await self._send_newest_weights(handle, failure.version):
                self.weight_retries.loaded(worker_id)  # it serves the newest there is

    async def _send_newest_weights(self: Controller, handle: WorkerHandle, failed: int) -> bool:
        """Disk: the newest version directory there is, older than the `failed` one; stream:
        the newest version's chunks. False when there is nothing newer than what `handle`
        serves (the trainer's next version will be)."""
        mode, chunks, path, version = self.cfg.weight_sync.mode, [], None, self.version
        if mode == "stream":
            chunks = self._stream_chunks
        else:
            version, path = newest_on_disk(self._setup.run_dir, self._latest_weights,
                                           self.version, below=failed) or (0, None)
        if version <= handle.version or (mode == "stream" and not chunks):
            return False
        await self.channel.send(handle.identity, UpdateWeights(
            version=version, mode=mode, path=path, num_chunks=len(chunks),
            interrupt=self._interrupt()))
        for chunk in chunks:
            await self.channel.send(handle.identity, chunk)
        return True

    # -- rewards -------------------------------------------------------------------------------

    async def _judge_score(self: Controller, sample: Sample, outcome: RewardOutcome | None,
                           identity: bytes | None) -> None:
        """A check of `sample` ended (outcome None: its reward worker was lost): accept its
        reward, score it again, or drop its group (reward_faults.py)."""
        group = self.ledger.groups[sample.group_id]
        if outcome is None or outcome.verdict.is_error():
            sample.num_score_failures += 1
        # An episode's reward came from its environment, in the rollout worker: the reward
        # workers cannot score it again, so its failure goes straight to reward.on_error.
        action = self.reward_faults.judge(outcome.verdict if outcome else None,
                                          sample.num_score_failures,
                                          group.purpose is Purpose.TRAIN,
                                          retryable=not sample.trajectory.episode)
        if action is Action.RETRY:
            await self._score_again(sample)
            return
        if action is Action.DROP:
            await self._drop_group(group, REWARD_ERROR)
            return
        if outcome is None:
            outcome = RewardOutcome(reward=0.0, verdict=Verdict.ERROR,
                                    detail="the reward worker was lost while checking")
        await self._scored(self.ledger.finish_scoring(sample.request_id, outcome, identity))

    async def _score_again(self: Controller, sample: Sample | None) -> None:
        """Check `sample` again, alone, on the least-loaded reward worker (None: nothing
        held, a stale answer)."""
        if sample is not None:
            self.ledger.retry_scoring(sample)
            await self._send_score([sample])
