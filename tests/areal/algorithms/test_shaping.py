"""What the optimiser sees of a batch: DAPO's overlong penalty (by hand, from the paper's
formula), overlong filtering, the zero-advantage test of dynamic sampling, and the
per-minibatch sequence counts that normalise the sequence-mean losses across ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal.algorithms.sharding import shard_batch
from areal.algorithms.shaping import (
    has_advantage_spread,
    overlong_penalty,
    shaping_metrics,
    training_batch,
)
from areal.config import load_config
from areal.types import Trajectory, pack


def _traj(reward: float, length: int, finish: str = "stop", group: int = 0) -> Trajectory:
    t = Trajectory.from_generation(
        prompt_id=f"p{group}",
        group_id=group,
        prompt_ids=[1, 2, 3],
        output_ids=[5] * length,
        output_logprobs=[-1.0] * length,
        output_versions=[0] * length,
        finish_reason=finish,
    )
    t.reward = reward
    return t


def _cfg(*overrides: str):
    return load_config(
        overrides=[
            "rollout.max_new_tokens=10",
            "task.group_size=2",
            "trainer.batch_size=4",
            *overrides,
        ]
    )


def test_overlong_penalty_follows_dapo_eq_13():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4, -1 at 10.
    lengths = torch.arange(0, 11)
    got = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=1.0)
    want = [0.0] * 7 + [-0.25, -0.5, -0.75, -1.0]
    assert got.tolist() == want
    assert overlong_penalty(lengths, 10, 4, penalty=0.5).tolist() == [w / 2 for w in want]
    assert overlong_penalty(lengths, 10, 0, penalty=1.0).tolist() == [0.0] * 11


def test_penalty_enters_the_advantages_but_not_the_verifier_reward():
    trajs = [
        _traj(1.0, 4),
        _traj(1.0, 10, "length"),
        _traj(0.0, 3, group=1),
        _traj(1.0, 8, group=1),
    ]
    cfg = _cfg("trainer.advantage.overlong_buffer=4", "trainer.advantage.estimator=drgrpo")
    batch, advantages = training_batch(trajs, pack(trajs), cfg)
    # Group 0: rewards 1 and 1 - 1 = 0 -> +-0.5; group 1: 0 and 1 - 0.5 -> -+0.25.
    assert advantages.tolist() == pytest.approx([0.5, -0.5, -0.25, 0.25])
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 1.0]
    assert torch.equal(batch.loss_mask, pack(trajs).loss_mask)
    assert shaping_metrics(trajs, cfg) == pytest.approx(
        {"rollout/overlong_penalty_mean": -1.5 / 4, "rollout/overlong_penalized_frac": 0.5}
    )
    assert shaping_metrics(trajs, _cfg()) == {}


def test_truncated_completions_keep_their_reward_but_leave_the_loss():
    trajs = [
        _traj(1.0, 4),
        _traj(0.0, 10, "length"),
        _traj(0.5, 6, group=1),
        _traj(0.0, 10, "length", group=1),
    ]
    packed = pack(trajs)
    cfg = _cfg("trainer.advantage.mask_truncated=true")
    batch, advantages = training_batch(trajs, packed, cfg)
    _, unmasked_advantages = training_batch(trajs, packed, _cfg())
    assert torch.equal(advantages, unmasked_advantages)  # the baseline still sees them
    per_seq = [int(batch.loss_mask[batch.token_index([i])].sum()) for i in range(4)]
    assert per_seq == [4, 0, 6, 0]
    assert torch.equal(batch.token_ids, packed.token_ids)
    assert shaping_metrics(trajs, cfg) == {"rollout/truncated_masked": 2.0}


@pytest.mark.parametrize(
    "rewards, overrides, spread",
    [
        ([1.0, 1.0, 1.0], [], False),  # all solved
        ([0.0, 0.0, 0.0], ["trainer.advantage.estimator=rloo"], False),
        ([0.2, 0.7, 0.7], [], True),
        ([2.0, 3.0, 5.0], ["trainer.advantage.reward_clip=1.0"], False),  # equal after the clip
        ([1.0], [], False),  # a singleton group
    ],
)
def test_zero_advantage_groups_are_recognised(rewards, overrides, spread):
    trajs = [_traj(r, 4) for r in rewards]
    assert has_advantage_spread(trajs, _cfg(*overrides)) is spread


def test_the_overlong_penalty_can_give_an_all_solved_group_a_spread():
    trajs = [_traj(1.0, 4), _traj(1.0, 10, "length")]
    assert not has_advantage_spread(trajs, _cfg())
    assert has_advantage_spread(trajs, _cfg("trainer.advantage.overlong_buffer=4"))
    # Batch normalisation does not count: a group is judged by its own baseline.
    assert not has_advantage_spread(trajs, _cfg("trainer.advantage.batch_norm=true"))


def test_shards_count_the_sequences_with_loss_tokens_of_each_global_minibatch():
    trajs = [
        _traj(float(i % 2), length, group=i // 2)
        for i, length in enumerate([3, 9, 4, 12, 7, 5, 2, 8])
    ]
    batch = pack(trajs)
    batch.loss_mask[batch.token_index([2])] = False  # a sequence without loss tokens
    shards = shard_batch(batch, torch.zeros(8), num_ranks=2, num_minibatches=2)
    plan = [
        [
            [
                s.seq_indices[i]
                for i in range(sum(s.minibatch_sizes[:m]), sum(s.minibatch_sizes[: m + 1]))
            ]
            for m in range(2)
        ]
        for s in shards
    ]
    for m in range(2):
        seqs = plan[0][m] + plan[1][m]
        want = sum(int(batch.loss_mask[batch.token_index([i])].any()) for i in seqs)
        assert shards[0].minibatch_loss_seqs[m] == shards[1].minibatch_loss_seqs[m] == want
    assert sum(shards[0].minibatch_loss_seqs) == 7
    assert np.sum(shards[0].minibatch_loss_tokens) == int(batch.loss_mask.sum())


def test_bad_shaping_options_name_the_field():
    from areal.config import ConfigError

    with pytest.raises(ConfigError, match="overlong_buffer=20 exceeds rollout.max_new_tokens=10"):
        _cfg("trainer.advantage.overlong_buffer=20")
    with pytest.raises(ConfigError, match="trainer.advantage.overlong_penalty=-1.0 must be >= 0"):
        _cfg("trainer.advantage.overlong_penalty=-1")
