"""Scoring: generated samples to reward workers, and what each outcome does to its sample.

    a group's last sample generated --score--> one Score for the group's unscored samples
                   to the least-loaded reward worker, or queued until one has room
    Scored         --on_scored--> each outcome judged (reward_faults.py): accepted (the
                   sample is done), scored again alone, or its group dropped
    a reward worker's Score failed, or the worker was lost mid-check
                   --> an infrastructure failure of each check it held, judged the same way
    an episode     its environment's reward arrives with the Generated (episodes.py) and is
                   judged the same way, never retried by a reward worker
    reward.num_workers=0: no reward workers; each rollout worker scores its own completions
                   (retrying failed checks itself) and its Completions carries the rewards:
                   --all_accepted: recorded with them, on_accepted_completions; else
                   on_scored_completions--> each judged the same way, never retried here

Owns the queue of Scores waiting for a reward worker, the reward workers' room and the
reward-fault policy's counts. A sample accepted completes its group when it was the last:
`on_complete` (the controller's) then sends the group on (buffer, evaluation round, or a
group filter's drop); a group to drop goes to `drop`. Decisions only: what to send goes into
an Outbox.
"""

from __future__ import annotations

import collections
import math
from typing import cast
from collections.abc import Callable

from areal.config import RunConfig
from areal.controller.checks import reward_problem, scored_problem
from areal.controller.episodes import outcome_of, rollout_outcome
from areal.controller.ledger import Group, Ledger, Purpose, RecordedMessage, Sample
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle
from areal.controller.report import StepReport
from areal.controller.reward_faults import REWARD_ERROR, Action, RewardFaults
from areal.controller.room import WorkerRoom
from areal.messages import Completions, Generated, Score, Scored, WorkerError
from areal.tasks.base import RewardOutcome, Verdict

Refuse = Callable[[bytes, str, str], None]


