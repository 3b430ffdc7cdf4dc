"""Drift decomposition: how far the sampling policy is from the trained one, and why.

For every loss token, d = log pi_prox - log pi_behav. Tokens are split by the policy
version that sampled them:

- fresh: the version of the proximal policy (the trainer's weights at the start of the
  step). The same weights gave pi_behav (in the inference engine, at generation) and
  pi_prox (in the trainer's recompute forward), so d is engine numerics alone: kernels,
  precision, batch composition, sampling-side processing;
- stale: an older version: d adds the policy change since then (staleness).

Per split, as sums, counts and maxima (so they merge exactly over micro-batches and ranks):
mean and max |d|; the k3 estimator of KL(pi_behav || pi_prox), the mean of
(w - 1) - log w with w = e^d (non-negative; unbiased because the tokens were sampled from
pi_behav; J. Schulman, "Approximating KL Divergence", 2020); and the fraction of tokens
each active correction acted on: masked or clamped by the behaviour-weight bounds, clipped
by the surrogate's clip (`areal.algorithms.corrections`).

With prox_logp='loglinear' pi_prox is interpolated, and for a fresh token it equals
pi_behav by construction (d = 0): only prox_logp='recompute' measures engine numerics.
"""

from __future__ import annotations

import torch

SPLITS = ("fresh", "stale")
CORRECTIONS = ("behav_masked", "behav_clamped", "clipped")
"""Per-split counters of what each correction did, as `num_<split>_<correction>`."""


def sum_fields() -> list[str]:
    """The additive `PPOStats` fields this module fills, in a fixed order."""
    names = []
    for split in SPLITS:
        names += [f"num_{split}_tokens", f"sum_{split}_abs_diff", f"sum_{split}_behav_kl"]
        names += [f"num_{split}_{c}" for c in CORRECTIONS]
    return names


def max_fields() -> list[str]:
    return [f"max_{split}_abs_diff" for split in SPLITS]


@torch.no_grad()
def drift_sums(
    log_w: torch.Tensor, fresh: torch.Tensor, acted: dict[str, torch.Tensor]
) -> dict[str, float | int]:
    """Sums, counts and maxima over [L] loss tokens: `log_w` = log pi_prox - log pi_behav,
    `fresh` bool, and `acted[correction]` bool (the tokens each correction acted on)."""
    diff = log_w.double()
    abs_diff = diff.abs()
    # (e^d - 1) - d, with d = +inf giving +inf rather than inf - inf = NaN.
    k3 = torch.where(diff == torch.inf, torch.inf, torch.expm1(diff) - diff)
    out: dict[str, float | int] = {}
    for split, members in (("fresh", fresh), ("stale", ~fresh)):
        out[f"num_{split}_tokens"] = int(members.sum())
        out[f"sum_{split}_abs_diff"] = abs_diff[members].sum().item()
        out[f"sum_{split}_behav_kl"] = k3[members].sum().item()
        out[f"max_{split}_abs_diff"] = abs_diff[members].max().item() if members.any() else 0.0
        for correction in CORRECTIONS:
            out[f"num_{split}_{correction}"] = int((acted[correction] & members).sum())
    return out


def drift_metrics(
    values: dict[str, float], prefix: str, corrections: tuple[str, ...] = CORRECTIONS
) -> dict[str, float]:
    """Means, maxima and fractions per split present (`values`: the merged fields)."""
    out: dict[str, float] = {}
    num_fresh, num_stale = values["num_fresh_tokens"], values["num_stale_tokens"]
    if num_fresh + num_stale > 0:
        out[f"{prefix}fresh_token_frac"] = num_fresh / (num_fresh + num_stale)
    for split in SPLITS:
        count = values[f"num_{split}_tokens"]
        if count == 0:
            continue
        out[f"{prefix}logprob_diff_{split}"] = values[f"sum_{split}_abs_diff"] / count
        out[f"{prefix}logprob_diff_{split}_max"] = values[f"max_{split}_abs_diff"]
        out[f"{prefix}behav_kl_{split}"] = values[f"sum_{split}_behav_kl"] / count
        for correction in corrections:
            out[f"{prefix}{correction}_frac_{split}"] = values[f"num_{split}_{correction}"] / count
    return out


def active_corrections(*, cap: float | None, floor: float | None, mode: str) -> tuple[str, ...]:
    """The corrections a configuration turns on: the surrogate's clip always; the behaviour
    weight's mask or clamp when it has a bound."""
    bounded = cap is not None or floor is not None
    return (
        *((f"behav_{'masked' if mode == 'mask' else 'clamped'}",) if bounded else ()),
        "clipped",
    )
