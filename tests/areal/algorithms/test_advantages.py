"""Advantages: hand-computed values, group invariants, a naive reference, config glue."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.algorithms.advantages import (
    compute_advantages,
    group_advantages,
    normalize_batch,
    shape_rewards,
    token_advantages,
)
from areal.config import AdvantageConfig
from areal.types import Trajectory, pack

ESTIMATORS = ["grpo", "drgrpo", "rloo"]


def _naive_group_advantages(
    rewards: list[float], group_ids: list[int], estimator: str, eps: float
) -> list[float]:
    """Per-sequence loop over the textbook formulas (float64 Python arithmetic)."""
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        group = [x for x, h in zip(rewards, group_ids, strict=True) if h == g]
        n, mean = len(group), sum(group) / len(group)
        if n == 1:
            out.append(0.0)
        elif estimator == "drgrpo":
            out.append(r - mean)
        elif estimator == "rloo":
            out.append(r - (sum(group) - r) / (n - 1))
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
            out.append((r - mean) / (std + eps))
    return out


def test_shape_rewards_scales_then_biases_then_clips(assert_close):
    rewards = torch.tensor([-3.0, 0.5, 2.0])
    # scale 2 -> [-6, 1, 4]; bias 1 -> [-5, 2, 5]; clip 3 -> [-3, 2, 3]
    assert_close(
        shape_rewards(rewards, scale=2.0, bias=1.0, clip=3.0), torch.tensor([-3.0, 2.0, 3.0])
    )
    assert_close(shape_rewards(rewards, scale=2.0, bias=1.0), torch.tensor([-5.0, 2.0, 5.0]))
    assert_close(shape_rewards(rewards), rewards)


def test_shape_rewards_rejects_non_positive_clip():
    with pytest.raises(ValueError, match="clip=0"):
        shape_rewards(torch.ones(2), clip=0)


def test_integer_rewards_become_float32(assert_close):
    shaped = shape_rewards(torch.tensor([0, 1, 1]))
    assert shaped.dtype == torch.float32, shaped.dtype
    adv = group_advantages(torch.tensor([0, 2]), torch.tensor([0, 0]), estimator="drgrpo")
    assert_close(adv, torch.tensor([-1.0, 1.0]))


# Groups (ids deliberately sparse and interleaved): 5 -> [2, 4, 9], 9 -> [1, 0], 100 -> [7].
# Group 5: mean 5, deviations [-3, -1, 4], unbiased var (9+1+16)/2 = 13.
# Group 9: mean 0.5, deviations [0.5, -0.5], unbiased var 0.5.
HAND_REWARDS = [2.0, 1.0, 4.0, 0.0, 9.0, 7.0]
HAND_GROUPS = [5, 9, 5, 9, 5, 100]
HAND_EXPECTED = {
    "grpo": [
        -3 / math.sqrt(13),
        0.5 / math.sqrt(0.5),
        -1 / math.sqrt(13),
        -0.5 / math.sqrt(0.5),
        4 / math.sqrt(13),
        0.0,
    ],
    "drgrpo": [-3.0, 0.5, -1.0, -0.5, 4.0, 0.0],
    # r_i minus the mean of the others: 2-(4+9)/2, 1-0, 4-(2+9)/2, 0-1, 9-(2+4)/2, singleton.
    "rloo": [-4.5, 1.0, -1.5, -1.0, 6.0, 0.0],
}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_advantages_hand_computed(estimator, assert_close):
    adv = group_advantages(
        torch.tensor(HAND_REWARDS, dtype=torch.float64),
        torch.tensor(HAND_GROUPS),
        estimator=estimator,
        eps=0.0,
    )
    assert_close(
        adv, torch.tensor(HAND_EXPECTED[estimator], dtype=torch.float64), atol=1e-12, what=estimator
    )


def test_grpo_uses_unbiased_group_std(assert_close):
    # [1, 0, 0, 1]: mean 0.5; unbiased std sqrt(1/3) gives +-0.866, population std 0.5 gives +-1.
    adv = group_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64),
        torch.zeros(4, dtype=torch.long),
        eps=0.0,
    )
    assert_close(
        adv,
        torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64) * math.sqrt(3) / 2,
        atol=1e-12,
    )


def test_grpo_eps_is_added_to_the_std(assert_close):
    adv = group_advantages(
        torch.tensor([0.0, 2.0], dtype=torch.float64), torch.zeros(2, dtype=torch.long), eps=0.5
    )
    # deviations [-1, 1], unbiased std sqrt(2); divided by sqrt(2) + 0.5.
    assert_close(
        adv, torch.tensor([-1.0, 1.0], dtype=torch.float64) / (math.sqrt(2) + 0.5), atol=1e-12
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("value", [0.1, 1 / 3, -7.3, 1e6 + 0.1, 0.0])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_identical_rewards_give_exact_zero(value, estimator, dtype, eps):
    rewards = torch.full((7,), value, dtype=dtype)
    adv = group_advantages(rewards, torch.zeros(7, dtype=torch.long), estimator=estimator, eps=eps)
    assert bool((adv == 0).all()), f"{estimator} {dtype} value={value}: got {adv.tolist()}"


@given(
    values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    estimator=st.sampled_from(ESTIMATORS),
)
@settings(max_examples=150, deadline=None)
def test_equal_reward_groups_are_exactly_zero_among_other_groups(values, sizes, estimator):
    groups = list(zip(values, sizes, strict=False))
    rewards = torch.tensor([v for v, n in groups for _ in range(n)], dtype=torch.float32)
    group_ids = torch.tensor([g for g, (_, n) in enumerate(groups) for _ in range(n)])
    adv = group_advantages(rewards, group_ids, estimator=estimator)
    assert bool((adv == 0).all()), f"{estimator}: {adv.tolist()} for {groups}"


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_singleton_groups_give_zero(estimator):
    adv = group_advantages(
        torch.tensor([3.0, -1.0, 0.25]), torch.tensor([0, 1, 2]), estimator=estimator
    )
    assert adv.tolist() == [0.0, 0.0, 0.0], adv.tolist()


group_batches = st.lists(
    st.tuples(st.integers(0, 5), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=40
)


@given(batch=group_batches, estimator=st.sampled_from(ESTIMATORS))
@settings(max_examples=200, deadline=None)
def test_group_advantages_match_naive_reference(batch, estimator, assert_close):
    group_ids = [g for g, _ in batch]
    rewards = [r for _, r in batch]
    adv = group_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(group_ids),
        estimator=estimator,
        eps=1e-6,
    )
    expected = _naive_group_advantages(rewards, group_ids, estimator, eps=1e-6)
    # The naive reference does not shift by the group minimum, so allow rounding noise
    # amplified by 1/(std + eps) for nearly-equal groups.
    assert_close(
        adv, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-9, what=estimator
    )


@given(batch=group_batches, estimator=st.sampled_from(ESTIMATORS))
@settings(max_examples=200, deadline=None)
def test_group_advantages_sum_to_zero_per_group(batch, estimator):
    group_ids = torch.tensor([g for g, _ in batch])
    rewards = torch.tensor([r for _, r in batch], dtype=torch.float64)
    adv = group_advantages(rewards, group_ids, estimator=estimator)
    for g in group_ids.unique().tolist():
        in_group = group_ids == g
        total = adv[in_group].sum().item()
        bound = 1e-9 * max(1.0, adv[in_group].abs().sum().item())
        assert abs(total) <= bound, f"{estimator} group {g}: sum {total:.3e} > {bound:.3e}"


@given(batch=group_batches, estimator=st.sampled_from(ESTIMATORS), seed=st.integers(0, 2**16))
@settings(max_examples=100, deadline=None)
def test_group_advantages_commute_with_permutation(batch, estimator, seed, assert_close):
    group_ids = torch.tensor([g for g, _ in batch])
    rewards = torch.tensor([r for _, r in batch], dtype=torch.float64)
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))
    adv = group_advantages(rewards, group_ids, estimator=estimator)
    adv_perm = group_advantages(rewards[perm], group_ids[perm], estimator=estimator)
    assert_close(adv_perm, adv[perm], atol=1e-9, what=f"{estimator} permuted")


def test_group_advantages_reject_unknown_estimator_and_bad_shapes():
    with pytest.raises(ValueError, match="estimator='ppo' is not one of grpo, drgrpo, rloo"):
        group_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), estimator="ppo")
    with pytest.raises(ValueError, match=r"must both have shape \[S\]"):
        group_advantages(torch.ones(3), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_advantages_of_an_empty_batch_are_empty(estimator):
    adv = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), estimator=estimator)
    assert adv.shape == (0,) and adv.dtype == torch.float32, (adv.shape, adv.dtype)


def test_normalize_batch_hand_computed(assert_close):
    # [1, 2, 4]: mean 7/3, unbiased std sqrt(((16 + 1 + 25) / 9) / 2) = sqrt(7/3).
    out = normalize_batch(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64), eps=0.0)
    expected = (torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64) - 7 / 3) / math.sqrt(7 / 3)
    assert_close(out, expected, atol=1e-12)


def test_normalize_batch_gives_mean_zero_and_unbiased_std_one(assert_close):
    adv = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3 + 5
    out = normalize_batch(adv, eps=0.0)
    assert_close(out.mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-12, what="mean")
    assert_close(out.std(), torch.tensor(1.0, dtype=torch.float64), atol=1e-12, what="std")


def test_batch_and_group_normalisation_use_the_same_std_convention(assert_close):
    # One group spanning the batch: GRPO's group normalisation and the batch one coincide.
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 3.0], dtype=torch.float64)
    group = group_advantages(rewards, torch.zeros(5, dtype=torch.long), eps=0.0)
    assert_close(normalize_batch(rewards, eps=0.0), group, atol=1e-12)
    assert_close(
        group,
        (rewards - rewards.mean()) / rewards.std(),
        atol=1e-12,
        what="torch.std's default (unbiased)",
    )


def test_normalize_batch_with_mask_uses_masked_entries_and_zeroes_the_rest(assert_close):
    adv = torch.tensor([100.0, 1.0, -50.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([False, True, False, True])
    out = normalize_batch(adv, mask, eps=0.0)
    # masked entries [1, 3]: mean 2, unbiased std sqrt(2) -> [-1, 1] / sqrt(2)
    expected = torch.tensor([0.0, -1.0, 0.0, 1.0], dtype=torch.float64) / math.sqrt(2)
    assert_close(out, expected, atol=1e-12)


def test_normalize_batch_degenerate_inputs_give_exact_zero():
    assert normalize_batch(torch.full((5,), 0.1)).tolist() == [0.0] * 5
    assert normalize_batch(torch.tensor([2.0, 3.0]), torch.tensor([False, False])).tolist() == [
        0,
        0,
    ]
    assert normalize_batch(torch.tensor([4.0])).tolist() == [0.0]
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        normalize_batch(torch.ones(3), torch.ones(3))


def test_compute_advantages_hand_computed(assert_close):
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    group_ids = torch.zeros(4, dtype=torch.long)
    cfg = AdvantageConfig(estimator="drgrpo", reward_scale=2.0, reward_bias=-1.0)
    # shaped [-1, 1, 1, 1], mean 0.5
    assert_close(
        compute_advantages(rewards, group_ids, cfg),
        torch.tensor([-1.5, 0.5, 0.5, 0.5], dtype=torch.float64),
        atol=1e-12,
    )
    cfg.reward_clip = 0.5
    # shaped and clipped [-0.5, 0.5, 0.5, 0.5], mean 0.25
    assert_close(
        compute_advantages(rewards, group_ids, cfg),
        torch.tensor([-0.75, 0.25, 0.25, 0.25], dtype=torch.float64),
        atol=1e-12,
    )


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("batch_norm", [False, True])
def test_compute_advantages_composes_the_steps_in_order(estimator, batch_norm, assert_close):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(24, generator=gen, dtype=torch.float64) * 2
    group_ids = torch.arange(24) // 4
    cfg = AdvantageConfig(
        estimator=estimator,
        reward_scale=0.5,
        reward_bias=0.3,
        reward_clip=0.8,
        batch_norm=batch_norm,
    )
    expected = group_advantages(
        shape_rewards(rewards, scale=0.5, bias=0.3, clip=0.8), group_ids, estimator=estimator
    )
    if batch_norm:
        expected = normalize_batch(expected)
    assert_close(
        compute_advantages(rewards, group_ids, cfg),
        expected,
        what=f"{estimator} batch_norm={batch_norm}",
    )


def test_token_advantages_repeat_each_value_over_its_tokens(assert_close):
    out = token_advantages(torch.tensor([1.5, -2.0, 7.0]), torch.tensor([0, 2, 2, 5]))
    assert_close(out, torch.tensor([1.5, 1.5, 7.0, 7.0, 7.0]))


def test_token_advantages_agree_with_the_packed_batch_layout(assert_close):
    trajs = [
        Trajectory.from_generation(
            prompt_id=f"p{i}",
            group_id=i,
            prompt_ids=[1] * (i + 1),
            output_ids=[2] * (3 - i),
            output_logprobs=[-0.1] * (3 - i),
            output_versions=[0] * (3 - i),
        )
        for i in range(3)
    ]
    batch = pack(trajs)
    seq_adv = torch.tensor([0.25, -1.0, 4.0])
    assert_close(token_advantages(seq_adv, batch.cu_seqlens), seq_adv[batch.seq_index()])


def test_token_advantages_reject_inconsistent_offsets():
    with pytest.raises(ValueError, match=r"expected \[S\+1\] = \[3\]"):
        token_advantages(torch.ones(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="must start at 0 and not decrease"):
        token_advantages(torch.ones(2), torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="must start at 0"):
        token_advantages(torch.ones(2), torch.tensor([1, 2, 3]))