class Scoring:
    def __init__(
        self,
        cfg: RunConfig,
        ledger: Ledger,
        report: StepReport,
        refuse: Refuse,
        on_complete: Callable[[Group | None, Outbox], None],
        drop: Callable[[Group, str, Outbox], None],
    ) -> None:
        """`refuse(identity, reason, detail)`: log a message dropped for contradicting the
        ledger; `on_complete(group or None, out)`: a sample was scored (its group, if that
        completed it); `drop(group, reason, out)`: never train on `group`."""
        self.ledger = ledger
        self.report = report
        self.refuse = refuse
        self.on_complete = on_complete
        self.drop = drop
        self.room = WorkerRoom(None)
        """Ready reward workers, least loaded first."""
        self.queue: collections.deque[list[Sample]] = collections.deque()
        """Samples to score (each entry one Score: samples of one group), waiting for a
        reward worker with room; sent oldest first, taken from the front."""
        self.faults = RewardFaults(cfg.reward)
        self.has_reward_workers = cfg.reward.num_workers > 0
        """False: the rollout workers score (reward.num_workers=0), a failed check is
        retried where it ran, and none is sent to a reward worker."""

    @property
    def num_queued(self) -> int:
        return sum(len(samples) for samples in self.queue)

    def can_dispatch(self) -> bool:
        return bool(self.queue and self.room.peek())

    def dispatch(self, out: Outbox) -> None:
        """Send queued Scores while a reward worker has room."""
        while self.queue and self.room.peek():
            self.score(self.queue.popleft(), out)

    def score(self, samples: list[Sample], out: Outbox) -> None:
        """Score `samples` (generated, of one group) in one message to the least-loaded
        reward worker, or queue them until one has room."""
        worker = self.room.take()
        if worker is None:
            self.queue.append(samples)
            return
        group = self.ledger.groups[samples[0].group_id]
        for sample in samples:
            self.ledger.start_scoring(sample, worker.address)
            worker.in_flight.add(sample.request_id)
        out.send(
            worker.address,
            Score(
                request_ids=[s.request_id for s in samples],
                prompt_id=group.prompt.prompt_id,
                completion_ids=[s.output_ids() for s in samples],
                reference=group.prompt.reference,
            ),
        )
        self.room.offer(worker)

    def forget_group(self, group_id: int) -> None:
        """A dropped group's queued Scores are never sent."""
        self.queue = collections.deque(
            samples for samples in self.queue if samples[0].group_id != group_id
        )

    # -- outcomes -------------------------------------------------------------------------------

    def on_scored(self, identity: bytes, handle: WorkerHandle, msg: Scored, out: Outbox) -> None:
        for request_id in msg.request_ids:
            handle.in_flight.discard(request_id)
        problem = scored_problem(msg)
        if problem:
            self.refuse(
                identity,
                "contradicts the ledger",
                f"Scored {msg.request_ids[:1]!r}...: {problem}; scored again",
            )
            for request_id in msg.request_ids:
                self.score_again(self.ledger.scoring(request_id, identity), out)
            return
        if all(map(math.isfinite, msg.rewards)) and not any(v.is_error() for v in msg.verdicts):
            self._accept(identity, handle, msg, out)
            return
        for request_id, reward, verdict, detail in zip(
            msg.request_ids, msg.rewards, msg.verdicts, msg.details, strict=True
        ):
            problem = reward_problem(reward)
            if problem:
                self.refuse(
                    identity,
                    "contradicts the ledger",
                    f"Scored {request_id[:60]!r}: {problem}; scored again",
                )
                self.score_again(self.ledger.scoring(request_id, identity), out)
                continue
            self.report.on_scored(verdict)
            sample = self.ledger.scoring(request_id, identity)
            if sample is not None:
                handle.num_restarts = 0  # it delivers: a later death is not a crash loop
                self.judge(
                    sample,
                    RewardOutcome(reward=reward, verdict=verdict, detail=detail),
                    identity,
                    out,
                )

    def _accept(self, identity: bytes, handle: WorkerHandle, msg: Scored, out: Outbox) -> None:
        """A Scored whose every outcome is a verdict with a finite reward: what `judge` does
        for each (each is accepted), the counting done once and `on_complete` called only
        for the group it completes (usually the message's one group; the others it would
        be told of are None)."""
        self.report.on_scored_all(msg.verdicts)
        held, scored, on_complete = self.ledger.scoring, self.ledger.scored, self.on_complete
        accepted = []
        for request_id, reward, verdict in zip(
            msg.request_ids, msg.rewards, msg.verdicts, strict=True
        ):
            sample = held(request_id, identity)
            if sample is not None:
                accepted.append(verdict)
                group = scored(sample, reward, verdict)
                if group is not None:
                    on_complete(group, out)
        if accepted:
            handle.num_restarts = 0  # it delivers: a later death is not a crash loop
            self.faults.accepted(accepted)

    def on_failed(
        self, identity: bytes, handle: WorkerHandle, msg: WorkerError, out: Outbox
    ) -> None:
        """A reward worker's Score failed as a whole (anything but one completion's check,
        which it answers itself): an infrastructure failure of each check it held, retried
        elsewhere or settled by reward.on_error; left alone, the group would wait forever."""
        outcome = RewardOutcome(
            reward=0.0,
            verdict=Verdict.ERROR,
            detail=f"the reward worker failed: {msg.error}"[:2000],
        )
        for request_id in msg.request_ids:
            handle.in_flight.discard(request_id)
            sample = self.ledger.scoring(request_id, identity)
            if sample is not None:
                self.judge(sample, outcome, identity, out)

    def on_rollout_scored(
        self, sample: Sample, msg: Generated, identity: bytes, out: Outbox
    ) -> None:
        """`sample`, just generated, arrived with the outcome its rollout worker found (an
        episode's environment, or the task's reward function under reward.num_workers=0):
        judged at once."""
        self.ledger.start_scoring(sample, identity)
        outcome = rollout_outcome(msg)
        self.faults.retried_where_checked(msg.check_retries)
        self.report.on_scored(outcome.verdict)
        self.judge(sample, outcome, identity, out)

    @staticmethod
    def all_accepted(msg: Completions) -> bool:
        """Whether `msg` carries its rollout worker's outcomes (reward.num_workers=0), every
        one a verdict with a finite reward: each is accepted as it is recorded
        (`Ledger.finish_completions`, then `on_accepted_completions`)."""
        return (
            msg.scored
            and all(map(math.isfinite, msg.rewards))
            and not any(verdict.is_error() for verdict in msg.verdicts)
        )

    def on_accepted_completions(
        self, recorded: RecordedMessage, msg: Completions, out: Outbox
    ) -> None:
        """The samples of `msg` recorded with their accepted outcomes (`all_accepted`): what
        `judge` does for each, the counting done once and `on_complete` called for the
        groups they completed."""
        if len(recorded.samples) == len(msg.verdicts):  # all recorded: the message's own
            verdicts = msg.verdicts
        else:
            verdicts = [cast(Verdict, sample.verdict) for sample in recorded.samples]
        self.report.on_scored_all(verdicts)
        for group in recorded.completed:
            self.ledger.complete(group)
            self.on_complete(group, out)
        if verdicts:
            self.faults.accepted(verdicts)
        self.faults.retried_where_checked(sum(msg.check_retries))

    def on_scored_completions(
        self, samples: list[Sample], msg: Completions, identity: bytes, out: Outbox
    ) -> None:
        """`samples`, the completions of `msg` just recorded (in message order), with the
        outcomes their rollout worker found (reward.num_workers=0), not all accepted
        (`all_accepted`): each judged on its own; a message without outcomes makes each an
        infrastructure failure saying so."""
        for sample in samples:
            if self.ledger.scoring(sample.request_id, None) is not sample:
                continue  # its group was dropped by an outcome judged before it
            self.ledger.start_scoring(sample, identity)
            if msg.scored:
                i = sample.message_index()
                outcome = outcome_of(msg.rewards[i], msg.verdicts[i], msg.details[i])
                self.faults.retried_where_checked(msg.check_retries[i])
            else:
                outcome = outcome_of(0.0, None, "")
            self.report.on_scored(outcome.verdict)
            self.judge(sample, outcome, identity, out)

    def worker_lost(self, rescore: list[Sample], out: Outbox) -> None:
        """The checks a lost reward worker held: an infrastructure failure of each."""
        for sample in rescore:
            if self.ledger.scoring(sample.request_id, None) is sample:  # group not dropped
                self.judge(sample, None, None, out)

    def judge(
        self, sample: Sample, outcome: RewardOutcome | None, identity: bytes | None, out: Outbox
    ) -> None:
        """A check of `sample` ended (outcome None: its reward worker was lost): accept its
        reward, score it again, or drop its group (reward_faults.py)."""
        group = self.ledger.groups[sample.group_id]
        if outcome is None or outcome.verdict.is_error():
            sample.num_score_failures += 1
        # An episode's reward came from its environment, in the rollout worker: the reward
        # workers cannot score it again, so its failure goes straight to reward.on_error; as
        # does any failure when there are no reward workers (the rollout worker retried it).
        action = self.faults.judge(
            outcome.verdict if outcome else None,
            sample.num_score_failures,
            group.purpose is Purpose.TRAIN,
            retryable=self.has_reward_workers and not sample.is_episode,
        )
        if action is Action.RETRY:
            self.score_again(sample, out)
            return
        if action is Action.DROP:
            self.drop(group, REWARD_ERROR, out)
            return
        if outcome is None:
            outcome = RewardOutcome(
                reward=0.0,
                verdict=Verdict.ERROR,
                detail="the reward worker was lost while checking",
            )
        self.on_complete(self.ledger.finish_scoring(sample.request_id, outcome, identity), out)

    def score_again(self, sample: Sample | None, out: Outbox) -> None:
        """Check `sample` again, alone, on the least-loaded reward worker (None: nothing
        held, a stale answer)."""
        if sample is not None:
            self.ledger.retry_scoring(sample)
            self.score([sample], out)
