"""The off-policy corrections of the decoupled loss (behaviour weight level and bounds, GSPO,
CISPO, the loss aggregations): against a naive per-sequence, per-token loop written here
from the papers' formulas, by gradient checks, by special cases that must coincide, and by
exact aggregation over micro-batches and ranks cut at sequence boundaries."""

from __future__ import annotations

import math

import pytest
import torch

from areal.algorithms.aggregation import Segments
from areal.algorithms.loss import PPOStats, correction_loss_options, decoupled_ppo_loss
from areal.config import PPOConfig

F64 = torch.float64
NUM_PROMPT = 2


def _batch(seed: int, num_seqs: int = 12, spread: float = 1.0) -> dict[str, torch.Tensor]:
    """Packed fp64 sequences of unequal lengths: prompt tokens and some inner tokens (an
    episode's observations) outside the loss, one sequence with no loss token at all, and
    per-sequence offsets so that token and sequence weights and ratios straddle the bounds."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(NUM_PROMPT + 1, 24, (num_seqs,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    mask = torch.rand(n, generator=gen) < 0.85
    for s in range(num_seqs):
        mask[cu[s] : cu[s] + NUM_PROMPT] = False
    mask[cu[3] : cu[4]] = False  # sequence 3 has no loss token
    prox = -torch.rand(n, generator=gen, dtype=F64) * 3
    behav_offset = spread * torch.randn(num_seqs, generator=gen, dtype=F64)
    theta_offset = 0.3 * torch.randn(num_seqs, generator=gen, dtype=F64)
    return {
        "logprobs": (
            prox + theta_offset[seq] + 0.2 * torch.randn(n, generator=gen, dtype=F64)
        ).requires_grad_(),
        "prox_logprobs": prox,
        "behav_logprobs": prox + behav_offset[seq] + 0.5 * torch.randn(n, generator=gen, dtype=F64),
        "advantages": torch.randn(num_seqs, generator=gen, dtype=F64)[seq],
        "loss_mask": mask,
        "cu_seqlens": cu.to(torch.int32),
        "fresh": torch.rand(n, generator=gen) < 0.5,
    }


def _reference(
    inp,
    *,
    eps_clip=0.2,
    eps_clip_high=None,
    behav_imp_cap=None,
    behav_imp_floor=None,
    behav_cap_mode="mask",
    behav_imp_level="token",
    policy_loss="ppo",
    loss_agg_mode="token-mean",
    loss_agg_norm=None,
):
    """Loop over sequences, then tokens, with Python floats for everything but pi_theta.

    Returns (loss value, a tensor whose gradient w.r.t. logprobs is the loss's, stats).
    """
    lp, cu = inp["logprobs"], inp["cu_seqlens"].tolist()
    mask, fresh = inp["loss_mask"].tolist(), inp["fresh"].tolist()
    prox, behav = inp["prox_logprobs"].tolist(), inp["behav_logprobs"].tolist()
    adv = inp["advantages"].tolist()
    low, high = 1 - eps_clip, 1 + (eps_clip if eps_clip_high is None else eps_clip_high)
    seqs = [[t for t in range(cu[s], cu[s + 1]) if mask[t]] for s in range(len(cu) - 1)]
    seqs = [tokens for tokens in seqs if tokens]
    num_tokens = sum(len(tokens) for tokens in seqs)
    value, grad_source = 0.0, lp.new_zeros(())
    st = dict(
        num_tokens=num_tokens,
        num_used_tokens=0,
        num_capped=0,
        num_clipped=0,
        sum_loss=0.0,
        num_loss_units=len(seqs) if loss_agg_mode != "token-mean" else num_tokens,
    )
    for tokens in seqs:
        log_w = {t: prox[t] - behav[t] for t in tokens}
        seq_w = math.exp(sum(log_w.values()) / len(tokens))
        seq_ratio = torch.exp(sum(lp[t] - prox[t] for t in tokens) / len(tokens))
        if loss_agg_mode == "token-mean":
            factor = 1.0 / num_tokens
        elif loss_agg_mode == "seq-mean-token-mean":
            factor = 1.0 / (len(tokens) * len(seqs))
        else:
            factor = 1.0 / (loss_agg_norm * len(seqs))
        for t in tokens:
            w = seq_w if behav_imp_level == "sequence" else math.exp(log_w[t])
            out = (behav_imp_cap is not None and w > behav_imp_cap) or (
                behav_imp_floor is not None and w < behav_imp_floor
            )
            st["num_capped"] += out
            if out and behav_cap_mode == "mask":
                continue
            if out:
                w = min(max(w, behav_imp_floor or 0.0), behav_imp_cap or math.inf)
            st["num_used_tokens"] += 1
            a = adv[t]
            if policy_loss == "cispo":
                r = math.exp(lp[t].item() - prox[t])
                clipped_r = min(max(r, low), high)
                st["num_clipped"] += not low <= r <= high
                term_value = -w * clipped_r * a
                term_grad = -w * clipped_r * a * lp[t]  # d/d lp = -w clip(r) A
            else:
                r = seq_ratio if policy_loss == "gspo" else torch.exp(lp[t] - prox[t])
                unclipped = r * a
                clipped = min(max(r.item(), low), high) * a
                if clipped < unclipped.item():
                    st["num_clipped"] += 1
                    term_value, term_grad = -w * clipped, lp.new_zeros(())
                else:
                    term_value, term_grad = -w * unclipped.item(), -w * unclipped
            value += factor * term_value
            grad_source = grad_source + factor * term_grad
            st["sum_loss"] += factor * term_value * st["num_loss_units"]
    for split, members in (("fresh", True), ("stale", False)):
        chosen = [t for tokens in seqs for t in tokens if fresh[t] is members]
        diffs = [abs(prox[t] - behav[t]) for t in chosen]
        st[f"num_{split}_tokens"] = len(chosen)
        st[f"sum_{split}_abs_diff"] = sum(diffs)
        st[f"max_{split}_abs_diff"] = max(diffs, default=0.0)
        st[f"sum_{split}_behav_kl"] = sum(
            math.expm1(prox[t] - behav[t]) - (prox[t] - behav[t]) for t in chosen
        )
    return value, grad_source, st


def _check_stats(stats: PPOStats, expected: dict) -> None:
    for name, want in expected.items():
        got = getattr(stats, name)
        if name.startswith(("num_", "max_")):
            assert got == pytest.approx(want, abs=0 if name.startswith("num_") else 1e-15), (
                f"{name}: got {got!r}, want {want!r}"
            )
        else:
            assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (
                f"{name}: got {got!r}, want {want!r}, |diff| = {abs(got - want):.3e}"
            )


BOUNDS = [
    dict(behav_imp_cap=2.0),
    dict(behav_imp_floor=0.5, behav_imp_cap=2.0),
    dict(behav_imp_floor=0.7),
]
CORRECTION_GRID = [
    dict(behav_imp_level=level, behav_cap_mode=mode, **bounds)
    for level in ("token", "sequence")
    for mode in ("mask", "clamp")
    for bounds in BOUNDS
]
OBJECTIVE_GRID = [
    dict(
        policy_loss=kind,
        loss_agg_mode=agg,
        loss_agg_norm=20.0,
        behav_imp_level=level,
        behav_imp_cap=2.0,
    )
    for kind in ("ppo", "gspo", "cispo")
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    for level in ("token", "sequence")
]


def _name(options: dict) -> str:
    return ",".join(f"{k.split('_')[-1]}={v}" for k, v in options.items())


@pytest.mark.parametrize("options", CORRECTION_GRID + OBJECTIVE_GRID, ids=_name)
def test_loss_gradient_and_stats_match_the_per_sequence_reference(options, assert_close):
    inp = _batch(seed=3)
    options = dict(eps_clip=0.2, eps_clip_high=0.28, **options)
    loss, stats = decoupled_ppo_loss(**inp, **options)
    (grad,) = torch.autograd.grad(loss, inp["logprobs"])
    value, grad_source, expected = _reference(inp, **options)
    (ref_grad,) = torch.autograd.grad(grad_source, inp["logprobs"], allow_unused=True)
    assert_close(loss, torch.tensor(value, dtype=F64), atol=1e-12, what="loss")
    assert_close(
        grad,
        ref_grad if ref_grad is not None else torch.zeros_like(grad),
        atol=1e-12,
        what="d loss / d logprobs",
    )
    _check_stats(stats, expected)
    assert stats.num_clipped > 0, "inputs should exercise the clip"
    assert 0 < stats.num_capped < stats.num_tokens, "inputs should exercise the bounds"


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck_in_float64(kind, level):
    """Finite differences of the loss value. (CISPO's gradient is by design not the
    derivative of its value, a stop-gradient weight: the next test checks it analytically.)"""
    inp = _batch(seed=11, num_seqs=6)
    theta = inp.pop("logprobs").detach().requires_grad_()
    options = dict(
        eps_clip=0.2,
        behav_imp_cap=2.0,
        behav_imp_floor=0.5,
        policy_loss=kind,
        behav_imp_level=level,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert torch.autograd.gradcheck(
        lambda lp: decoupled_ppo_loss(lp, **inp, **options)[0],
        (theta,),
        eps=1e-7,
        atol=1e-8,
        fast_mode=True,
    )


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage(assert_close):
    inp = _batch(seed=12)
    loss, stats = decoupled_ppo_loss(**inp, policy_loss="cispo", eps_clip=0.2, eps_clip_high=0.3)
    (grad,) = torch.autograd.grad(loss, inp["logprobs"])
    mask = inp["loss_mask"]
    w = torch.exp(inp["prox_logprobs"] - inp["behav_logprobs"])
    r = torch.exp(inp["logprobs"].detach() - inp["prox_logprobs"])
    analytic = torch.where(mask, -w * r.clamp(0.8, 1.3) * inp["advantages"], 0.0) / int(mask.sum())
    assert_close(grad, analytic, atol=1e-15, what="CISPO gradient")
    # Every loss token keeps a gradient, clipped or not (unlike PPO's clip).
    assert stats.num_clipped > 0 and bool((grad[mask] != 0).all())


def test_options_coincide_where_the_papers_say_they_do(assert_close):
    inp = _batch(seed=13)
    base = dict(eps_clip=0.2, behav_imp_cap=2.0)
    # One-token sequences: GSPO's sequence ratio is the token ratio, a sequence weight the
    # token weight.
    n = len(inp["loss_mask"])
    singles = dict(inp, cu_seqlens=torch.arange(n + 1, dtype=torch.int32))
    token, _ = decoupled_ppo_loss(**singles, **base)
    for options in (
        dict(policy_loss="gspo"),
        dict(behav_imp_level="sequence"),
        dict(loss_agg_mode="seq-mean-token-mean"),
    ):
        other, _ = decoupled_ppo_loss(**singles, **base, **options)
        assert_close(other, token.detach(), atol=1e-14, what=str(options))
    # Sequences of equal loss-token counts: a sequence mean of token means is the token
    # mean, and Dr.GRPO's constant L equal to that count gives the same.
    size, num = 7, n // 7
    equal = {k: v[: size * num] for k, v in inp.items() if k != "cu_seqlens"}
    equal["logprobs"] = equal["logprobs"].detach().requires_grad_()
    equal.update(
        loss_mask=torch.ones(size * num, dtype=torch.bool),
        cu_seqlens=torch.arange(0, size * num + 1, size, dtype=torch.int32),
    )
    reference, _ = decoupled_ppo_loss(**equal, **base)
    for options in (
        dict(loss_agg_mode="seq-mean-token-mean"),
        dict(loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm=size),
    ):
        other, _ = decoupled_ppo_loss(**equal, **base, **options)
        assert_close(other, reference.detach(), atol=1e-14, what=str(options))


def test_icepop_two_sided_mask_by_hand():
    # w per token: e^1.2 = 3.32 (above 2), e^-1 = 0.37 (below 0.5), e^0.3 = 1.35, 1.0.
    # r = 1 everywhere, A = 1: each kept token contributes -w; masked ones 0 but count.
    prox = torch.zeros(4, dtype=F64)
    behav = torch.tensor([-1.2, 1.0, -0.3, 0.0], dtype=F64)
    inp = dict(
        logprobs=prox.clone().requires_grad_(),
        prox_logprobs=prox,
        behav_logprobs=behav,
        advantages=torch.ones(4, dtype=F64),
        loss_mask=torch.ones(4, dtype=torch.bool),
    )
    loss, stats = decoupled_ppo_loss(**inp, behav_imp_floor=0.5, behav_imp_cap=2.0)
    assert loss.item() == pytest.approx(-(math.exp(0.3) + 1.0) / 4, abs=1e-15)
    assert (stats.num_capped, stats.num_used_tokens) == (2, 2)
    clamped, stats = decoupled_ppo_loss(
        **inp, behav_imp_floor=0.5, behav_imp_cap=2.0, behav_cap_mode="clamp"
    )
    assert clamped.item() == pytest.approx(-(2.0 + 0.5 + math.exp(0.3) + 1.0) / 4, abs=1e-15)
    assert (stats.num_capped, stats.num_used_tokens) == (2, 4)


def _cut(inp: dict, bounds: list[int]) -> list[dict]:
    """Pieces made of whole sequences: sequences bounds[k]..bounds[k+1]-1."""
    cu = inp["cu_seqlens"].long()
    pieces = []
    for first, last in zip(bounds[:-1], bounds[1:], strict=True):
        lo, hi = int(cu[first]), int(cu[last])
        piece = {k: v[lo:hi] for k, v in inp.items() if k != "cu_seqlens"}
        piece["cu_seqlens"] = (cu[first : last + 1] - lo).to(torch.int32)
        pieces.append(piece)
    return pieces


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_pieces_with_the_global_normalizer_sum_to_the_whole_batch(agg, kind, assert_close):
    inp = _batch(seed=14, num_seqs=16)
    options = dict(
        eps_clip=0.2,
        eps_clip_high=0.3,
        behav_imp_cap=2.0,
        behav_imp_floor=0.5,
        behav_imp_level="sequence",
        policy_loss=kind,
        loss_agg_mode=agg,
        loss_agg_norm=24.0,
    )
    full_loss, full_stats = decoupled_ppo_loss(**inp, **options)
    (full_grad,) = torch.autograd.grad(full_loss, inp["logprobs"])
    segments = Segments.of_loss_tokens(inp["cu_seqlens"], inp["loss_mask"])
    units = int(inp["loss_mask"].sum()) if agg == "token-mean" else segments.num_nonempty()
    # Micro-batches of one rank and the two ranks' pieces alike: cuts between sequences.
    lp = inp["logprobs"].detach().clone().requires_grad_()
    total, pieces, means = 0.0, [], []
    for piece in _cut(dict(inp, logprobs=lp), [0, 3, 4, 9, 10, 16]):
        loss, stats = decoupled_ppo_loss(**piece, **options, loss_normalizer=units)
        loss.backward()
        total += loss.item()
        pieces.append(stats)
        means.append(decoupled_ppo_loss(**piece, **options)[0].item())
    assert_close(torch.tensor(total, dtype=F64), full_loss.detach(), atol=1e-14, what="loss")
    assert_close(lp.grad, full_grad, atol=1e-15, what="accumulated gradient")
    assert abs(sum(means) / len(means) - full_loss.item()) > 1e-6, "pieces must differ"
    merged = PPOStats.reduce(pieces)
    _check_stats(merged, dict(vars(full_stats).items()))
    assert merged.metrics() == pytest.approx(full_stats.metrics(), rel=1e-12, abs=1e-15)


def test_drift_split_handles_infinite_and_equal_infinite_log_probs():
    inp = _batch(seed=15)
    first = int(inp["loss_mask"].nonzero()[0])
    second = int(inp["loss_mask"].nonzero()[1])
    inp["behav_logprobs"][first] = -math.inf  # w = inf
    inp["prox_logprobs"][second] = inp["behav_logprobs"][second] = -math.inf  # w = 1
    inp["fresh"][first] = inp["fresh"][second] = True
    # (The loss of a token with log pi_prox = -inf is not this test's business.)
    _, stats = decoupled_ppo_loss(**inp, behav_imp_cap=3.0)
    assert stats.max_fresh_abs_diff == math.inf and stats.sum_fresh_behav_kl == math.inf
    assert not math.isnan(stats.sum_stale_behav_kl) and stats.num_fresh_behav_masked >= 1
    metrics = stats.metrics()
    assert metrics["train/logprob_diff_fresh_max"] == math.inf
    assert 0 < metrics["train/fresh_token_frac"] < 1


def test_metrics_show_only_the_active_corrections_and_seen_splits():
    inp = _batch(seed=16)
    inp["fresh"] = torch.ones_like(inp["fresh"])
    _, stats = decoupled_ppo_loss(**inp, behav_imp_cap=2.0)
    metrics = stats.metrics("", corrections=("behav_masked", "clipped"))
    assert {
        "logprob_diff_fresh",
        "logprob_diff_fresh_max",
        "behav_kl_fresh",
        "behav_masked_frac_fresh",
        "clipped_frac_fresh",
    } <= set(metrics)
    assert not any("stale" in k or "clamped" in k for k in metrics), metrics
    assert metrics["fresh_token_frac"] == 1.0
    no_split = decoupled_ppo_loss(**dict(inp, fresh=None), behav_imp_cap=2.0)[1].metrics()
    assert not any("fresh" in k for k in no_split)


def test_sequence_options_without_boundaries_and_bad_bounds_are_refused():
    inp = _batch(seed=17)
    no_cu = dict(inp, cu_seqlens=None)
    with pytest.raises(
        ValueError,
        match=r"policy_loss='gspo', loss_agg_mode='seq-mean-token-"
        r"mean' works per sequence; pass cu_seqlens",
    ):
        decoupled_ppo_loss(**no_cu, policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(ValueError, match="behav_imp_floor=3.0 is above behav_imp_cap=2.0"):
        decoupled_ppo_loss(**inp, behav_imp_floor=3.0, behav_imp_cap=2.0)
    with pytest.raises(ValueError, match="needs loss_agg_norm > 0"):
        decoupled_ppo_loss(**inp, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="policy_loss='grpo' is not one of ppo, gspo, cispo"):
        decoupled_ppo_loss(**inp, policy_loss="grpo")
    with pytest.raises(ValueError, match="behav_imp_level='batch' is not one of token, sequence"):
        decoupled_ppo_loss(**inp, behav_imp_level="batch")
    with pytest.raises(ValueError, match="loss_agg_mode='mean' is not one of"):
        decoupled_ppo_loss(**inp, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="must start at 0 and end at the"):
        decoupled_ppo_loss(
            **dict(inp, cu_seqlens=inp["cu_seqlens"][:-1]), loss_agg_mode="seq-mean-token-mean"
        )


def test_config_options_reach_the_loss():
    cfg = PPOConfig(
        behav_imp_floor=0.5,
        behav_imp_level="sequence",
        policy_loss="gspo",
        loss_agg_mode="seq-mean-token-sum-norm",
    )
    assert correction_loss_options(cfg, max_new_tokens=300) == dict(
        behav_imp_floor=0.5,
        behav_imp_level="sequence",
        policy_loss="gspo",
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_agg_norm=300,
    )
    cfg.loss_agg_norm = 64
    assert correction_loss_options(cfg, max_new_tokens=300)["loss_agg_norm"] == 64
