"""The off-policy corrections of the decoupled PPO objective: behaviour weight and surrogate.

Role: for the L loss tokens of a packed batch, (1) the behaviour importance weight
w = pi_prox / pi_behav and what its bounds do, and (2) the policy surrogate g that w
multiplies; `areal.algorithms.loss` combines them as  l_t = -w_t * g_t.

1. Behaviour weight (`behav_weight`), never differentiated:

       token level      w_t = exp(log pi_prox(y_t) - log pi_behav(y_t))
       sequence level   w_t = exp(mean over the loss tokens u of t's sequence of
                                  (log pi_prox(y_u) - log pi_behav(y_u)))
                        (the geometric mean of the token weights; every token of a sequence
                        shares it)

   with optional bounds floor <= w <= cap. A weight outside them is, by `mode`:
       'mask'   the token (at sequence level: the whole sequence) contributes 0 to the loss
                but still counts in its normaliser (as in AReaL); floor and cap together are
                IcePop's two-sided mask (Ling team, "IcePop", 2025), the cap alone is masked
                importance sampling (MIS; token- or sequence-level);
       'clamp'  w is clipped into [floor, cap]: truncated importance sampling (TIS, Yao et
                al., "Your efficient RL framework secretly brings you off-policy RL
                training", 2025: w_t = min(w_t, C)).
   w == cap and w == floor are inside. A token whose two log-probs are equal (including
   both -inf) has w = 1.

2. Surrogate g_t (`surrogate`), with r_t = pi_theta(y_t) / pi_prox(y_t), the clip range
   [1 - eps_low, 1 + eps_high] (eps_high > eps_low is DAPO's clip-higher, arXiv 2503.14476)
   and advantage A_t:

       'ppo'    g_t = min(r_t A_t, clip(r_t) A_t)                          (the paper's)
       'gspo'   g_t = min(s A_t, clip(s) A_t),  s = exp(mean over t's sequence of
                log r_u): GSPO's length-normalised sequence ratio (arXiv 2507.18071); its
                gradient flows to every token of the sequence through s
       'cispo'  g_t = sg(clip(r_t)) A_t log pi_theta(y_t), written as
                sg(clip(r_t)) A_t (1 + log pi_theta - sg(log pi_theta)): value clip(r_t) A_t,
                gradient clip(r_t) A_t grad log pi_theta. CISPO (MiniMax-M1, arXiv
                2506.13585) clips the stop-gradient weight, never the token's gradient.

   `clip_active` marks the tokens the clip acts on: for 'ppo' and 'gspo' those whose clipped
   term is strictly the smaller (they get no gradient), for 'cispo' those whose weight was
   clipped (they keep a gradient, with a clipped weight).

Pure tensor code over already-selected loss tokens; sequence membership comes from
`areal.algorithms.aggregation.Segments`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from areal.algorithms.aggregation import Segments

CAP_MODES = ("mask", "clamp")
"""What happens to loss tokens whose behaviour importance weight w is outside its bounds."""
BEHAV_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("ppo", "gspo", "cispo")


@dataclass(frozen=True)
class BehavWeight:
    """The behaviour importance weight of L loss tokens and what its bounds did."""

    w: torch.Tensor
    """[L] weight at the configured level, before the bounds."""
    used: torch.Tensor
    """[L] the weight that multiplies the token's term (clipped in 'clamp' mode)."""
    keep: torch.Tensor
    """[L] bool: the token contributes to the loss (False: masked)."""
    outside: torch.Tensor
    """[L] bool: w is outside [floor, cap] (masked or clamped, by mode)."""


def log_behav_weight(prox: torch.Tensor, behav: torch.Tensor) -> torch.Tensor:
    """[L] log w = log pi_prox - log pi_behav per token; exactly 0 where the two are equal
    (so that two -inf log-probs give w = 1, not NaN)."""
    return torch.where(prox == behav, torch.zeros_like(prox), prox - behav)


