"""Decoupled PPO loss: naive per-token reference, PPO special case, gradient isolation, the
cap boundary, and exact aggregation over micro-batches and ranks."""

from __future__ import annotations

import math

import pytest
import torch

from areal.algorithms.loss import PPOStats, decoupled_ppo_loss, ppo_loss_options
from areal.config import PPOConfig

F64 = torch.float64


def _inputs(n: int, seed: int, spread: float = 0.8) -> dict[str, torch.Tensor]:
    """Random fp64 inputs whose ratios r and weights w straddle the clip range and a cap of 2."""
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.rand(n, generator=gen, dtype=F64) * 3
    return {
        "logprobs": (prox + 0.4 * torch.randn(n, generator=gen, dtype=F64)).requires_grad_(),
        "prox_logprobs": prox,
        "behav_logprobs": prox + spread * torch.randn(n, generator=gen, dtype=F64),
        "advantages": torch.randn(n, generator=gen, dtype=F64),
        "loss_mask": torch.rand(n, generator=gen) < 0.7,
    }


def _reference(
    inp,
    *,
    eps_clip,
    eps_clip_high=None,
    behav_imp_cap=None,
    behav_cap_mode="mask",
    loss_normalizer=None,
):
    """Token-by-token loop over the textbook formula; prox/behav/advantages as Python floats,
    so autograd can only reach `logprobs`. Returns (loss, dict of stats)."""
    lp, mask = inp["logprobs"], inp["loss_mask"].tolist()
    high = eps_clip if eps_clip_high is None else eps_clip_high
    total = lp.new_zeros(())
    st = dict(
        num_tokens=0,
        num_used_tokens=0,
        num_capped=0,
        num_clipped=0,
        sum_loss=0.0,
        sum_behav_w=0.0,
        sum_approx_kl=0.0,
        max_behav_w=0.0,
    )
    for t, in_loss in enumerate(mask):
        if not in_loss:
            continue
        prox, behav = inp["prox_logprobs"][t].item(), inp["behav_logprobs"][t].item()
        adv = inp["advantages"][t].item()
        w = math.exp(prox - behav)
        log_r = lp[t].item() - prox
        st["num_tokens"] += 1
        st["sum_behav_w"] += w
        st["max_behav_w"] = max(st["max_behav_w"], w)
        st["sum_approx_kl"] += math.exp(log_r) - 1 - log_r
        if behav_imp_cap is not None and w > behav_imp_cap:
            st["num_capped"] += 1
            if behav_cap_mode == "mask":
                continue
            w = behav_imp_cap
        st["num_used_tokens"] += 1
        r = torch.exp(lp[t] - prox)
        unclipped = r * adv
        clipped = min(max(r.item(), 1 - eps_clip), 1 + high) * adv
        if 1 - eps_clip <= r.item() <= 1 + high:
            clipped = unclipped
        if clipped < unclipped.item():
            st["num_clipped"] += 1
            term = -w * clipped
        else:
            term = -w * unclipped
        st["sum_loss"] += term.item() if isinstance(term, torch.Tensor) else term
        total = total + term
    normalizer = loss_normalizer if loss_normalizer is not None else max(st["num_tokens"], 1)
    return total / normalizer, st


def _assert_stats_equal(stats: PPOStats, expected: dict, *, rtol: float = 1e-12) -> None:
    for name, want in expected.items():
        got = getattr(stats, name)
        if name.startswith(("num_", "max_")):
            assert got == want, f"{name}: got {got!r}, want {want!r} (diff {got - want:.3e})"
        else:
            assert abs(got - want) <= rtol * max(1.0, abs(want)), (
                f"{name}: got {got!r}, want {want!r}, |diff| = {abs(got - want):.3e}"
            )


