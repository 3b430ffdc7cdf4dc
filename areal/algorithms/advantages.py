"""Rewards to advantages: shaping, group baselines, batch normalisation, token broadcast.

Role: turn the scalar reward of each sampled sequence into the advantage the decoupled PPO
loss (`areal.algorithms.loss`) multiplies per token. All functions are pure and vectorised
over a whole batch: S sequences, grouped by the prompt they were sampled from (one
advantage group per prompt, `group_ids [S]`), with N tokens in total when packed.

Contract:
- Group statistics are exact for degenerate groups: a group whose rewards are all equal
  (including a singleton group) gets advantage exactly 0.0, never NaN. This holds because
  every group is first shifted by its own minimum, so equal rewards become exact zeros
  before any sum or division (`(0.1 + 0.1 + 0.1) / 3 != 0.1` in floating point).
- Advantages of one group sum to zero (up to rounding) for every estimator.
- Inputs are never modified; outputs have the rewards' floating dtype (float32 for
  integer rewards).
- One standard deviation convention throughout: the unbiased (Bessel, n-1) one, as
  `torch.std` computes by default and TRL, verl and AReaL's group normalisation use; where
  it is undefined (a single value) the result is 0.

It does not compute per-token (GAE/value-based) advantages, does not know about trajectories
or configs beyond `AdvantageConfig`, and does not decide which sequences form a batch.
"""

from __future__ import annotations

import torch

from areal.config import AdvantageConfig

ESTIMATORS = ("grpo", "drgrpo", "rloo")
"""Group baselines understood by `group_advantages`."""


def shape_rewards(
    rewards: torch.Tensor, *, scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """[S] rewards scaled, then biased, then clipped to [-clip, clip] (no clipping if None).

    The order matters: `clip` bounds the reward the optimiser sees, after any rescaling, so
    a verifier's raw reward scale does not change what the clip means.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"shape_rewards: clip={clip!r} must be > 0 or None")
    shaped = _as_float(rewards) * scale + bias
    if clip is not None:
        shaped = shaped.clamp(-clip, clip)
    return shaped


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """[S] per-sequence advantages from [S] rewards and [S] group ids (any integers).

    - grpo:   (r - mean_g) / (std_g + eps), with the *unbiased* (Bessel, n-1) group std, as
      in TRL's GRPOTrainer, verl and AReaL (all use `torch.std`'s default). Singleton groups
      have no defined std; they get 0.
    - drgrpo: r - mean_g (Dr. GRPO: dividing by the std re-weights easy/hard prompts).
    - rloo:   r_i - mean of the other samples of the group = n/(n-1) * (r_i - mean_g);
      0 for a singleton group (there is no other sample to compare with).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {', '.join(ESTIMATORS)}")
    rewards = _as_float(rewards)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both "
            "have shape [S]"
        )
    group_index, num_groups = _dense_index(group_ids)
    centered, counts = _center_by_group(rewards, group_index, num_groups)
    if estimator == "drgrpo":
        return centered
    if estimator == "rloo":
        # n/(n-1) is computed per sequence; singletons already have centered == 0 exactly.
        factor = counts / (counts - 1).clamp(min=1)
        return centered * factor
    sq_sum = rewards.new_zeros(num_groups).index_add_(0, group_index, centered * centered)
    std = (sq_sum[group_index] / (counts - 1).clamp(min=1)).sqrt()
    # With eps=0 a degenerate group would be 0/0; its numerators are exact zeros, so any
    # non-zero denominator keeps them 0.
    denom = std + eps
    return centered / torch.where(denom > 0, denom, torch.ones_like(denom))


def normalize_batch(
    advantages: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """[S] or [N] advantages normalised to mean 0 and std 1 over the whole batch.

    Uses the unbiased std (n-1), the convention of `group_advantages` (module doc), so the
    result has sample std std/(std+eps) ~= 1. With `mask` (bool, same shape), statistics use
    the masked entries only and unmasked entries come back as 0.0 (they never enter the
    loss; a zero cannot leak an un-normalised value). Equal values, a single value or no
    masked entries give exactly 0.
    """
    advantages = _as_float(advantages)
    if mask is None:
        mask = torch.ones_like(advantages, dtype=torch.bool)
    if mask.shape != advantages.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor shaped like advantages {tuple(advantages.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    selected = advantages[mask]
    if selected.numel() == 0:
        return torch.zeros_like(advantages)
    # Shift by the minimum first so that equal values are exact zeros (see module doc).
    shifted = selected - selected.min()
    centered = shifted - shifted.mean()
    denom = (centered.square().sum() / max(centered.numel() - 1, 1)).sqrt() + eps
    out = torch.zeros_like(advantages)
    out[mask] = centered / (denom if denom > 0 else 1.0)
    return out


def compute_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, cfg: AdvantageConfig
) -> torch.Tensor:
    """[S] advantages as configured: shape rewards, group baseline, optional batch norm."""
    shaped = shape_rewards(
        rewards, scale=cfg.reward_scale, bias=cfg.reward_bias, clip=cfg.reward_clip
    )
    advantages = group_advantages(shaped, group_ids, estimator=cfg.estimator)
    if cfg.batch_norm:
        advantages = normalize_batch(advantages)
    return advantages


def token_advantages(seq_advantages: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] advantage of every token: sequence s's value repeated over its tokens.

    `cu_seqlens [S+1]` are the packed-batch offsets (`PackedBatch.cu_seqlens`). Prompt
    tokens get the value too; the loss mask, not this function, keeps them out of the loss.
    """
    if cu_seqlens.dim() != 1 or len(cu_seqlens) != len(seq_advantages) + 1:
        raise ValueError(
            f"cu_seqlens has shape {tuple(cu_seqlens.shape)}; expected [S+1] = "
            f"[{len(seq_advantages) + 1}] for {len(seq_advantages)} sequence advantages"
        )
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if int(cu_seqlens[0]) != 0 or bool((seqlens < 0).any()):
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu_seqlens.tolist()}")
    return torch.repeat_interleave(seq_advantages, seqlens, output_size=int(cu_seqlens[-1]))


def _dense_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """([S] group ids renumbered 0..G-1, G): group ids may be any, even sparse, integers."""
    unique, group_index = torch.unique(group_ids, return_inverse=True)
    return group_index, len(unique)


def _center_by_group(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([S] r - mean of r's group, [S] size of r's group), in rewards' dtype.

    Subtracts the group minimum before summing, so equal rewards give exact zeros and the
    mean is computed on small, well-conditioned numbers.
    """
    group_min = rewards.new_full((num_groups,), float("inf"))
    group_min = group_min.scatter_reduce(0, group_index, rewards, reduce="amin")
    shifted = rewards - group_min[group_index]
    sums = rewards.new_zeros(num_groups).index_add_(0, group_index, shifted)
    counts = rewards.new_zeros(num_groups).index_add_(0, group_index, torch.ones_like(rewards))
    centered = shifted - (sums / counts)[group_index]
    return centered, counts[group_index]


def _as_float(values: torch.Tensor) -> torch.Tensor:
    return values if values.is_floating_point() else values.float()
