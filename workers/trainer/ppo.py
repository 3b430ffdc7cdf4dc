"""One training step of the decoupled PPO objective over a packed batch (DESIGN.md section 6).

    advantages (per sequence, broadcast to tokens)
    proximal log-probs: a no-grad forward under the weights at the start of the step
        ('recompute'), or the log-linear interpolation from per-token versions ('loglinear')
    for each PPO minibatch (trainer.num_minibatches, balanced by tokens):
        for each packed micro-batch (token budget trainer.micro_batch_tokens, FFD-balanced):
            forward with grad -> loss summed over tokens / minibatch loss tokens -> backward
        clip the gradient norm, optimiser step

Gradient accumulation normalises by the loss tokens of the whole minibatch, so the result
is the token-level mean however the batch is cut. Pure torch: no sockets, no files.
"""

from __future__ import annotations

import time

import torch

from areal.algorithms.advantages import compute_advantages, token_advantages
from areal.algorithms.loss import PPOStats, decoupled_ppo_loss, ppo_loss_options
from areal.algorithms.packing import allocate_micro_batches, partition_balanced
from areal.algorithms.proximal import loglinear_prox_logprobs
from areal.config import RunConfig
from areal.models.logprobs import packed_logprobs, packed_logprobs_and_entropy
from areal.types import PackedBatch


class PPOTrainer:
    def __init__(self, model: torch.nn.Module, cfg: RunConfig) -> None:
        self.model = model
        self.cfg = cfg.trainer
        self.temperature = cfg.rollout.temperature
        self.device = next(model.parameters()).device
        beta1, beta2 = self.cfg.adam_betas
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=self.cfg.lr,
                                           betas=(beta1, beta2),
                                           weight_decay=self.cfg.weight_decay)

    def _micro_batches(self, batch: PackedBatch) -> list[list[int]]:
        return allocate_micro_batches(batch.seqlens.tolist(), self.cfg.micro_batch_tokens)

    @torch.no_grad()
    def recompute_logprobs(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """([N] log-probs, [N] entropy) of the batch under the current weights, no grad."""
        logprobs = torch.zeros(len(batch.token_ids))
        entropy = torch.zeros(len(batch.token_ids))
        self.model.eval()
        for seqs in self._micro_batches(batch):
            index = batch.token_index(seqs)
            mb = batch.select(seqs)
            lp, ent = packed_logprobs_and_entropy(
                self.model, mb.token_ids.to(self.device), mb.cu_seqlens.to(self.device),
                temperature=self.temperature)
            logprobs[index], entropy[index] = lp.float().cpu(), ent.float().cpu()
        return logprobs, entropy

    def step(self, batch: PackedBatch, version: int) -> dict[str, float]:
        """Train on `batch` (policy version `version` = i); the result is version i + 1."""
        start = time.perf_counter()
        seq_adv = compute_advantages(batch.rewards, batch.group_ids, self.cfg.advantage)
        advantages = token_advantages(seq_adv, batch.cu_seqlens)
        stats: dict[str, float] = {}
        prox = None
        if self.cfg.ppo.prox_logp == "recompute":
            prox, entropy = self.recompute_logprobs(batch)
            stats.update(self._parity_stats(batch, prox, entropy, version))
        forward_s = time.perf_counter() - start
        self.model.train()
        ppo_stats, grad_norms = [], []
        for seqs in partition_balanced(batch.seqlens.tolist(), self.cfg.num_minibatches):
            if not seqs:
                continue
            index = batch.token_index(seqs)
            minibatch = batch.select(seqs)
            mb_prox = prox[index] if prox is not None else None
            mb_stats, grad_norm = self._minibatch_update(minibatch, advantages[index], mb_prox,
                                                         version)
            ppo_stats.append(mb_stats)
            grad_norms.append(grad_norm)
        self.model.eval()
        stats.update(PPOStats.reduce(ppo_stats).metrics("train/"))
        stats.update({
            "train/grad_norm": max(grad_norms),
            "train/advantage_abs_mean": float(seq_adv.abs().mean()),
            "train/num_seqs": float(batch.num_seqs),
            "train/num_tokens": float(len(batch.token_ids)),
            "train/recompute_s": forward_s,
            "train/step_s": time.perf_counter() - start,
        })
        return {k.removeprefix("train/"): v for k, v in stats.items()}

    def _minibatch_update(self, batch: PackedBatch, advantages: torch.Tensor,
                          prox: torch.Tensor | None, version: int) -> tuple[PPOStats, float]:
        normalizer = max(int(batch.loss_mask.sum()), 1)
        options = ppo_loss_options(self.cfg.ppo)
        self.optimizer.zero_grad(set_to_none=True)
        pieces = []
        for seqs in self._micro_batches(batch):
            index = batch.token_index(seqs)
            mb = batch.select(seqs)
            logprobs = packed_logprobs(self.model, mb.token_ids.to(self.device),
                                       mb.cu_seqlens.to(self.device),
                                       temperature=self.temperature).float().cpu()
            behav = mb.logprobs
            if prox is None:
                mb_prox = loglinear_prox_logprobs(behav, logprobs.detach(), mb.versions, version + 1)
            else:
                mb_prox = prox[index]
            loss, piece = decoupled_ppo_loss(logprobs, mb_prox, behav, advantages[index],
                                             mb.loss_mask, loss_normalizer=normalizer, **options)
            loss.backward()
            pieces.append(piece)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return PPOStats.reduce(pieces), float(grad_norm)

    @staticmethod
    def _parity_stats(batch: PackedBatch, prox: torch.Tensor, entropy: torch.Tensor,
                      version: int) -> dict[str, float]:
        """How far the trainer's log-probs are from the engine's on tokens sampled by these
        very weights (should be ~0: a large value means the engines disagree), and the
        policy entropy on loss tokens."""
        mask = batch.loss_mask
        fresh = mask & (batch.versions == version)
        out = {"train/entropy": float(entropy[mask].mean()) if mask.any() else 0.0}
        if fresh.any():
            out["train/logprob_diff_fresh"] = float((prox[fresh] - batch.logprobs[fresh]).abs().mean())
        return out
