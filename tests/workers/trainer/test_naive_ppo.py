"""trainer.ppo.prox_logp=behav, naive PPO: the behaviour log-probs anchor the clip (w = 1),
whatever the trainer's own weights say. Checked against the loss computed by hand."""

from __future__ import annotations

import pytest
import torch

from trainer_batches import random_sequences, record_gradients

from areal.algorithms.advantages import compute_advantages, token_advantages
from areal.algorithms.loss import decoupled_ppo_loss
from areal.config import load_config
from areal.models.hf import load_model
from areal.models.logprobs import packed_logprobs
from areal.types import PackedBatch
from areal.workers.trainer.ppo import PPOTrainer

LENGTHS = [9, 14, 6, 11]
NUM_PROMPT = 3


def _batch(model_dir: str) -> PackedBatch:
    """Behaviour log-probs far from the model's own (w = pi_prox/pi_behav far from 1)."""
    gen = torch.Generator().manual_seed(0)
    seqs = random_sequences(model_dir, LENGTHS, NUM_PROMPT, gen)
    noise = 0.5 * torch.randn(len(seqs.tokens), generator=gen)
    behav = torch.where(seqs.loss_mask, seqs.own_logprobs + noise, 0.0)
    return PackedBatch(token_ids=seqs.tokens, logprobs=behav.float(),
                       versions=torch.where(seqs.loss_mask, 0, -1), loss_mask=seqs.loss_mask,
                       cu_seqlens=seqs.cu_seqlens, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
                       group_ids=torch.tensor([0, 0, 1, 1]))


def test_naive_ppo_clips_around_the_behaviour_policy(tiny_model_dir):
    cfg = load_config(overrides=[f"model.path={tiny_model_dir}", "trainer.ppo.prox_logp=behav",
                                 "trainer.ppo.eps_clip=0.2"])
    batch = _batch(tiny_model_dir)
    trainer = PPOTrainer(load_model(tiny_model_dir), cfg)
    model = load_model(tiny_model_dir)
    logprobs = packed_logprobs(model, batch.token_ids, batch.cu_seqlens, temperature=1.0)
    advantages = token_advantages(compute_advantages(batch.rewards, batch.group_ids,
                                                     cfg.trainer.advantage), batch.cu_seqlens)
    loss, expected = decoupled_ppo_loss(logprobs.float(), batch.logprobs, batch.logprobs,
                                        advantages, batch.loss_mask, eps_clip=0.2)
    loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    recorded = record_gradients(trainer)
    stats = trainer.step(batch, version=3)
    (grads,) = recorded
    assert stats["behav_w_mean"] == 1.0 and stats["behav_w_max"] == 1.0, stats
    assert stats["clip_frac"] == pytest.approx(expected.num_clipped / expected.num_used_tokens)
    assert expected.num_clipped > 0, "behaviour log-probs should be far enough to clip"
    assert "logprob_diff_fresh" not in stats  # no recompute pass
    # The trainer clips the gradient norm before the optimiser step (torch's formula).
    norm = torch.stack([g.norm() for g in expected_grads.values()]).norm()
    scale = min(1.0, cfg.trainer.grad_clip / (float(norm) + 1e-6))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name] * scale, atol=1e-6, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
