"""The decoupled PPO objective (docs/design.md section 6) and its exactly-aggregable statistics.

Role: given per-token log-probs of the sampled tokens under three policies, return the
loss to back-propagate and a `PPOStats` of sums, counts and maxima. N is the number of
tokens of the (micro-)batch, packed without padding; every input is a [N] tensor:

- `logprobs`       log pi_theta, the policy being optimised (the only input that gets a
                   gradient);
- `prox_logprobs`  log pi_prox, the proximal policy (recomputed at the start of the step, or
                   approximated by `areal.algorithms.proximal`);
- `behav_logprobs` log pi_behav, recorded when the token was sampled (may mix versions);
- `advantages`     per-token advantage (`advantages.token_advantages`);
- `loss_mask`      bool, True for tokens the loss trains on.

With r = pi_theta/pi_prox and w = pi_prox/pi_behav (never differentiated), each loss token
contributes  -w * min(r*A, clip(r, 1 - eps_clip, 1 + eps_clip_high)*A)  and

    loss = sum over loss tokens / loss_normalizer.

That default is the paper's objective. Options (`areal.algorithms.corrections` has the
formulas and their sources) change one part each: the level and the bounds of w
(`behav_imp_level`, `behav_imp_floor`, `behav_imp_cap`, `behav_cap_mode`: TIS, MIS,
IcePop), the surrogate (`policy_loss`: GSPO's sequence ratio, CISPO's clipped stop-gradient
weight) and the aggregation (`loss_agg_mode`, `areal.algorithms.aggregation`: token mean,
sequence mean of token means, Dr.GRPO's constant normaliser). Sequence-level options need
the sequence boundaries, `cu_seqlens [S+1]`; sequences are made of loss tokens only.

Contract: `loss_normalizer` is the number of normalisation units of the *global* batch (all
gradient-accumulation micro-batches of one optimiser step, all data-parallel ranks): loss
tokens for 'token-mean', sequences with loss tokens otherwise. Summing the losses (and
gradients) of the pieces then gives the loss of the whole batch, not a mean of means. By
default it is this call's own count. Tokens whose w is outside its bounds in 'mask' mode
contribute 0 but still count in that denominator (as in AReaL). Tokens outside the loss
mask, and masked-out tokens, are dropped before any arithmetic that involves w, so garbage
there (e.g. prompt log-probs, w = inf) cannot turn into NaN values or gradients.
`PPOStats` holds only sums, counts and maxima, so merging the stats of micro-batches and
ranks gives exactly the full-batch statistics; with `fresh` (which tokens the proximal
policy's own version sampled) it also splits the drift between the policies by that
(`areal.algorithms.drift`).

Log-probs of -inf on a loss token (a probability that underflowed) are allowed and have a
defined outcome: a token whose term is undefined (r = inf when pi_prox is 0; w = inf when
pi_behav is 0 and no cap catches it) is dropped like a masked token (it counts in the
denominator, contributes 0, and is counted in `num_undefined`); for GSPO, whose ratio is
the sequence's, a pi_prox of 0 drops the whole sequence. NaN anywhere, +inf log-probs or
infinite advantages on a loss token are refused with an error: they are corrupt data, not
probabilities.

It does not compute log-probs, advantages or entropies, does not step optimisers and does
not communicate; `PPOStats.to_tensors` is what a trainer all-reduces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypedDict
from collections.abc import Iterable

import torch

from areal.algorithms import aggregation, corrections, drift
from areal.algorithms.aggregation import Segments
from areal.config import PPOConfig


@dataclass(kw_only=True)
class PPOStats:
    """Additive statistics of one or more loss calls; merge them, then read `metrics()`.

    Counts are over loss tokens (`loss_mask` True). `num_capped` counts tokens with w outside
    its bounds (dropped in 'mask' mode, clamped in 'clamp' mode); `num_used_tokens` those that
    contribute to the loss; `num_clipped` those among them whose clip is active (for PPO and
    GSPO the clipped surrogate is strictly the smaller one, so the token has no gradient; for
    CISPO its weight was clipped). `sum_approx_kl` sums the k3 estimator (r - 1) - log r per
    loss token: non-negative and unbiased for KL(pi_prox || pi_theta) when tokens are sampled
    from pi_prox; here they come from pi_behav and are not re-weighted, so it is a drift
    monitor, exact only when behav = prox; it skips tokens whose pi_prox is 0.
    `num_undefined` counts tokens dropped because their term is undefined (module doc).
    `max_behav_w` is 0 when no token was seen (w > 0, so 0 is the identity).

    Which bound acted: `num_clipped_low` / `num_clipped_high` split `num_clipped` by the side
    of the clip range the ratio r left (below 1 - eps with A < 0, above 1 + eps with A > 0);
    `num_unclipped_outside` counts used tokens whose r is outside the range but whose
    unclipped term is the smaller, so the clip does not bound them (r > 1 + eps with A < 0,
    r < 1 - eps with A > 0: the side PPO leaves open, where a token's gradient grows with
    r; no dual clip is applied); `max_ratio` is the largest r of a used token.
    `num_above_cap` / `num_below_floor` split `num_capped` by the bound of w that was crossed. The `*_fresh_*` / `*_stale_*` fields are the drift decomposition
    (`areal.algorithms.drift`), zero when the caller did not say which tokens are fresh.
    """

    num_tokens: int = 0
    num_used_tokens: int = 0
    num_capped: int = 0
    num_clipped: int = 0
    num_undefined: int = 0
    num_clipped_low: int = 0
    num_clipped_high: int = 0
    num_unclipped_outside: int = 0
    num_above_cap: int = 0
    num_below_floor: int = 0
    max_ratio: float = 0.0
    sum_loss: float = 0.0
    """Sum of the per-token objective times its aggregation factor (1 in 'token-mean');
    sum_loss / num_loss_units is the global loss."""
    sum_behav_w: float = 0.0
    sum_approx_kl: float = 0.0
    max_behav_w: float = 0.0
    num_loss_units: int = 0
    """Units of the loss normaliser: loss tokens ('token-mean') or sequences with loss tokens."""
    num_fresh_tokens: int = 0
    sum_fresh_abs_diff: float = 0.0
    sum_fresh_behav_kl: float = 0.0
    num_fresh_behav_masked: int = 0
    num_fresh_behav_clamped: int = 0
    num_fresh_clipped: int = 0
    num_stale_tokens: int = 0
    sum_stale_abs_diff: float = 0.0
    sum_stale_behav_kl: float = 0.0
    num_stale_behav_masked: int = 0
    num_stale_behav_clamped: int = 0
    num_stale_clipped: int = 0
    max_fresh_abs_diff: float = 0.0
    max_stale_abs_diff: float = 0.0

    _MAX_FIELDS = ("max_behav_w", "max_ratio", *drift.max_fields())

    @classmethod
    def _sum_fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name not in cls._MAX_FIELDS]

    def merge(self, other: PPOStats) -> PPOStats:
        """Statistics of both pieces together: sums and counts add, maxima take the max."""
        values = {name: getattr(self, name) + getattr(other, name) for name in self._sum_fields()}
        values.update(
            {name: max(getattr(self, name), getattr(other, name)) for name in self._MAX_FIELDS}
        )
        return PPOStats(**values)

    @classmethod
    def reduce(cls, pieces: Iterable[PPOStats]) -> PPOStats:
        total = cls()
        for piece in pieces:
            total = total.merge(piece)
        return total

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([K] float64 to all-reduce with SUM, [M] float64 to all-reduce with MAX).

        Counts below 2**53 survive float64 exactly.
        """
        sums = torch.tensor(
            [float(getattr(self, n)) for n in self._sum_fields()], dtype=torch.float64
        )
        maxes = torch.tensor(
            [float(getattr(self, n)) for n in self._MAX_FIELDS], dtype=torch.float64
        )
        return sums, maxes

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, maxes: torch.Tensor) -> PPOStats:
        """Inverse of `to_tensors` (after the all-reduces)."""
        values: dict[str, Any] = {}
        for field, value in zip(cls._sum_fields(), sums.tolist(), strict=True):
            values[field] = round(value) if field.startswith("num_") else value
        values.update(zip(cls._MAX_FIELDS, maxes.tolist(), strict=True))
        return cls(**values)

    def metrics(
        self, prefix: str = "train/", corrections: tuple[str, ...] = drift.CORRECTIONS
    ) -> dict[str, float]:
        """Means and fractions for logging; all 0.0 when there were no loss tokens. The drift
        split (for the given active `corrections`) only where its tokens were seen."""
        n = max(self.num_tokens, 1)
        used = max(self.num_used_tokens, 1)
        units = self.num_loss_units or self.num_tokens  # a hand-built PPOStats may omit units
        return {
            f"{prefix}loss": self.sum_loss / max(units, 1),
            f"{prefix}clip_frac": self.num_clipped / used,
            f"{prefix}clip_low_frac": self.num_clipped_low / used,
            f"{prefix}clip_high_frac": self.num_clipped_high / used,
            f"{prefix}unclipped_outside_frac": self.num_unclipped_outside / used,
            f"{prefix}ratio_max": self.max_ratio,
            f"{prefix}behav_w_mean": self.sum_behav_w / n,
            f"{prefix}behav_w_max": self.max_behav_w,
            f"{prefix}behav_cap_frac": self.num_capped / n,
            f"{prefix}behav_above_cap_frac": self.num_above_cap / n,
            f"{prefix}behav_below_floor_frac": self.num_below_floor / n,
            f"{prefix}approx_kl": self.sum_approx_kl / n,
            f"{prefix}undefined_frac": self.num_undefined / n,
            f"{prefix}num_loss_tokens": float(self.num_tokens),
            **drift.drift_metrics(vars(self), prefix, corrections),
        }


