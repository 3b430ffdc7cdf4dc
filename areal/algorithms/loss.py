"""The decoupled PPO objective (DESIGN.md section 6) and its exactly-aggregable statistics.

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

Contract: `loss_normalizer` is the number of loss tokens of the *global* batch (all
gradient-accumulation micro-batches of one optimiser step, all data-parallel ranks), so
summing the losses (and gradients) of the pieces gives the token-level mean over the whole
batch, not a mean of means. By default it is this call's own loss-token count. Tokens whose
w exceeds the cap in 'mask' mode contribute 0 but still count in that denominator (as in
AReaL). Tokens outside the loss mask, and masked-out tokens, are dropped before any
arithmetic, so garbage there (e.g. prompt log-probs, w = inf) cannot turn into NaN
values or gradients. `PPOStats` holds only sums, counts and maxima, so merging the stats of
micro-batches and ranks gives exactly the full-batch statistics.

It does not compute log-probs, advantages or entropies, does not step optimisers and does
not communicate; `PPOStats.to_tensors` is what a trainer all-reduces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch

from areal.config import PPOConfig

CAP_MODES = ("mask", "clamp")
"""What happens to loss tokens whose behaviour importance weight w exceeds the cap."""


@dataclass(kw_only=True)
class PPOStats:
    """Additive statistics of one or more loss calls; merge them, then read `metrics()`.

    Counts are over loss tokens (`loss_mask` True). `num_capped` counts tokens with w above
    the cap (dropped in 'mask' mode, clamped in 'clamp' mode); `num_used_tokens` those that
    contribute to the loss; `num_clipped` those among them whose PPO clip is active (the
    clipped surrogate is strictly the smaller one, so the token has no gradient).
    `sum_approx_kl` sums the k3 estimator (r - 1) - log r per loss token: non-negative and
    unbiased for KL(pi_prox || pi_theta) when tokens are sampled from pi_prox; here they
    come from pi_behav and are not re-weighted, so it is a drift monitor, exact only when
    behav = prox. `max_behav_w` is 0 when no token was seen (w > 0, so 0 is the identity).
    """

    num_tokens: int = 0
    num_used_tokens: int = 0
    num_capped: int = 0
    num_clipped: int = 0
    sum_loss: float = 0.0
    """Sum of the per-token objective; sum_loss / num_tokens is the global loss."""
    sum_behav_w: float = 0.0
    sum_approx_kl: float = 0.0
    max_behav_w: float = 0.0

    _MAX_FIELDS = ("max_behav_w",)

    @classmethod
    def _sum_fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name not in cls._MAX_FIELDS]

    def merge(self, other: "PPOStats") -> "PPOStats":
        """Statistics of both pieces together: sums and counts add, maxima take the max."""
        values = {name: getattr(self, name) + getattr(other, name) for name in self._sum_fields()}
        values.update({name: max(getattr(self, name), getattr(other, name))
                       for name in self._MAX_FIELDS})
        return PPOStats(**values)

    @classmethod
    def reduce(cls, pieces: Iterable["PPOStats"]) -> "PPOStats":
        total = cls()
        for piece in pieces:
            total = total.merge(piece)
        return total

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([K] float64 to all-reduce with SUM, [M] float64 to all-reduce with MAX).

        Counts below 2**53 survive float64 exactly.
        """
        sums = torch.tensor([float(getattr(self, n)) for n in self._sum_fields()], dtype=torch.float64)
        maxes = torch.tensor([float(getattr(self, n)) for n in self._MAX_FIELDS], dtype=torch.float64)
        return sums, maxes

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, maxes: torch.Tensor) -> "PPOStats":
        """Inverse of `to_tensors` (after the all-reduces)."""
        values: dict[str, float | int] = {}
        for field, value in zip(cls._sum_fields(), sums.tolist(), strict=True):
            values[field] = int(round(value)) if field.startswith("num_") else value
        values.update(zip(cls._MAX_FIELDS, maxes.tolist(), strict=True))
        return cls(**values)

    def metrics(self, prefix: str = "train/") -> dict[str, float]:
        """Means and fractions for logging; all 0.0 when there were no loss tokens."""
        n = max(self.num_tokens, 1)
        return {
            f"{prefix}loss": self.sum_loss / n,
            f"{prefix}clip_frac": self.num_clipped / max(self.num_used_tokens, 1),
            f"{prefix}behav_w_mean": self.sum_behav_w / n,
            f"{prefix}behav_w_max": self.max_behav_w,
            f"{prefix}behav_cap_frac": self.num_capped / n,
            f"{prefix}approx_kl": self.sum_approx_kl / n,
            f"{prefix}num_loss_tokens": float(self.num_tokens),
        }