OPTION_GRID = [
    dict(eps_clip=0.2),
    dict(eps_clip=0.2, eps_clip_high=0.28),
    dict(eps_clip=0.1, behav_imp_cap=2.0, behav_cap_mode="mask"),
    dict(eps_clip=0.1, behav_imp_cap=2.0, behav_cap_mode="clamp"),
    dict(eps_clip=0.2, eps_clip_high=0.5, behav_imp_cap=1.5, behav_cap_mode="mask"),
    dict(eps_clip=0.2, eps_clip_high=0.5, behav_imp_cap=1.5, behav_cap_mode="clamp"),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "options", OPTION_GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
)
def test_loss_and_gradient_match_per_token_reference(options, seed, assert_close):
    inp = _inputs(300, seed)
    loss, stats = decoupled_ppo_loss(**inp, **options)
    (grad,) = torch.autograd.grad(loss, inp["logprobs"])
    ref_loss, ref_stats = _reference(inp, **options)
    (ref_grad,) = torch.autograd.grad(ref_loss, inp["logprobs"])
    assert_close(loss, ref_loss.detach(), atol=1e-12, what="loss")
    assert_close(grad, ref_grad, atol=1e-12, what="d loss / d logprobs")
    _assert_stats_equal(stats, ref_stats)
    assert stats.num_clipped > 0, "inputs should exercise the clip"
    if options.get("behav_imp_cap"):
        assert 0 < stats.num_capped < stats.num_tokens, "inputs should exercise the cap"


def test_hand_computed_clip_and_clip_higher():
    # eps 0.2; per token (r, A) and min(r A, clip(r) A):
    # (1.5, +1) -> 1.2 clipped | (1.5, -1) -> -1.5 | (0.5, -1) -> -0.8 clipped | (0.5, +1) -> 0.5
    # (1.1, +1) -> 1.1.  Sum 0.5, loss -0.5/5.  Clip higher 0.6: (1.5, +1) -> 1.5, loss -0.8/5.
    r = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1], dtype=F64)
    inp = dict(
        logprobs=r.log(),
        prox_logprobs=torch.zeros(5, dtype=F64),
        behav_logprobs=torch.zeros(5, dtype=F64),
        advantages=torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=F64),
        loss_mask=torch.ones(5, dtype=torch.bool),
    )
    loss, stats = decoupled_ppo_loss(**inp, eps_clip=0.2)
    assert abs(loss.item() + 0.1) < 1e-12, loss.item()
    assert stats.metrics()["train/clip_frac"] == 2 / 5, stats
    loss, stats = decoupled_ppo_loss(**inp, eps_clip=0.2, eps_clip_high=0.6)
    assert abs(loss.item() + 0.16) < 1e-12, loss.item()
    assert stats.num_clipped == 1, stats