class PPOLossOptions(TypedDict):
    """The paper's keyword arguments of `decoupled_ppo_loss` (`ppo_loss_options`)."""

    eps_clip: float
    eps_clip_high: float | None
    behav_imp_cap: float | None
    behav_cap_mode: str


class CorrectionLossOptions(TypedDict):
    """The other keyword arguments of `decoupled_ppo_loss` (`correction_loss_options`)."""

    behav_imp_floor: float | None
    behav_imp_level: str
    policy_loss: str
    loss_agg_mode: str
    loss_agg_norm: float


def ppo_loss_options(cfg: PPOConfig) -> PPOLossOptions:
    """Keyword arguments of `decoupled_ppo_loss` taken from the run's `PPOConfig` (the
    paper's options; `correction_loss_options` adds the others)."""
    return {
        "eps_clip": cfg.eps_clip,
        "eps_clip_high": cfg.eps_clip_high,
        "behav_imp_cap": cfg.behav_imp_cap,
        "behav_cap_mode": cfg.behav_cap_mode,
    }


def correction_loss_options(cfg: PPOConfig, max_new_tokens: int) -> CorrectionLossOptions:
    """The other keyword arguments of `decoupled_ppo_loss` from `PPOConfig`; Dr.GRPO's L
    defaults to the completion budget `max_new_tokens` (rollout.max_new_tokens)."""
    return {
        "behav_imp_floor": cfg.behav_imp_floor,
        "behav_imp_level": cfg.behav_imp_level,
        "policy_loss": cfg.policy_loss,
        "loss_agg_mode": cfg.loss_agg_mode,
        "loss_agg_norm": cfg.loss_agg_norm if cfg.loss_agg_norm is not None else max_new_tokens,
    }


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_imp_cap: float | None = None,
    behav_cap_mode: str = "mask",
    loss_normalizer: float | None = None,
    behav_imp_floor: float | None = None,
    behav_imp_level: str = "token",
    policy_loss: str = "ppo",
    loss_agg_mode: str = "token-mean",
    loss_agg_norm: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PPOStats]:
    """(scalar loss, stats) of the decoupled PPO objective; see the module docstring.

    `cu_seqlens [S+1]` is required by the sequence-level options; `fresh [N]` (bool: the
    token was sampled by the proximal policy's version) turns on the drift decomposition.
    Only `logprobs` receives a gradient: the other inputs are detached here, whatever the
    caller passes. Compute in float32 or wider; the loss has `logprobs`' dtype after type
    promotion with the other inputs.
    """
    _check_inputs(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask)
    _check_options(eps_clip, eps_clip_high)
    corrections.check_corrections(
        level=behav_imp_level,
        floor=behav_imp_floor,
        cap=behav_imp_cap,
        mode=behav_cap_mode,
        kind=policy_loss,
    )
    aggregation.check_aggregation(loss_agg_mode, loss_agg_norm)
    segments = _segments(cu_seqlens, loss_mask, behav_imp_level, policy_loss, loss_agg_mode)
    num_tokens = int(loss_mask.sum())
    num_units = aggregation.num_units(segments, loss_agg_mode, num_tokens)
    normalizer = _normalizer(loss_normalizer, num_units)

    theta = logprobs[loss_mask]
    prox = prox_logprobs.detach()[loss_mask]
    behav = behav_logprobs.detach()[loss_mask]
    adv = advantages.detach()[loss_mask]
    _check_values(prox=prox, behav=behav, advantages=adv)
    log_w = corrections.log_behav_weight(prox, behav)
    weight = corrections.behav_weight(
        log_w,
        segments,
        level=behav_imp_level,
        floor=behav_imp_floor,
        cap=behav_imp_cap,
        mode=behav_cap_mode,
    )
    weight, undefined = _drop_undefined(weight, prox, segments, policy_loss)
    finite_prox = prox.masked_fill(~prox.isfinite(), 0.0)  # its tokens are all dropped
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    gain, clip_active = corrections.surrogate(
        theta,
        finite_prox,
        adv,
        weight.keep,
        segments,
        kind=policy_loss,
        eps_low=eps_clip,
        eps_high=eps_high,
    )
    objective = -weight.used[weight.keep] * gain
    factors = aggregation.aggregation_factors(
        segments, loss_agg_mode, num_tokens, loss_agg_norm, objective.dtype
    )
    if factors is not None:
        objective = objective * factors[weight.keep]
    loss = objective.sum() / normalizer

    log_ratio = logprobs.detach()[loss_mask] - prox
    sides = corrections.clip_sides(
        theta.detach(),
        finite_prox,
        adv,
        weight.keep,
        clip_active,
        segments,
        kind=policy_loss,
        eps_low=eps_clip,
        eps_high=eps_high,
    )
    bounds = {
        "num_above_cap": int((weight.w > behav_imp_cap).sum()) if behav_imp_cap else 0,
        "num_below_floor": int((weight.w < behav_imp_floor).sum()) if behav_imp_floor else 0,
    }
    stats = dataclasses.replace(
        _stats(log_ratio, weight, undefined, clip_active, objective.detach(), num_units),
        **sides,
        **bounds,
    )
    if fresh is not None:
        stats = dataclasses.replace(
            stats, **_drift(log_w, fresh[loss_mask], weight, clip_active, behav_cap_mode)
        )
    return loss, stats