def ppo_loss_options(cfg: PPOConfig) -> dict[str, float | str | None]:
    """Keyword arguments of `decoupled_ppo_loss` taken from the run's `PPOConfig`."""
    return {"eps_clip": cfg.eps_clip, "eps_clip_high": cfg.eps_clip_high,
            "behav_imp_cap": cfg.behav_imp_cap, "behav_cap_mode": cfg.behav_cap_mode}


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
) -> tuple[torch.Tensor, PPOStats]:
    """(scalar loss, stats) of the decoupled PPO objective; see the module docstring.

    Only `logprobs` receives a gradient: the other inputs are detached here, whatever the
    caller passes. Compute in float32 or wider; the loss has `logprobs`' dtype after type
    promotion with the other inputs.
    """
    _check_inputs(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask)
    _check_options(eps_clip, eps_clip_high, behav_imp_cap, behav_cap_mode)
    num_tokens = int(loss_mask.sum())
    normalizer = _normalizer(loss_normalizer, num_tokens)

    theta = logprobs[loss_mask]
    prox = prox_logprobs.detach()[loss_mask]
    adv = advantages.detach()[loss_mask]
    w = torch.exp(prox - behav_logprobs.detach()[loss_mask])
    capped, keep, w_used = _apply_cap(w, behav_imp_cap, behav_cap_mode)
    # Select before multiplying: a dropped token with w = inf must not reach the graph.
    theta, prox, adv, w_used = theta[keep], prox[keep], adv[keep], w_used[keep]
    ratio = torch.exp(theta - prox)
    surrogate = ratio * adv
    high = eps_clip if eps_clip_high is None else eps_clip_high
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + high) * adv
    objective = -w_used * torch.minimum(surrogate, clipped)
    loss = objective.sum() / normalizer

    log_ratio = logprobs.detach()[loss_mask] - prox_logprobs.detach()[loss_mask]
    return loss, _stats(log_ratio, w, capped, keep, clipped < surrogate, objective.detach())


@torch.no_grad()
def _stats(log_ratio: torch.Tensor, w: torch.Tensor, capped: torch.Tensor, keep: torch.Tensor,
           clip_active: torch.Tensor, objective: torch.Tensor) -> PPOStats:
    """Stats of one call: [L] tensors over loss tokens, [U] over the used ones."""
    return PPOStats(
        num_tokens=len(w),
        num_used_tokens=int(keep.sum()),
        num_capped=int(capped.sum()),
        num_clipped=int(clip_active.sum()),
        sum_loss=objective.double().sum().item(),
        sum_behav_w=w.double().sum().item(),
        sum_approx_kl=(torch.expm1(log_ratio) - log_ratio).double().sum().item(),
        max_behav_w=w.max().item() if len(w) else 0.0,
    )


def _apply_cap(
    w: torch.Tensor, cap: float | None, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([L] w above the cap, [L] tokens kept in the loss, [L] w to use) for [L] loss tokens.

    w == cap is kept as is: the cap is the largest weight allowed.
    """
    if cap is None:
        nothing = torch.zeros_like(w, dtype=torch.bool)
        return nothing, ~nothing, w
    capped = w > cap
    if mode == "clamp":
        return capped, torch.ones_like(capped), w.clamp(max=cap)
    return capped, ~capped, w


def _check_inputs(*tensors: torch.Tensor) -> None:
    names = ("logprobs", "prox_logprobs", "behav_logprobs", "advantages", "loss_mask")
    shapes = {name: tuple(t.shape) for name, t in zip(names, tensors, strict=True)}
    if len(set(shapes.values())) != 1 or len(shapes["logprobs"]) != 1:
        raise ValueError(f"decoupled_ppo_loss: all inputs must have the same shape [N], got {shapes}")
    if tensors[-1].dtype != torch.bool:
        raise ValueError(f"decoupled_ppo_loss: loss_mask must be bool, got {tensors[-1].dtype}")


def _check_options(eps_clip: float, eps_clip_high: float | None, cap: float | None,
                   cap_mode: str) -> None:
    if not eps_clip > 0:
        raise ValueError(f"eps_clip={eps_clip!r} must be > 0")
    if eps_clip_high is not None and not eps_clip_high > 0:
        raise ValueError(f"eps_clip_high={eps_clip_high!r} must be > 0 or None")
    if cap is not None and not cap > 0:
        raise ValueError(f"behav_imp_cap={cap!r} must be > 0 or None")
    if cap_mode not in CAP_MODES:
        raise ValueError(f"behav_cap_mode={cap_mode!r} is not one of {', '.join(CAP_MODES)}")


def _normalizer(loss_normalizer: float | None, num_tokens: int) -> float:
    """The loss denominator; 1 when there is nothing to average (the loss is then 0)."""
    if loss_normalizer is None:
        return float(max(num_tokens, 1))
    if not loss_normalizer >= num_tokens or not loss_normalizer > 0:
        raise ValueError(
            f"loss_normalizer={loss_normalizer!r} is below this call's {num_tokens} loss tokens "
            "(or not positive); pass the loss-token count of the whole global batch (all "
            "micro-batches and ranks of the optimiser step)"
        )
    return float(loss_normalizer)