def test_naive_ppo_is_the_textbook_clipped_objective_without_a_dual_clip():
    """Naive PPO (pi_prox = pi_behav, so w = 1): per token the objective is Schulman et al.'s
    min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi_theta / pi_behav. Its gradient w.r.t.
    log pi_theta is r A where the unclipped term is the smaller and 0 where the clip binds.
    On the side PPO leaves open (A < 0, r > 1 + eps) the term is r A however large r is: no
    dual clip (Ye et al. 2020, max(., c A) for A < 0) is applied, so the token's gradient
    grows with r. Stats say which bound acted."""
    eps = 0.2
    # (r, A): clipped high | open side, r = 1.5 and r = 10 | clipped low | open low side
    # (r < 1 - eps, A > 0: r A is the smaller) | inside | zero advantage outside the range
    r = torch.tensor([1.5, 1.5, 10.0, 0.5, 0.5, 1.1, 3.0], dtype=F64)
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 0.7, 0.0], dtype=F64)
    behav = -torch.rand(len(r), generator=torch.Generator().manual_seed(0), dtype=F64)
    logprobs = (behav + r.log()).requires_grad_()
    loss, stats = decoupled_ppo_loss(
        logprobs, behav, behav, adv, torch.ones(len(r), dtype=torch.bool), eps_clip=eps
    )
    loss = loss * len(r)  # the token sum (the loss is the token mean)
    textbook = torch.minimum(r * adv, r.clamp(1 - eps, 1 + eps) * adv)
    assert abs(loss.item() + textbook.sum().item()) < 1e-12, (loss.item(), textbook)
    (grad,) = torch.autograd.grad(loss, logprobs)
    expected_grad = torch.tensor([0.0, 1.5, 10.0, 0.0, -0.5, -0.77, 0.0], dtype=F64)
    assert torch.allclose(grad, expected_grad, atol=1e-12, rtol=0), grad
    # The open side: 10 times the ratio, 10 times the gradient (a dual clip c = 3 would
    # have held the term at c A = -3 and the gradient at 0).
    assert abs(-textbook[2].item() - 10.0) < 1e-12 and grad[2].item() == pytest.approx(10.0)
    assert (stats.num_clipped, stats.num_clipped_high, stats.num_clipped_low) == (2, 1, 1)
    assert stats.num_unclipped_outside == 3  # r = 1.5 and 10 with A < 0, r = 0.5 with A > 0
    assert stats.max_ratio == pytest.approx(10.0)
    metrics = stats.metrics()
    assert metrics["train/clip_high_frac"] == metrics["train/clip_low_frac"] == 1 / 7
    assert metrics["train/unclipped_outside_frac"] == 3 / 7


def test_masked_tokens_are_counted_by_the_bound_they_crossed():
    prox = torch.zeros(4, dtype=F64)
    behav = torch.tensor([0.0, -2.0, 2.0, 0.1], dtype=F64)  # w = 1, e^2, e^-2, e^-0.1
    _, stats = decoupled_ppo_loss(
        prox.clone().requires_grad_(),
        prox,
        behav,
        torch.ones(4, dtype=F64),
        torch.ones(4, dtype=torch.bool),
        behav_imp_cap=5.0,
        behav_imp_floor=0.2,
    )
    assert (stats.num_capped, stats.num_above_cap, stats.num_below_floor) == (2, 1, 1)
    metrics = stats.metrics()
    assert metrics["train/behav_above_cap_frac"] == metrics["train/behav_below_floor_frac"] == 0.25


@pytest.mark.parametrize("eps_clip_high", [None, 0.3])
def test_reduces_to_standard_ppo_when_prox_equals_behav(eps_clip_high, assert_close):
    inp = _inputs(200, seed=3)
    inp["behav_logprobs"] = inp["prox_logprobs"].clone()
    high = 0.2 if eps_clip_high is None else eps_clip_high
    old, lp, adv, mask = inp["prox_logprobs"], inp["logprobs"], inp["advantages"], inp["loss_mask"]
    ratio = torch.exp(lp - old)
    ppo = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1 + high) * adv)
    expected = ppo[mask].mean()
    for cap in (None, 1.0):  # w == 1 exactly: a cap of 1 must not change anything
        loss, stats = decoupled_ppo_loss(
            **inp, eps_clip=0.2, eps_clip_high=eps_clip_high, behav_imp_cap=cap
        )
        assert_close(loss, expected.detach(), atol=1e-12, what=f"loss cap={cap}")
        assert_close(
            torch.autograd.grad(loss, lp)[0],
            torch.autograd.grad(expected, lp, retain_graph=True)[0],
            atol=1e-12,
            what=f"grad cap={cap}",
        )
        assert stats.num_capped == 0 and stats.max_behav_w == 1.0, stats
        assert stats.sum_behav_w == stats.num_tokens, stats