def _drop_undefined(
    weight: corrections.BehavWeight, prox: torch.Tensor, segments: Segments | None, kind: str
) -> tuple[corrections.BehavWeight, torch.Tensor]:
    """(weight without the [L] tokens whose term is undefined, those tokens): r = inf
    where pi_prox = 0, w = inf where pi_behav = 0 and no bound caught it. GSPO's ratio is
    its sequence's, so there a pi_prox of 0 drops every token of the sequence."""
    no_prox = ~prox.isfinite()
    if kind == "gspo" and bool(no_prox.any()):
        assert segments is not None  # GSPO's ratio is per sequence
        no_prox = torch.isin(segments.index, segments.index[no_prox])
    undefined = weight.keep & (no_prox | ~weight.used.isfinite())
    return dataclasses.replace(weight, keep=weight.keep & ~undefined), undefined


def _segments(
    cu_seqlens: torch.Tensor | None, loss_mask: torch.Tensor, level: str, kind: str, agg_mode: str
) -> Segments | None:
    """Sequence membership of the loss tokens, when an option needs it."""
    wanted = [
        name
        for name, needed in (
            (f"behav_imp_level={level!r}", level == "sequence"),
            (f"policy_loss={kind!r}", kind == "gspo"),
            (f"loss_agg_mode={agg_mode!r}", aggregation.needs_segments(agg_mode)),
        )
        if needed
    ]
    if not wanted:
        return None
    if cu_seqlens is None:
        raise ValueError(
            f"decoupled_ppo_loss: {', '.join(wanted)} works per sequence; pass "
            "cu_seqlens [S+1], the packed batch's sequence offsets"
        )
    return Segments.of_loss_tokens(cu_seqlens, loss_mask)


