"""From scored trajectories to the rewards, advantages and loss mask a training batch uses.

Role: the controller turns a batch of prompt groups into trainer messages; this module
decides what the optimiser sees of them, in one place, so that dynamic sampling judges a
group by exactly the advantages it would train on:

1. reward = the verifier's reward + the overlong penalty (DAPO's soft overlong punishment,
   arXiv 2503.14476 eq. 13), for a completion of |y| tokens, budget L_max =
   rollout.max_new_tokens and buffer L_cache = overlong_buffer:

       R_length(y) = 0                                  if |y| <= L_max - L_cache
                   = ((L_max - L_cache) - |y|) / L_cache   otherwise (|y| <= L_max always)

   scaled by overlong_penalty (R_length = -overlong_penalty at |y| = L_max). It lives on the
   advantage side: the reward workers and the `rollout/reward_mean` metric keep the
   verifier's reward; the penalty is added here, before reward_scale / bias / clip and the
   group baseline (`advantages.compute_advantages`). |y| counts every token after the
   prompt.
2. advantages: `advantages.compute_advantages` over the batch.
3. loss mask: with mask_truncated (DAPO's overlong filtering), a completion that stopped at
   the budget (finish reason 'length') keeps its reward in its group's baseline but none of
   its tokens is trained on.

`has_advantage_spread` is dynamic sampling's test: a group whose advantages are all exactly
zero (equal rewards after shaping; `advantages` makes them exact zeros) carries no policy
gradient and is dropped (controller/dynamic_sampling.py). It is judged before batch
normalisation, which would shift such a group by the batch mean.

Pure: no processes; trajectories in, tensors out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from areal.algorithms.advantages import compute_advantages
from areal.config import RunConfig
from areal.types import PackedBatch, Trajectory


def overlong_penalty(
    completion_lens: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """[S] float32 reward added to completions of [S] lengths (0 when `buffer` is 0)."""
    lengths = completion_lens.to(torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths)
    start = max_new_tokens - buffer
    return -penalty * ((lengths - start).clamp(min=0.0) / buffer)


def completion_lengths(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """[S] tokens after the prompt of each trajectory."""
    return torch.tensor(
        [t.num_tokens - t.num_prompt_tokens for t in trajectories], dtype=torch.long
    )


def shaped_rewards(trajectories: Sequence[Trajectory], cfg: RunConfig) -> torch.Tensor:
    """[S] the verifier's rewards plus the overlong penalty (see the module docstring)."""
    adv = cfg.trainer.advantage
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return rewards + overlong_penalty(
        completion_lengths(trajectories),
        cfg.rollout.max_new_tokens,
        adv.overlong_buffer,
        adv.overlong_penalty,
    )


def truncated(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """[S] bool: the completion stopped at the token budget."""
    return torch.tensor([t.finish_reason == "length" for t in trajectories], dtype=torch.bool)


def mask_sequences(batch: PackedBatch, masked: torch.Tensor) -> PackedBatch:
    """`batch` with loss mask 0 on every token of the [S] `masked` sequences."""
    per_token = torch.repeat_interleave(
        masked, batch.seqlens.long(), output_size=len(batch.token_ids)
    )
    return dataclasses.replace(batch, loss_mask=batch.loss_mask & ~per_token)


def training_batch(
    trajectories: Sequence[Trajectory], batch: PackedBatch, cfg: RunConfig
) -> tuple[PackedBatch, torch.Tensor]:
    """(batch with the loss mask to train on, [S] advantages) of `batch` = pack(trajectories)."""
    advantages, masked = training_targets(trajectories, cfg)
    if cfg.trainer.advantage.mask_truncated:
        batch = mask_sequences(batch, masked)
    return batch, advantages


def training_targets(
    trajectories: Sequence[Trajectory], cfg: RunConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """([S] advantages, [S] bool: sequences none of whose tokens is trained on): what
    `training_batch` decides, without a packed batch (the controller packs each rank's
    share straight from the trajectories)."""
    adv_cfg = cfg.trainer.advantage
    group_ids = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)
    advantages = compute_advantages(shaped_rewards(trajectories, cfg), group_ids, adv_cfg)
    masked = (
        truncated(trajectories)
        if adv_cfg.mask_truncated
        else torch.zeros(len(trajectories), dtype=torch.bool)
    )
    return advantages, masked


def has_advantage_spread(trajectories: Sequence[Trajectory], cfg: RunConfig) -> bool:
    """True when some sample of this prompt group gets a non-zero group advantage."""
    group_only = dataclasses.replace(cfg.trainer.advantage, batch_norm=False)
    group_ids = torch.zeros(len(trajectories), dtype=torch.long)
    advantages = compute_advantages(shaped_rewards(trajectories, cfg), group_ids, group_only)
    return bool((advantages != 0).any())


def shaping_in_force(cfg: RunConfig) -> bool:
    """Whether any shaping with step-record metrics is on (`shaping_metrics` is empty if not)."""
    adv = cfg.trainer.advantage
    return bool(adv.overlong_buffer or adv.mask_truncated)


def shaping_metrics(trajectories: Sequence[Trajectory], cfg: RunConfig) -> dict[str, float]:
    """Step-record metrics of the shaping in force (none when it is off)."""
    adv = cfg.trainer.advantage
    out: dict[str, float] = {}
    if not shaping_in_force(cfg):
        return out
    if adv.overlong_buffer:
        penalties = shaped_rewards(trajectories, cfg) - torch.tensor(
            [t.reward for t in trajectories], dtype=torch.float32
        )
        out["rollout/overlong_penalty_mean"] = float(penalties.mean())
        out["rollout/overlong_penalized_frac"] = float((penalties < 0).float().mean())
    if adv.mask_truncated:
        out["rollout/truncated_masked"] = float(truncated(trajectories).sum())
    return out