def test_only_theta_logprobs_receive_gradient(assert_close):
    inp = _inputs(64, seed=4)
    for name in ("prox_logprobs", "behav_logprobs", "advantages"):
        inp[name] = inp[name].clone().requires_grad_()
    # prox also as the output of a computation, as a recompute pass would give it
    scale = torch.tensor(1.0, dtype=F64, requires_grad=True)
    prox_leaf = inp["prox_logprobs"]
    inp["prox_logprobs"] = prox_leaf * scale
    loss, _ = decoupled_ppo_loss(**inp, eps_clip=0.2, behav_imp_cap=2.0)
    loss.backward()
    for name, tensor in [
        ("prox", prox_leaf),
        ("scale", scale),
        ("behav", inp["behav_logprobs"]),
        ("advantages", inp["advantages"]),
    ]:
        assert tensor.grad is None, f"{name} received a gradient: {tensor.grad}"
    grad = inp["logprobs"].grad
    assert grad is not None and bool((grad[~inp["loss_mask"]] == 0).all()), grad
    assert bool((grad[inp["loss_mask"]] != 0).any()), "loss tokens should get gradient"


def _boundary_inputs(prox_value: float) -> dict[str, torch.Tensor]:
    return dict(
        logprobs=torch.tensor([-1.0, -0.5], dtype=F64, requires_grad=True),
        prox_logprobs=torch.tensor([prox_value, -0.6], dtype=F64),
        behav_logprobs=torch.tensor([-2.0, -0.6], dtype=F64),
        advantages=torch.tensor([0.7, -0.3], dtype=F64),
        loss_mask=torch.tensor([True, True]),
    )


@pytest.mark.parametrize("mode", ["mask", "clamp"])
def test_cap_keeps_w_equal_to_cap_and_acts_just_above(mode, assert_close):
    inp = _boundary_inputs(-1.1)
    w0 = math.exp(-1.1 - (-2.0))  # what the loss computes for token 0, bit for bit
    assert torch.exp(inp["prox_logprobs"] - inp["behav_logprobs"])[0].item() == w0
    uncapped, _ = decoupled_ppo_loss(**inp, eps_clip=0.2)
    at_cap, stats = decoupled_ppo_loss(**inp, eps_clip=0.2, behav_imp_cap=w0, behav_cap_mode=mode)
    assert stats.num_capped == 0 and stats.num_used_tokens == 2, stats
    assert_close(at_cap, uncapped.detach(), what="w == cap is kept unchanged")

    below = math.nextafter(w0, 0.0)
    loss, stats = decoupled_ppo_loss(**inp, eps_clip=0.2, behav_imp_cap=below, behav_cap_mode=mode)
    assert stats.num_capped == 1, stats
    token1_only = dict(inp, loss_mask=torch.tensor([False, True]))
    only1, _ = decoupled_ppo_loss(**token1_only, eps_clip=0.2, loss_normalizer=2)
    if mode == "mask":
        assert stats.num_used_tokens == 1, stats
        assert_close(loss, only1.detach(), atol=1e-15, what="token 0 masked, still counted")
    else:
        assert stats.num_used_tokens == 2, stats
        ref, _ = _reference(inp, eps_clip=0.2, behav_imp_cap=below, behav_cap_mode="clamp")
        assert_close(loss, ref.detach(), atol=1e-15, what="token 0 clamped to the cap")
        # token 0's term is linear in w: its contribution shrinks by below / w0
        assert_close(
            (loss - only1).detach(),
            (uncapped - only1).detach() * (below / w0),
            atol=1e-15,
            what="w scaled to the cap",
        )


def test_infinite_weights_and_garbage_outside_the_loss_give_finite_gradients(assert_close):
    inp = _inputs(50, seed=5)
    out = ~inp["loss_mask"]
    inp["behav_logprobs"][out] = float("-inf")  # w = inf on non-loss tokens
    inp["advantages"][out] = float("nan")
    inp["behav_logprobs"][3] = float("-inf")  # w = inf on a loss token
    inp["loss_mask"][3] = True
    inp["advantages"][3] = 0.5  # a loss token's advantage must be finite
    loss, stats = decoupled_ppo_loss(**inp, eps_clip=0.2, behav_imp_cap=3.0, behav_cap_mode="mask")
    loss.backward()
    grad = inp["logprobs"].grad
    assert math.isfinite(loss.item()) and bool(torch.isfinite(grad).all()), (loss, grad)
    assert grad[3].item() == 0.0 and stats.max_behav_w == math.inf, (grad[3], stats)