@torch.no_grad()
def _stats(
    log_ratio: torch.Tensor,
    weight: corrections.BehavWeight,
    undefined: torch.Tensor,
    clip_active: torch.Tensor,
    objective: torch.Tensor,
    num_units: int,
) -> PPOStats:
    """Stats of one call: [L] tensors over loss tokens, [U] over the used ones."""
    w = weight.w
    log_ratio = log_ratio[log_ratio != torch.inf]  # pi_prox = 0: no finite divergence
    return PPOStats(
        num_tokens=len(w),
        num_used_tokens=int(weight.keep.sum()),
        num_capped=int(weight.outside.sum()),
        num_clipped=int(clip_active.sum()),
        num_undefined=int(undefined.sum()),
        sum_loss=objective.double().sum().item(),
        sum_behav_w=w.double().sum().item(),
        sum_approx_kl=(torch.expm1(log_ratio) - log_ratio).double().sum().item(),
        max_behav_w=w.max().item() if len(w) else 0.0,
        num_loss_units=num_units,
    )


def _drift(
    log_w: torch.Tensor,
    fresh: torch.Tensor,
    weight: corrections.BehavWeight,
    clip_active: torch.Tensor,
    mode: str,
) -> dict[str, Any]:
    """The drift decomposition's fields over [L] loss tokens ([U] `clip_active`)."""
    clipped = torch.zeros_like(weight.keep)
    clipped[weight.keep] = clip_active
    acted = {
        "behav_masked": weight.outside & (mode == "mask"),
        "behav_clamped": weight.outside & (mode == "clamp"),
        "clipped": clipped,
    }
    return drift.drift_sums(log_w, fresh.to(torch.bool), acted)