def behav_weight(
    log_w: torch.Tensor,
    segments: Segments | None,
    *,
    level: str,
    floor: float | None,
    cap: float | None,
    mode: str,
) -> BehavWeight:
    """Weights of [L] loss tokens from their token-level `log_w` (see the module docstring)."""
    if level == "sequence":
        assert segments is not None, "sequence-level weights need the sequences' segments"
        seq_log_w = segments.mean(log_w)
        # +inf and -inf in one sequence: the mean is NaN. Treat it as unbounded above, so
        # that a cap masks or clamps it and it never enters the loss as NaN.
        w = torch.exp(torch.where(seq_log_w.isnan(), torch.inf, seq_log_w))
    else:
        w = torch.exp(log_w)
    outside = torch.zeros_like(w, dtype=torch.bool)
    if cap is not None:
        outside |= w > cap
    if floor is not None:
        outside |= w < floor
    if mode == "clamp":
        used = w if floor is None and cap is None else w.clamp(min=floor, max=cap)
        return BehavWeight(w=w, used=used, keep=torch.ones_like(outside), outside=outside)
    return BehavWeight(w=w, used=w, keep=~outside, outside=outside)


def surrogate(
    theta: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    keep: torch.Tensor,
    segments: Segments | None,
    *,
    kind: str,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([U] surrogate g, [U] bool clip_active) of the U kept tokens among [L] loss tokens.

    Only `theta` may carry a gradient. GSPO's sequence ratio is taken over all L loss tokens
    of each sequence (masked ones too: the ratio is the sequence's), then the kept tokens'
    copies are returned.
    """
    low, high = 1.0 - eps_low, 1.0 + eps_high
    adv = adv[keep]
    if kind == "gspo":
        assert segments is not None, "GSPO's ratio is per sequence"
        ratio = torch.exp(segments.mean(theta - prox))[keep]
    else:
        # Select before the exponential: masked tokens never reach the graph.
        theta, prox = theta[keep], prox[keep]
        ratio = torch.exp(theta - prox)
    if kind == "cispo":
        weight = ratio.detach().clamp(low, high)
        active = (ratio.detach() < low) | (ratio.detach() > high)
        return weight * adv * (1.0 + theta - theta.detach()), active
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    return torch.minimum(unclipped, clipped), clipped < unclipped


@torch.no_grad()
def clip_sides(
    theta: torch.Tensor,
    prox: torch.Tensor,
    adv: torch.Tensor,
    keep: torch.Tensor,
    clip_active: torch.Tensor,
    segments: Segments | None,
    *,
    kind: str,
    eps_low: float,
    eps_high: float,
) -> dict[str, Any]:
    """Which side of the clip range each of the U kept tokens (of [L] loss tokens) is on
    (`PPOStats`): clipped below / above, outside but unclipped, and the largest ratio.
    The ratio is the one the surrogate clips (the sequence's for 'gspo')."""
    if kind == "gspo":
        assert segments is not None, "gspo ratios are per sequence: segments needed"
        ratio = torch.exp(segments.mean(theta - prox))[keep]
    else:
        ratio = torch.exp(theta[keep] - prox[keep])
    below, above = ratio < 1.0 - eps_low, ratio > 1.0 + eps_high
    moving = adv[keep] != 0
    return {
        "num_clipped_low": int((clip_active & below).sum()),
        "num_clipped_high": int((clip_active & above).sum()),
        "num_unclipped_outside": int(((below | above) & ~clip_active & moving).sum()),
        "max_ratio": float(ratio.max()) if len(ratio) else 0.0,
    }


def check_corrections(
    *, level: str, floor: float | None, cap: float | None, mode: str, kind: str
) -> None:
    if mode not in CAP_MODES:
        raise ValueError(f"behav_cap_mode={mode!r} is not one of {', '.join(CAP_MODES)}")
    if level not in BEHAV_LEVELS:
        raise ValueError(f"behav_imp_level={level!r} is not one of {', '.join(BEHAV_LEVELS)}")
    if kind not in POLICY_LOSSES:
        raise ValueError(f"policy_loss={kind!r} is not one of {', '.join(POLICY_LOSSES)}")
    if cap is not None and not cap > 0:
        raise ValueError(f"behav_imp_cap={cap!r} must be > 0 or None")
    if floor is not None and not floor > 0:
        raise ValueError(f"behav_imp_floor={floor!r} must be > 0 or None")
    if floor is not None and cap is not None and not floor <= cap:
        raise ValueError(
            f"behav_imp_floor={floor!r} is above behav_imp_cap={cap!r}; the "
            "weights kept lie in [floor, cap]"
        )


def needs_segments(level: str, kind: str) -> bool:
    return level == "sequence" or kind == "gspo"
