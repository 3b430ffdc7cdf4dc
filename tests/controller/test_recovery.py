"""The controller's record of what a restarted trainer must replay."""

from __future__ import annotations

import numpy as np

from areal.controller.recovery import TrainerRecovery
from areal.messages import Train


def _step(step: int, rank: int = 0) -> Train:
    n = np.zeros(3, np.int32)
    return Train(
        step=step,
        version=step - 1,
        token_ids=n,
        logprobs=n.astype(np.float32),
        versions=n,
        loss_mask=n.astype(bool),
        cu_seqlens=np.array([0, 3], np.int32),
        rewards=np.zeros(1, np.float32),
        group_ids=np.zeros(1, np.int64),
        minibatch_sizes=[rank],
    )


def test_steps_since_the_newest_checkpoint_are_replayed_in_order_for_every_rank():
    recovery = TrainerRecovery(checkpoint_every=2)
    for step in range(1, 6):
        recovery.record([_step(step, 0), _step(step, 1)])
        if step % 2 == 0:
            recovery.checkpointed(step, f"/ckpt/{step}")
    assert recovery.checkpoint == "/ckpt/4"
    # step 5 is the one in progress: sent again as itself, not replayed
    assert recovery.replays(before_step=5) == []
    recovery.record([_step(6, 0), _step(6, 1)])
    (replay,) = recovery.replays(before_step=6)
    assert [(m.step, m.version, m.minibatch_sizes, m.replay) for m in replay] == [
        (5, 4, [0], True),
        (5, 4, [1], True),
    ]
    assert all(not m.replay for m in recovery.steps[0])  # what was kept is unchanged


def test_without_checkpoints_nothing_is_kept():
    recovery = TrainerRecovery(checkpoint_every=0)
    recovery.record([_step(1)])
    assert not recovery.enabled and recovery.steps == [] and recovery.replays(2) == []