UNDEFINED_CASES = {
    # (prox, behav) log-probs of one loss token whose term has no value, and the options
    "both_zero_probability": (float("-inf"), float("-inf"), dict(behav_imp_cap=3.0)),
    "both_zero_no_cap": (float("-inf"), float("-inf"), dict(behav_imp_cap=None)),
    "prox_zero_probability": (float("-inf"), -1.0, dict(behav_imp_cap=None)),
    "behav_zero_no_cap": (-1.0, float("-inf"), dict(behav_imp_cap=None)),
}


@pytest.mark.parametrize("case", UNDEFINED_CASES)
@pytest.mark.parametrize("mode", ["mask", "clamp"])
def test_a_token_with_an_undefined_term_is_dropped_not_nan(case, mode, assert_close):
    prox, behav, options = UNDEFINED_CASES[case]
    inp = _inputs(60, seed=11)
    inp["loss_mask"][7] = True
    inp["prox_logprobs"][7], inp["behav_logprobs"][7] = prox, behav
    options = dict(options, eps_clip=0.2, behav_cap_mode=mode)
    loss, stats = decoupled_ppo_loss(**inp, **options)
    (grad,) = torch.autograd.grad(loss, inp["logprobs"])
    # The same as leaving token 7 out of the loss while it still counts in the denominator.
    without = dict(inp, loss_mask=inp["loss_mask"].clone())
    without["loss_mask"][7] = False
    ref_loss, ref_stats = decoupled_ppo_loss(
        **without, **options, loss_normalizer=int(inp["loss_mask"].sum())
    )
    (ref_grad,) = torch.autograd.grad(ref_loss, without["logprobs"])
    assert_close(loss.detach(), ref_loss.detach(), atol=1e-15, what="loss")
    assert_close(grad, ref_grad, atol=1e-15, what="gradient")
    assert stats.num_undefined == 1 and stats.num_tokens == ref_stats.num_tokens + 1, stats
    assert stats.num_used_tokens == ref_stats.num_used_tokens
    # w itself may be inf (pi_behav = 0); every other statistic stays finite.
    assert all(math.isfinite(v) for k, v in stats.metrics().items() if "behav_w" not in k)
    assert stats.metrics()["train/undefined_frac"] == 1 / stats.num_tokens


@pytest.mark.parametrize(
    "options",
    [
        dict(policy_loss="gspo"),
        dict(policy_loss="cispo"),
        dict(behav_imp_level="sequence", behav_imp_cap=None),
    ],
    ids=["gspo", "cispo", "sequence_w"],
)
def test_an_undefined_term_drops_its_token_or_its_sequence_with_finite_gradients(
    options, assert_close
):
    """GSPO's ratio and a sequence-level w are the sequence's: one pi_prox (or pi_behav) of
    0 leaves the whole sequence without a value, so the whole sequence is dropped."""
    inp = _inputs(40, seed=14)
    inp["loss_mask"][:] = True
    cu_seqlens = torch.tensor([0, 10, 25, 40])
    inp["prox_logprobs"][12] = float("-inf")  # in the second sequence
    if "behav_imp_level" in options:
        inp["prox_logprobs"][12], inp["behav_logprobs"][12] = -1.0, float("-inf")
    loss, stats = decoupled_ppo_loss(**inp, **options, cu_seqlens=cu_seqlens)
    (grad,) = torch.autograd.grad(loss, inp["logprobs"])
    assert torch.isfinite(grad).all() and math.isfinite(loss.item()), grad
    dropped = list(range(10, 25)) if options.get("policy_loss") != "cispo" else [12]
    assert stats.num_undefined == len(dropped), stats
    assert (grad[dropped] == 0).all() and (grad[:10] != 0).any(), grad
    kept = torch.ones(40, dtype=torch.bool)
    kept[dropped] = False
    without = dict(
        inp,
        loss_mask=kept,
        prox_logprobs=inp["prox_logprobs"].clamp(min=-5.0),
        behav_logprobs=inp["behav_logprobs"].clamp(min=-5.0),
    )
    ref_loss, _ = decoupled_ppo_loss(
        **without, **options, cu_seqlens=cu_seqlens, loss_normalizer=40
    )
    assert_close(loss.detach(), ref_loss.detach(), atol=1e-12, what="the rest of the batch")