def _check_inputs(*tensors: torch.Tensor) -> None:
    names = ("logprobs", "prox_logprobs", "behav_logprobs", "advantages", "loss_mask")
    shapes = {name: tuple(t.shape) for name, t in zip(names, tensors, strict=True)}
    if len(set(shapes.values())) != 1 or len(shapes["logprobs"]) != 1:
        raise ValueError(
            f"decoupled_ppo_loss: all inputs must have the same shape [N], got {shapes}"
        )
    if tensors[-1].dtype != torch.bool:
        raise ValueError(f"decoupled_ppo_loss: loss_mask must be bool, got {tensors[-1].dtype}")


def _check_values(**loss_token_values: torch.Tensor) -> None:
    """Refuse NaN, +inf log-probs and infinite advantages on loss tokens ([L] each)."""
    for name, values in loss_token_values.items():
        bad = values.isnan() | (values == float("inf"))
        if name == "advantages":
            bad |= values.isinf()
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise ValueError(
                f"decoupled_ppo_loss: {name} holds {int(bad.sum())} invalid values on loss "
                f"tokens (the first, loss token {first}, is {values[first].item()}); log-probs "
                "must be finite or -inf, advantages finite: check the engine's log-probs, the "
                "trainer's forward pass and the rewards for NaN or corrupted data"
            )


def _check_options(eps_clip: float, eps_clip_high: float | None) -> None:
    if not eps_clip > 0:
        raise ValueError(f"eps_clip={eps_clip!r} must be > 0")
    if eps_clip_high is not None and not eps_clip_high > 0:
        raise ValueError(f"eps_clip_high={eps_clip_high!r} must be > 0 or None")


def _normalizer(loss_normalizer: float | None, num_units: int) -> float:
    """The loss denominator; 1 when there is nothing to average (the loss is then 0)."""
    if loss_normalizer is None:
        return float(max(num_units, 1))
    if not loss_normalizer >= num_units or not loss_normalizer > 0:
        raise ValueError(
            f"loss_normalizer={loss_normalizer!r} is below this call's {num_units} loss units "
            "(or not positive); pass the loss-token count of the whole global batch (all "
            "micro-batches and ranks of the optimiser step), or its count of sequences with "
            "loss tokens for the sequence-mean aggregations"
        )
    return float(loss_normalizer)
