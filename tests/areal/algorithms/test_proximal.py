"""Log-linear proximal log-probs: exact endpoints, hand values, prompt tokens, version guards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.algorithms.loss import decoupled_ppo_loss
from areal.algorithms.proximal import loglinear_interpolate, loglinear_prox_logprobs


def _random_logprobs(n: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        -torch.rand(n, generator=gen, dtype=dtype) * 5,
        -torch.rand(n, generator=gen, dtype=dtype) * 5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_interpolate_is_exact_at_alpha_zero_and_one(dtype):
    behav, theta = _random_logprobs(1000, seed=0, dtype=dtype)
    at0 = loglinear_interpolate(behav, theta, 0.0)
    at1 = loglinear_interpolate(behav, theta, torch.ones(1000, dtype=dtype))
    assert torch.equal(at0, behav), f"alpha=0: max |diff| {(at0 - behav).abs().max().item():.3e}"
    assert torch.equal(at1, theta), f"alpha=1: max |diff| {(at1 - theta).abs().max().item():.3e}"


def test_tokens_of_the_proximal_version_keep_their_behaviour_logprob():
    behav, theta = _random_logprobs(500, seed=1)
    versions = torch.full((500,), 6, dtype=torch.long)  # v_theta - 1
    prox = loglinear_prox_logprobs(behav, theta, versions, theta_version=7)
    assert torch.equal(prox, behav), f"max |diff| {(prox - behav).abs().max().item():.3e}"


def test_hand_computed_interpolation(assert_close):
    # v_theta = 5: versions 4, 3, 1, 0 give alpha = 0, 1/2, 3/4, 4/5; prompt tokens (-1) untouched.
    behav = torch.tensor([0.0, 0.0, -2.0, -2.0, -2.0, -2.0], dtype=torch.float64)
    theta = torch.tensor([-9.0, -9.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    versions = torch.tensor([-1, -1, 4, 3, 1, 0])
    prox = loglinear_prox_logprobs(behav, theta, versions, theta_version=5)
    assert_close(
        prox, torch.tensor([0.0, 0.0, -2.0, -1.5, -1.25, -1.2], dtype=torch.float64), atol=1e-15
    )


@given(
    versions=st.lists(st.integers(-1, 19), min_size=1, max_size=50),
    theta_version=st.integers(20, 40),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_matches_the_formula_and_stays_between_behav_and_theta(
    versions, theta_version, seed, assert_close
):
    behav, theta = _random_logprobs(len(versions), seed, dtype=torch.float64)
    prox = loglinear_prox_logprobs(behav, theta, torch.tensor(versions), theta_version)
    expected = []
    for b, t, v in zip(behav.tolist(), theta.tolist(), versions, strict=True):
        alpha = 0.0 if v == -1 else (theta_version - 1 - v) / (theta_version - v)
        expected.append(b + alpha * (t - b))
    assert_close(prox, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    lo, hi = torch.minimum(behav, theta), torch.maximum(behav, theta)
    assert bool(((prox >= lo - 1e-12) & (prox <= hi + 1e-12)).all()), "not a convex combination"


def test_prompt_tokens_are_returned_even_where_theta_is_not_finite():
    behav = torch.tensor([0.0, -0.5, -1.0])
    theta = torch.tensor([float("nan"), float("-inf"), -2.0])
    prox = loglinear_prox_logprobs(behav, theta, torch.tensor([-1, -1, 2]), theta_version=3)
    assert prox.tolist() == [0.0, -0.5, -1.0], prox.tolist()


def test_result_carries_no_gradient():
    behav, theta = _random_logprobs(8, seed=2)
    theta.requires_grad_()
    prox = loglinear_prox_logprobs(behav, theta, torch.zeros(8, dtype=torch.long), theta_version=3)
    assert not prox.requires_grad and prox.grad_fn is None
    assert not loglinear_interpolate(behav, theta, 0.5).requires_grad


def test_version_not_older_than_theta_is_refused():
    behav, theta = _random_logprobs(3, seed=3)
    with pytest.raises(ValueError, match="token version 4 >= theta_version=4"):
        loglinear_prox_logprobs(behav, theta, torch.tensor([-1, 2, 4]), theta_version=4)
    with pytest.raises(ValueError, match="token version 0 >= theta_version=0"):
        loglinear_prox_logprobs(behav, theta, torch.tensor([-1, 0, 0]), theta_version=0)
    with pytest.raises(ValueError, match="token version -2 is invalid"):
        loglinear_prox_logprobs(behav, theta, torch.tensor([-2, 0, 0]), theta_version=1)
    with pytest.raises(ValueError, match="versions must be an integer tensor"):
        loglinear_prox_logprobs(behav, theta, torch.zeros(3), theta_version=1)
    with pytest.raises(ValueError, match="must have the same shape"):
        loglinear_interpolate(behav, theta[:2], 0.5)


def test_prompt_only_batch_is_accepted_at_any_theta_version():
    behav, theta = _random_logprobs(4, seed=4)
    prox = loglinear_prox_logprobs(behav, theta, torch.full((4,), -1), theta_version=0)
    assert torch.equal(prox, behav)


def test_on_policy_tokens_give_unit_behaviour_weight_in_the_loss():
    behav, theta = _random_logprobs(64, seed=5, dtype=torch.float64)
    versions = torch.tensor([-1] * 8 + [2] * 56)
    prox = loglinear_prox_logprobs(behav, theta, versions, theta_version=3)
    _, stats = decoupled_ppo_loss(
        theta.requires_grad_(),
        prox,
        behav,
        torch.ones(64, dtype=torch.float64),
        versions >= 0,
        behav_imp_cap=1.0,
    )
    assert stats.max_behav_w == 1.0 and stats.sum_behav_w == 56 and stats.num_capped == 0, stats