def test_a_zero_behaviour_probability_under_a_clamp_cap_keeps_the_capped_weight(assert_close):
    inp = _inputs(20, seed=12)
    inp["loss_mask"][:] = True
    inp["behav_logprobs"][4] = float("-inf")
    loss, stats = decoupled_ppo_loss(**inp, eps_clip=0.2, behav_imp_cap=2.0, behav_cap_mode="clamp")
    ref_loss, _ = _reference(
        dict(inp, behav_logprobs=inp["behav_logprobs"].clamp(min=-50.0)),
        eps_clip=0.2,
        behav_imp_cap=2.0,
        behav_cap_mode="clamp",
    )
    assert_close(loss.detach(), ref_loss.detach(), atol=1e-12, what="w = inf clamped to 2")
    assert stats.num_undefined == 0 and stats.num_capped >= 1, stats


@pytest.mark.parametrize(
    "name,value",
    [
        ("prox_logprobs", float("nan")),
        ("behav_logprobs", float("nan")),
        ("prox_logprobs", float("inf")),
        ("advantages", float("-inf")),
        ("advantages", float("nan")),
    ],
)
def test_corrupt_values_on_loss_tokens_are_refused_with_their_name(name, value):
    inp = _inputs(30, seed=13)
    inp["loss_mask"][5] = True
    inp[name][5] = value
    short = name.removesuffix("_logprobs")
    with pytest.raises(ValueError, match=rf"{short} holds 1 invalid values on loss tokens"):
        decoupled_ppo_loss(**inp, eps_clip=0.2)
    inp["loss_mask"][5] = False  # the same value outside the loss mask is ignored
    loss, _ = decoupled_ppo_loss(**inp, eps_clip=0.2)
    assert math.isfinite(loss.item())


