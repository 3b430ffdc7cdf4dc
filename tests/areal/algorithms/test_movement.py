"""The step's policy movement and behaviour-weight distribution (areal.algorithms.movement):
against a per-token reference loop, exact under splitting, and named bins."""

from __future__ import annotations

import math

import pytest
import torch

from areal.algorithms import movement

EPS = 0.2


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    behav = -torch.rand(n, generator=gen) * 3
    prox = behav + 0.5 * torch.randn(n, generator=gen)
    new = prox + 0.2 * torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) < 0.7
    return behav, prox, new, mask


def _reference(behav, prox, new, mask) -> dict[str, float]:
    k3 = lambda log_rho: math.expm1(log_rho) - log_rho  # noqa: E731
    out = dict.fromkeys(movement.SUM_FIELDS, 0.0)
    for b, p, n, m in zip(behav.tolist(), prox.tolist(), new.tolist(), mask.tolist(), strict=True):
        if not m:
            continue
        w = math.exp(p - b)
        out["num_tokens"] += 1
        out["num_new_tokens"] += 1
        out["sum_kl_behav_prox"] += k3(p - b)
        out["sum_kl_behav_new"] += k3(n - b)
        out["sum_kl_prox_new"] += k3(n - p)
        out["num_w_outside_clip"] += w < 1 - EPS or w > 1 + EPS
        out[f"num_w_bin_{sum(w >= edge for edge in movement.W_BINS)}"] += 1
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_sums_match_a_per_token_reference(seed):
    behav, prox, new, mask = _inputs(400, seed)
    got = movement.movement_sums(behav, prox, new, mask, eps_low=EPS, eps_high=EPS)
    want = _reference(behav, prox, new, mask)
    for name in movement.SUM_FIELDS:
        assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-9), name
    assert got["num_w_outside_clip"] > 0 and got["num_w_bin_3"] > 0  # inputs exercise both


def test_pieces_merge_into_the_whole_batch():
    behav, prox, new, mask = _inputs(300, 2)
    whole = movement.movement_sums(behav, prox, new, mask, eps_low=EPS, eps_high=EPS)
    merged = dict.fromkeys(movement.SUM_FIELDS, 0.0)
    for part in torch.arange(300).chunk(3):
        merged = movement.merge(
            merged,
            movement.movement_sums(
                behav[part], prox[part], new[part], mask[part], eps_low=EPS, eps_high=EPS
            ),
        )
    for name in movement.SUM_FIELDS:
        assert merged[name] == pytest.approx(whole[name], rel=1e-9), name


def test_metrics_name_each_bin_and_skip_what_was_not_measured():
    behav = torch.zeros(4)
    prox = torch.tensor([1.0, 1.0, 1.1, 3.0]).log()  # w = 1, 1, 1.1, 3
    sums = movement.movement_sums(
        behav, prox, None, torch.ones(4, dtype=torch.bool), eps_low=EPS, eps_high=EPS
    )
    metrics = movement.movement_metrics(sums, "train/")
    assert metrics["train/behav_w_frac/0.95-1.05"] == 0.5
    assert metrics["train/behav_w_frac/1.05-1.2"] == 0.25
    assert metrics["train/behav_w_frac/>=2"] == 0.25
    assert metrics["train/behav_w_outside_clip_frac"] == 0.25
    assert sum(v for k, v in metrics.items() if "behav_w_frac/" in k) == pytest.approx(1.0)
    assert "train/kl_prox_new" not in metrics  # no forward after the step
    assert movement.bin_labels()[0] == "<0.5" and len(movement.bin_labels()) == 7
    assert movement.movement_metrics(dict.fromkeys(movement.SUM_FIELDS, 0.0)) == {}
