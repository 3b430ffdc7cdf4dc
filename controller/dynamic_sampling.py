"""DAPO's dynamic sampling (arXiv 2503.14476) as a group filter of the controller.

A prompt group whose samples all get advantage 0 (their rewards, after shaping, are equal:
all solved or all failed) adds nothing to the policy gradient but still fills a slot of the
batch. With `trainer.advantage.dynamic_sampling`, the controller checks every training group
when its last sample is scored (`Controller.group_filters`, run by core.py) and drops such a
group through the shared mechanism (`Core.drop_group`): its staleness slots are freed,
admission draws a replacement, and the step records count it under
`rollout/dropped_groups/zero_advantage`. Batches therefore stay full of groups with signal,
and the staleness bound counts only what is trained or in flight.

The test is `areal.algorithms.shaping.has_advantage_spread`, the same rewards and baseline
the trainer will use. When the model solves (or fails) every prompt, every group would be
dropped and the run would generate forever: after `dynamic_sampling_max_drops` drops in a
row the run fails with an error that says so.
"""

from __future__ import annotations

from areal.algorithms.shaping import has_advantage_spread
from areal.config import RunConfig
from areal.controller.ledger import Group
from areal.controller.trainers import RunFailed

REASON = "zero_advantage"
"""The drop reason in the step records (`rollout/dropped_groups/zero_advantage`)."""


class DynamicSampling:
    """`(Group) -> 'zero_advantage' | None`, failing the run after too many drops in a row."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.max_in_a_row = cfg.trainer.advantage.dynamic_sampling_max_drops
        self.num_in_a_row = 0

    def __call__(self, group: Group) -> str | None:
        if has_advantage_spread(group.trajectories(), self.cfg):
            self.num_in_a_row = 0
            return None
        self.num_in_a_row += 1
        if self.max_in_a_row and self.num_in_a_row >= self.max_in_a_row:
            rewards = sorted({round(t.reward, 6) for t in group.trajectories()})
            raise RunFailed(
                f"dynamic sampling dropped {self.num_in_a_row} prompt groups in a row, every one "
                f"with equal rewards within the group (the last: {rewards}): the model solves or "
                "fails every prompt, so no batch can be filled. Use harder or easier prompts, "
                "raise trainer.advantage.dynamic_sampling_max_drops, or turn "
                "trainer.advantage.dynamic_sampling off"
            )
        return REASON


def group_filters(cfg: RunConfig) -> list:
    """The group filters this module contributes for `cfg` (in order)."""
    return [DynamicSampling(cfg)] if cfg.trainer.advantage.dynamic_sampling else []