def test_empty_loss_mask_gives_zero_loss_and_zero_gradient():
    inp = _inputs(10, seed=6)
    inp["loss_mask"] = torch.zeros(10, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(**inp, eps_clip=0.2, behav_imp_cap=2.0)
    loss.backward()
    assert loss.item() == 0.0 and bool((inp["logprobs"].grad == 0).all()), loss
    assert stats == PPOStats(), stats
    assert all(v == 0.0 for v in stats.metrics().values()), stats.metrics()


@pytest.mark.parametrize("mode", ["mask", "clamp"])
@pytest.mark.parametrize("num_pieces", [2, 5])
def test_micro_batches_with_global_normalizer_sum_to_the_full_batch(mode, num_pieces, assert_close):
    inp = _inputs(400, seed=7)
    options = dict(eps_clip=0.2, eps_clip_high=0.3, behav_imp_cap=2.0, behav_cap_mode=mode)
    full_loss, full_stats = decoupled_ppo_loss(**inp, **options)
    (full_grad,) = torch.autograd.grad(full_loss, inp["logprobs"])

    cuts = torch.linspace(0, 400, num_pieces + 1).long().tolist()
    normalizer = int(inp["loss_mask"].sum())
    lp = inp["logprobs"].detach().clone().requires_grad_()
    total, pieces, means = 0.0, [], []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        piece = {k: v[lo:hi] for k, v in dict(inp, logprobs=lp).items()}
        loss, stats = decoupled_ppo_loss(**piece, **options, loss_normalizer=normalizer)
        loss.backward()  # gradient accumulation
        total += loss.item()
        pieces.append(stats)
        means.append(decoupled_ppo_loss(**piece, **options)[0].item())
    assert_close(torch.tensor(total, dtype=F64), full_loss.detach(), atol=1e-13, what="summed loss")
    assert_close(lp.grad, full_grad, atol=1e-15, what="accumulated gradient")
    mean_of_means = sum(means) / len(means)
    assert abs(mean_of_means - full_loss.item()) > 1e-6, (
        "the mean of per-piece means should differ from the token mean, else this test could "
        "not tell a global normaliser from a local one"
    )

    merged = PPOStats.reduce(pieces)
    _assert_stats_equal(merged, vars(full_stats))
    for key, value in merged.metrics().items():
        assert abs(value - full_stats.metrics()[key]) <= 1e-12 * max(1, abs(value)), key


def test_stats_survive_an_all_reduce_through_tensors():
    ranks = [
        decoupled_ppo_loss(**_inputs(100, seed=s), eps_clip=0.2, behav_imp_cap=2.0)[1]
        for s in range(3)
    ]
    sums = torch.stack([r.to_tensors()[0] for r in ranks]).sum(0)  # all_reduce(SUM)
    maxes = torch.stack([r.to_tensors()[1] for r in ranks]).amax(0)  # all_reduce(MAX)
    assert PPOStats.from_tensors(sums, maxes) == PPOStats.reduce(ranks)
    assert PPOStats().merge(ranks[0]) == ranks[0]


def test_stats_metrics_are_namespaced_ratios():
    stats = PPOStats(
        num_tokens=10,
        num_used_tokens=8,
        num_capped=2,
        num_clipped=2,
        sum_loss=-3.0,
        sum_behav_w=12.0,
        sum_approx_kl=0.5,
        max_behav_w=4.0,
    )
    assert stats.metrics() == {
        "train/loss": -0.3,
        "train/clip_frac": 0.25,
        "train/clip_low_frac": 0.0,
        "train/clip_high_frac": 0.0,
        "train/unclipped_outside_frac": 0.0,
        "train/ratio_max": 0.0,
        "train/behav_w_mean": 1.2,
        "train/behav_w_max": 4.0,
        "train/behav_cap_frac": 0.2,
        "train/behav_above_cap_frac": 0.0,
        "train/behav_below_floor_frac": 0.0,
        "train/approx_kl": 0.05,
        "train/undefined_frac": 0.0,
        "train/num_loss_tokens": 10.0,
    }


def test_invalid_arguments_are_refused_with_the_fix():
    inp = _inputs(8, seed=8)
    count = int(inp["loss_mask"].sum())
    with pytest.raises(ValueError, match="pass the loss-token count of the whole global batch"):
        decoupled_ppo_loss(**inp, loss_normalizer=count - 1)
    with pytest.raises(ValueError, match="behav_cap_mode='drop' is not one of mask, clamp"):
        decoupled_ppo_loss(**inp, behav_imp_cap=2.0, behav_cap_mode="drop")
    with pytest.raises(ValueError, match="eps_clip=0"):
        decoupled_ppo_loss(**inp, eps_clip=0)
    with pytest.raises(ValueError, match="loss_mask must be bool"):
        decoupled_ppo_loss(**dict(inp, loss_mask=inp["loss_mask"].float()))
    with pytest.raises(ValueError, match=r"same shape \[N\]"):
        decoupled_ppo_loss(**dict(inp, advantages=torch.zeros(7, dtype=F64)))


def test_options_come_from_the_ppo_config():
    cfg = PPOConfig(eps_clip=0.1, eps_clip_high=0.3, behav_imp_cap=4.0, behav_cap_mode="clamp")
    assert ppo_loss_options(cfg) == dict(
        eps_clip=0.1, eps_clip_high=0.3, behav_imp_cap=4.0, behav_cap_mode="clamp"
    )
