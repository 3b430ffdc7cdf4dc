"""What a reward that could not be computed does to its sample: retried, then dropped or 0.

An infrastructure failure is a check that ended without a verdict on the answer: a
verifier or sandbox error, a check over `reward.timeout_s`, a checker out of memory
(`Verdict.is_error()`), or the reward worker lost while checking. It says nothing about the
completion, so it must not teach the policy that the answer was wrong. A verdict (wrong
answer, no answer, a failing test, a program over its own time limit) is not one.

    failure of attempt a (a <= reward.retries)  -> RETRY: the sample is scored again
                                                   (by the least loaded reward worker)
    failure after reward.retries retries        -> reward.on_error:
                                                     drop: the training group is dropped
                                                           (Core.drop_group, reason
                                                           'reward_error'; admission
                                                           replaces it) - the default
                                                     zero: reward 0 with the failure's
                                                           verdict (the old behaviour)
    an evaluation sample out of retries         -> reward 0, its verdict kept (pass@1
                                                   counts OK verdicts only)
    an episode that ended in a failure          -> reward.on_error at once (its reward came
                                                   from the environment; no reward worker
                                                   can score it again)

Per step (`window_metrics`): the infrastructure failure rate of the checks attempted, the
retries, and the rate of each final verdict among the samples scored.
"""

from __future__ import annotations

import collections
import enum

from areal.config import RewardConfig
from areal.tasks.base import Verdict

REWARD_ERROR = "reward_error"
"""The reason a group dropped here is counted under (rollout/dropped_groups/reward_error)."""


class Action(str, enum.Enum):
    ACCEPT = "accept"
    RETRY = "retry"
    DROP = "drop"


class RewardFaults:
    def __init__(self, cfg: RewardConfig) -> None:
        self.retries = cfg.retries
        self.on_error = cfg.on_error
        self.num_failures = 0
        """Infrastructure failures over the run."""
        self._attempts = 0
        self._failures = 0
        self._retried = 0
        self._verdicts: collections.Counter = collections.Counter()

    def judge(
        self, verdict: Verdict | None, num_failures: int, training: bool, *, retryable: bool = True
    ) -> Action:
        """What to do with a check that ended with `verdict` (None: its worker was lost);
        `num_failures`: the sample's infrastructure failures so far, this one included;
        `retryable` False: it cannot be scored again (an episode's environment reward)."""
        self._attempts += 1
        if verdict is not None and not verdict.is_error():
            self._verdicts[verdict.value] += 1
            return Action.ACCEPT
        self._failures += 1
        self.num_failures += 1
        if retryable and num_failures <= self.retries:
            self._retried += 1
            return Action.RETRY
        if training and self.on_error == "drop":
            return Action.DROP
        self._verdicts[(verdict or Verdict.ERROR).value] += 1
        return Action.ACCEPT

    def retried_where_checked(self, num_retries: int) -> None:
        """Checks that failed for want of infrastructure and were run again where they ran
        (a rollout worker scoring its own completions, reward.num_workers=0), before the
        outcome the controller got: each an attempt, a failure and a retry of this window."""
        self._attempts += num_retries
        self._failures += num_retries
        self._retried += num_retries
        self.num_failures += num_retries

    def accepted(self, verdicts: list[Verdict]) -> None:
        """`judge` of each of `verdicts`, none of them a failure (each is accepted)."""
        self._attempts += len(verdicts)
        self._verdicts.update(v.value for v in verdicts)

    def window_metrics(self) -> dict[str, float]:
        """Rates since the last call (one training step), then a new window starts."""
        scored = sum(self._verdicts.values())
        out = {
            "reward/infra_failures": self._failures,
            "reward/retries": self._retried,
            "reward/infra_failure_rate": self._failures / self._attempts if self._attempts else 0.0,
        }
        out.update({f"reward/verdict_rate/{v}": n / scored for v, n in self._verdicts.items()})
        self._attempts = self._failures = self._retried = 0
        self._verdicts = collections.Counter()
        return out
