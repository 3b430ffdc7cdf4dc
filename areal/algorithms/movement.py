"""How far one training step moved the policy, and how stale its data was, per loss token.

Role: the mechanism behind the staleness ablation, measured. Three policies meet in a step:
pi_behav (recorded at sampling, possibly several versions old), pi_prox (the trainer's
weights at the start of the step, recomputed exactly here, whatever the objective anchors
its clip on) and pi_new (the weights after the step's optimiser updates). Over the L loss
tokens of a batch, with tokens sampled from pi_behav:

- KL(pi_behav || pi_prox), KL(pi_behav || pi_new): the k3 estimator (rho - 1) - log rho,
  rho = pi_other / pi_behav (J. Schulman, "Approximating KL Divergence", 2020): unbiased,
  since the tokens come from pi_behav;
- KL(pi_prox || pi_new) (the step's own movement): the same estimator with
  rho = pi_new / pi_prox, averaged over the behaviour tokens without re-weighting, so an
  approximation (exact when pi_behav = pi_prox, i.e. fresh data);
- the distribution of the behaviour importance weight w = pi_prox / pi_behav, as fractions
  of tokens in fixed bins (`W_BINS`), and the fraction outside the clip range
  [1 - eps_low, 1 + eps_high] (where naive PPO, whose ratio starts each step at w, clips or
  leaves a token unbounded before any update).

Everything is a sum or a count, so micro-batches and ranks merge exactly (`merge`, and the
trainer all-reduces `SUM_FIELDS`). Pure tensor code: the forward passes that produce the
log-probs are the trainer's (workers/trainer/ppo.py, `trainer.measure_movement`).
"""

from __future__ import annotations

import torch

W_BINS = (0.5, 0.8, 0.95, 1.05, 1.2, 2.0)
"""Edges of the bins of w (each bin is [low, high)); 0.8 and 1.2 are the default clip range."""


def bin_labels() -> list[str]:
    edges = [f"{e:g}" for e in W_BINS]
    return [
        f"<{edges[0]}",
        *(f"{a}-{b}" for a, b in zip(edges, edges[1:], strict=False)),
        f">={edges[-1]}",
    ]


SUM_FIELDS = (
    "num_tokens",
    "num_new_tokens",
    "sum_kl_behav_prox",
    "sum_kl_behav_new",
    "sum_kl_prox_new",
    "num_w_outside_clip",
    *(f"num_w_bin_{i}" for i in range(len(W_BINS) + 1)),
)
"""Sums and counts of one batch: tokens measured (with pi_prox; with pi_new), KL sums, bin
counts."""


def _k3(log_rho: torch.Tensor) -> torch.Tensor:
    """(rho - 1) - log rho per token; tokens where either log-prob is -inf are left out by
    the caller."""
    return torch.expm1(log_rho) - log_rho


@torch.no_grad()
def movement_sums(
    behav: torch.Tensor,
    prox: torch.Tensor,
    new: torch.Tensor | None,
    loss_mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> dict[str, float]:
    """`SUM_FIELDS` over the loss tokens of [N] log-probs (`new` None: the step's result was
    not measured, its sums stay 0)."""
    behav, prox = behav[loss_mask].double(), prox[loss_mask].double()
    finite = behav.isfinite() & prox.isfinite()
    log_w = (prox - behav)[finite]
    out = dict.fromkeys(SUM_FIELDS, 0.0)
    out["num_tokens"] = float(len(log_w))
    out["sum_kl_behav_prox"] = _k3(log_w).sum().item()
    w = log_w.exp()
    out["num_w_outside_clip"] = float(((w < 1 - eps_low) | (w > 1 + eps_high)).sum())
    index = torch.bucketize(w, torch.tensor(W_BINS, dtype=w.dtype), right=True)
    for i, count in enumerate(torch.bincount(index, minlength=len(W_BINS) + 1).tolist()):
        out[f"num_w_bin_{i}"] = float(count)
    if new is not None:
        new = new[loss_mask].double()[finite]
        ok = new.isfinite()
        out["num_new_tokens"] = float(ok.sum())
        out["sum_kl_behav_new"] = _k3((new - behav[finite])[ok]).sum().item()
        out["sum_kl_prox_new"] = _k3((new - prox[finite])[ok]).sum().item()
    return out


def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in SUM_FIELDS}


def movement_metrics(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Means and fractions for the step record; empty when no token was measured."""
    n = sums["num_tokens"]
    if not n:
        return {}
    out = {
        f"{prefix}kl_behav_prox": sums["sum_kl_behav_prox"] / n,
        f"{prefix}behav_w_outside_clip_frac": sums["num_w_outside_clip"] / n,
    }
    out.update(
        {
            f"{prefix}behav_w_frac/{label}": sums[f"num_w_bin_{i}"] / n
            for i, label in enumerate(bin_labels())
        }
    )
    if sums["num_new_tokens"]:
        m = sums["num_new_tokens"]
        out[f"{prefix}kl_behav_new"] = sums["sum_kl_behav_new"] / m
        out[f"{prefix}kl_prox_new"] = sums["sum_kl_prox_new"] / m
    return out
