"""One training step of the decoupled PPO objective over a packed batch (docs/design.md section 6).

    advantages (per sequence, broadcast to tokens; given when the batch is one rank's
        shard, since group baselines need the global batch)
    proximal log-probs: a no-grad forward under the weights at the start of the step
        ('recompute'), the log-linear interpolation from per-token versions ('loglinear'),
        or the behaviour log-probs themselves ('behav': naive PPO, for ablations)
    for each PPO minibatch (trainer.num_minibatches, balanced by tokens, or as planned by
    areal.algorithms.sharding for a data-parallel shard):
        for each packed micro-batch (token budget trainer.micro_batch_tokens, FFD-balanced):
            forward with grad -> loss summed over tokens / minibatch loss units -> backward
        reduce gradients over ranks (SUM), clip the gradient norm, optimiser step
    trainer.measure_movement: a no-grad forward under the updated weights (and, unless the
        proximal policy was recomputed, one under the starting weights) for the step's
        policy movement and the behaviour weights of every objective (areal.algorithms.movement)
    statistics: sums, counts and maxima, reduced over ranks once per step

Gradient accumulation normalises by the loss units of the whole minibatch (of the global
minibatch across ranks when sharded): its loss tokens, or its sequences with loss tokens
for the sequence-mean aggregations (trainer.ppo.loss_agg_mode), so the result is the
loss of the whole minibatch however the batch is cut into micro-batches and ranks. The
loss also reports the drift between the engine's and the trainer's log-probs, split by
whether the proximal policy's own version sampled the token (areal.algorithms.drift).
`last_prox` keeps the [N] proximal log-probs the loss used in the last step (what an
audit saves, workers/trainer/audit.py). Pure torch plus the collectives of `DataParallel`
(no-ops for one rank): no sockets, no files.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from areal.algorithms import movement
from areal.algorithms.advantages import compute_advantages, token_advantages
from areal.algorithms.drift import active_corrections
from areal.algorithms.loss import (
    PPOStats,
    correction_loss_options,
    decoupled_ppo_loss,
    ppo_loss_options,
)
from areal.algorithms.packing import allocate_micro_batches, partition_balanced
from areal.algorithms.proximal import loglinear_prox_logprobs
from areal.config import RunConfig
from areal.models.logprobs import packed_logprobs, packed_logprobs_and_entropy
from areal.models.lora import add_adapters, has_adapters
from areal.types import PackedBatch
from areal.workers.trainer.distributed import DataParallel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_EXTRA_SUMS = ("entropy_sum", "num_entropy_tokens", "advantage_abs_sum", "num_seqs", "num_tokens")
_EXTRA_MAXES = ("recompute_s", "step_s")
_MOVEMENT_SUMS = tuple(f"movement_{k}" for k in movement.SUM_FIELDS)


class PPOTrainer:
    def __init__(
        self, model: PreTrainedModel, cfg: RunConfig, dp: DataParallel | None = None
    ) -> None:
        """With `trainer.lora.rank > 0` LoRA adapters are added to `model` (in place, the
        same initial adapters on every rank: seeded by `cfg.seed`), the base is frozen and
        the optimiser holds the adapters alone."""
        self.dp = dp or DataParallel.single()
        if cfg.trainer.lora.enabled and not has_adapters(model):
            add_adapters(model, cfg.trainer.lora, seed=cfg.seed)
        self.model = self.dp.wrap(model)  # FSDP2 shards in place, before the optimiser
        self.cfg = cfg.trainer
        self.temperature = cfg.rollout.temperature
        self.max_new_tokens = cfg.rollout.max_new_tokens
        self.device = next(model.parameters()).device
        # FSDP2 unshards the root's parameters (the embedding, a tied head) in hooks on the
        # root's forward, which the chunked-head path of packed_logprobs bypasses.
        self._chunk_head = False if self.dp.fsdp else None
        beta1, beta2 = self.cfg.adam_betas
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.cfg.lr, betas=(beta1, beta2), weight_decay=self.cfg.weight_decay
        )
        self.last_prox: torch.Tensor | None = None
        """[N] log pi_prox the loss used in the last step, per token of its batch (what
        'behav' and 'loglinear' use too; 0 outside the loss mask is not guaranteed)."""

    def _micro_batches(self, batch: PackedBatch) -> list[list[int]]:
        return allocate_micro_batches(batch.seqlens.tolist(), self.cfg.micro_batch_tokens)

    @torch.no_grad()
    def recompute_logprobs(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """([N] log-probs, [N] entropy) of the batch under the current weights, no grad."""
        logprobs = torch.zeros(len(batch.token_ids))
        entropy = torch.zeros(len(batch.token_ids))
        self.model.eval()
        micro_batches = self._micro_batches(batch)
        for seqs in micro_batches:
            index = batch.token_index(seqs)
            mb = batch.select(seqs)
            lp, ent = packed_logprobs_and_entropy(
                self.model,
                mb.token_ids.to(self.device),
                mb.cu_seqlens.to(self.device),
                temperature=self.temperature,
                chunk_head=self._chunk_head,
            )
            logprobs[index], entropy[index] = lp.float().cpu(), ent.float().cpu()
        self._pad_passes(len(micro_batches), backward=False)
        return logprobs, entropy

    def step(
        self,
        batch: PackedBatch,
        version: int,
        *,
        advantages: torch.Tensor | None = None,
        minibatch_sizes: list[int] | None = None,
        minibatch_loss_tokens: list[int] | None = None,
        minibatch_loss_seqs: list[int] | None = None,
    ) -> dict[str, float]:
        """Train on `batch` (policy version `version` = i); the result is version i + 1.

        A data-parallel shard passes its [S] global `advantages` and the minibatch plan
        (`minibatch_sizes`, and the global `minibatch_loss_tokens` and `minibatch_loss_seqs`
        as normalisers); without them the batch is the whole global batch and is cut here.
        """
        start = time.perf_counter()
        seq_adv = (
            advantages
            if advantages is not None
            else compute_advantages(batch.rewards, batch.group_ids, self.cfg.advantage)
        )
        token_adv = token_advantages(seq_adv, batch.cu_seqlens)
        extra = dict.fromkeys(_EXTRA_SUMS + _MOVEMENT_SUMS, 0.0) | dict.fromkeys(_EXTRA_MAXES, 0.0)
        extra.update(
            advantage_abs_sum=float(seq_adv.abs().sum()),
            num_seqs=batch.num_seqs,
            num_tokens=len(batch.token_ids),
        )
        prox = start_logprobs = None
        if self.cfg.ppo.prox_logp == "recompute":
            prox, entropy = self.recompute_logprobs(batch)
            extra.update(self._entropy_sums(batch, entropy))
            start_logprobs = prox
        elif self.cfg.measure_movement:
            start_logprobs, _ = self.recompute_logprobs(batch)
        extra["recompute_s"] = time.perf_counter() - start
        self.model.train()
        ppo_stats, grad_norms = [], []
        prox_used = torch.zeros(len(batch.token_ids))
        plan = self._minibatches(batch, minibatch_sizes, minibatch_loss_tokens, minibatch_loss_seqs)
        for seqs, normalizer in plan:
            index = batch.token_index(seqs)
            mb_prox = prox[index] if prox is not None else None
            mb_stats, grad_norm, prox_used[index] = self._minibatch_update(
                batch.select(seqs), token_adv[index], mb_prox, version, normalizer
            )
            ppo_stats.append(mb_stats)
            grad_norms.append(grad_norm)
        self.model.eval()
        self.last_prox = prox_used
        if start_logprobs is not None:
            new = self.recompute_logprobs(batch)[0] if self.cfg.measure_movement else None
            ppo = self.cfg.ppo
            sums = movement.movement_sums(
                batch.logprobs,
                start_logprobs,
                new,
                batch.loss_mask,
                eps_low=ppo.eps_clip,
                eps_high=ppo.eps_clip if ppo.eps_clip_high is None else ppo.eps_clip_high,
            )
            extra.update({f"movement_{k}": v for k, v in sums.items()})
        extra["step_s"] = time.perf_counter() - start
        return self._reduced_stats(PPOStats.reduce(ppo_stats), extra, grad_norms)

    def _minibatches(
        self,
        batch: PackedBatch,
        sizes: list[int] | None,
        loss_tokens: list[int] | None,
        loss_seqs: list[int] | None,
    ) -> list[tuple[list[int], int]]:
        """(sequence indices, loss normaliser) of each minibatch, in order. The normaliser
        counts the minibatch's loss tokens, or for the sequence-mean aggregations its
        sequences with loss tokens (areal.algorithms.aggregation)."""
        per_sequence = self.cfg.ppo.loss_agg_mode != "token-mean"
        if sizes is None:
            parts = [
                s for s in partition_balanced(batch.seqlens.tolist(), self.cfg.num_minibatches) if s
            ]
            return [(s, max(_loss_units(batch, s, per_sequence), 1)) for s in parts]
        units = loss_seqs if per_sequence else loss_tokens
        if sum(sizes) != batch.num_seqs or units is None or len(units) != len(sizes):
            raise ValueError(
                f"minibatch plan {sizes} / {units} does not fit a shard of "
                f"{batch.num_seqs} sequences"
            )
        out, offset = [], 0
        for size, count in zip(sizes, units, strict=True):
            out.append((list(range(offset, offset + size)), max(int(count), 1)))
            offset += size
        return out

    def _minibatch_update(
        self,
        batch: PackedBatch,
        advantages: torch.Tensor,
        prox: torch.Tensor | None,
        version: int,
        normalizer: int,
    ) -> tuple[PPOStats, float, torch.Tensor]:
        """One optimiser step on a minibatch: (its stats, the gradient norm before clipping,
        the [N_mb] proximal log-probs its loss used)."""
        paper_options = ppo_loss_options(self.cfg.ppo)
        correction_options = correction_loss_options(self.cfg.ppo, self.max_new_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        pieces = []
        prox_used = torch.zeros(len(batch.token_ids))
        micro_batches = self._micro_batches(batch)
        for seqs in micro_batches:
            index = batch.token_index(seqs)
            mb = batch.select(seqs)
            logprobs = (
                packed_logprobs(
                    self.model,
                    mb.token_ids.to(self.device),
                    mb.cu_seqlens.to(self.device),
                    temperature=self.temperature,
                    chunk_head=self._chunk_head,
                )
                .float()
                .cpu()
            )
            behav = mb.logprobs
            if prox is not None:
                mb_prox = prox[index]
            elif self.cfg.ppo.prox_logp == "behav":  # naive PPO: clip around pi_behav, w = 1
                mb_prox = behav
            else:
                mb_prox = loglinear_prox_logprobs(
                    behav, logprobs.detach(), mb.versions, version + 1
                )
            prox_used[index] = mb_prox.detach().float()
            loss, piece = decoupled_ppo_loss(
                logprobs,
                mb_prox,
                behav,
                advantages[index],
                mb.loss_mask,
                loss_normalizer=normalizer,
                cu_seqlens=mb.cu_seqlens,
                fresh=mb.versions == version,
                **paper_options,
                **correction_options,
            )
            (loss * self.dp.loss_scale).backward()
            pieces.append(piece)
        self._pad_passes(len(micro_batches), backward=True)
        self.dp.reduce_gradients(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return PPOStats.reduce(pieces), float(grad_norm), prox_used

    def _pad_passes(self, num_passes: int, backward: bool) -> None:
        """Zero-weight passes over one token pair, so that an FSDP rank with less data runs
        as many forward/backward collectives as the others (none otherwise)."""
        for _ in range(self.dp.sync_num_passes(num_passes) - num_passes):
            self._dummy_pass(backward)

    def _dummy_pass(self, backward: bool) -> None:
        tokens = torch.zeros(2, dtype=torch.long, device=self.device)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=self.device)
        with torch.set_grad_enabled(backward):
            out = packed_logprobs(
                self.model, tokens, cu, temperature=self.temperature, chunk_head=self._chunk_head
            )
            if backward:
                (out.float().sum() * 0.0).backward()

    @staticmethod
    def _entropy_sums(batch: PackedBatch, entropy: torch.Tensor) -> dict[str, float]:
        """Sums behind the policy-entropy monitor on loss tokens. (How far the trainer's
        log-probs are from the engine's, on tokens sampled by these very weights and on
        older ones, is the loss's drift decomposition: areal.algorithms.drift.)"""
        mask = batch.loss_mask
        return {
            "entropy_sum": float(entropy[mask].double().sum()),
            "num_entropy_tokens": int(mask.sum()),
        }

    def _reduced_stats(
        self, ppo: PPOStats, extra: dict[str, float], grad_norms: list[float]
    ) -> dict[str, float]:
        """Metrics of the global step: every sum and maximum reduced over the ranks."""
        ppo_sums, ppo_maxes = ppo.to_tensors()
        extra_sums = _EXTRA_SUMS + _MOVEMENT_SUMS
        sums = torch.cat(
            [ppo_sums, torch.tensor([float(extra[k]) for k in extra_sums], dtype=torch.float64)]
        )
        maxes = torch.cat(
            [ppo_maxes, torch.tensor([float(extra[k]) for k in _EXTRA_MAXES], dtype=torch.float64)]
        )
        sums, maxes = self.dp.sum_and_max(sums, maxes)
        num_ppo_sums, num_ppo_maxes = len(ppo_sums), len(ppo_maxes)
        total = dict(zip(extra_sums, sums[num_ppo_sums:].tolist(), strict=True))
        total.update(zip(_EXTRA_MAXES, maxes[num_ppo_maxes:].tolist(), strict=True))
        ppo_cfg = self.cfg.ppo
        active = active_corrections(
            cap=ppo_cfg.behav_imp_cap, floor=ppo_cfg.behav_imp_floor, mode=ppo_cfg.behav_cap_mode
        )
        stats = PPOStats.from_tensors(sums[:num_ppo_sums], maxes[:num_ppo_maxes]).metrics(
            "", corrections=active
        )
        stats.update(
            {
                "grad_norm": max(grad_norms, default=0.0),
                "advantage_abs_mean": total["advantage_abs_sum"] / max(total["num_seqs"], 1),
                "num_seqs": total["num_seqs"],
                "num_tokens": total["num_tokens"],
                "recompute_s": total["recompute_s"],
                "step_s": total["step_s"],
                "num_ranks": float(self.dp.world_size),
            }
        )
        stats.update(
            movement.movement_metrics({k: total[f"movement_{k}"] for k in movement.SUM_FIELDS})
        )
        if total["num_entropy_tokens"] > 0:
            stats["entropy"] = total["entropy_sum"] / total["num_entropy_tokens"]
        return stats


def _loss_units(batch: PackedBatch, seqs: list[int], per_sequence: bool) -> int:
    """Loss tokens of the sequences `seqs` of `batch`, or (per_sequence) how many of them
    have any."""
    counts = torch.zeros(batch.num_seqs, dtype=torch.long).index_add_(
        0, batch.seq_index(), batch.loss_mask.long()
    )[seqs]
    return int((counts > 0).sum()) if per_sequence else int(counts.sum())
