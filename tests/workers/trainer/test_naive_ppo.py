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
    return PackedBatch(
        token_ids=seqs.tokens,
        logprobs=behav.float(),
        versions=torch.where(seqs.loss_mask, 0, -1),
        loss_mask=seqs.loss_mask,
        cu_seqlens=seqs.cu_seqlens,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )


def test_naive_ppo_clips_around_the_behaviour_policy(tiny_model_dir):
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir}",
            "trainer.ppo.prox_logp=behav",
            "trainer.ppo.eps_clip=0.2",
        ]
    )
    batch = _batch(tiny_model_dir)
    trainer = PPOTrainer(load_model(tiny_model_dir), cfg)
    model = load_model(tiny_model_dir)
    logprobs = packed_logprobs(model, batch.token_ids, batch.cu_seqlens, temperature=1.0)
    advantages = token_advantages(
        compute_advantages(batch.rewards, batch.group_ids, cfg.trainer.advantage), batch.cu_seqlens
    )
    loss, expected = decoupled_ppo_loss(
        logprobs.float(), batch.logprobs, batch.logprobs, advantages, batch.loss_mask, eps_clip=0.2
    )
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
        torch.testing.assert_close(
            grad,
            expected_grads[name] * scale,
            atol=1e-6,
            rtol=0,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("prox_logp", ["behav", "recompute", "loglinear"])
def test_movement_is_measured_against_the_recomputed_start_for_every_objective(
    tiny_model_dir, prox_logp
):
    """trainer.measure_movement: whatever the loss anchors on, w and the KLs are measured
    against the exact starting policy (a forward before the step) and the updated one (a
    forward after it); `last_prox` is what the loss was given."""
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir}",
            f"trainer.ppo.prox_logp={prox_logp}",
            "trainer.lr=1e-2",
            "trainer.measure_movement=true",
            "trainer.num_minibatches=2",
        ]
    )
    batch = _batch(tiny_model_dir)
    trainer = PPOTrainer(load_model(tiny_model_dir), cfg)
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        start = packed_logprobs(model, batch.token_ids, batch.cu_seqlens, temperature=1.0)
    stats = trainer.step(batch, version=3)
    with torch.no_grad():
        new = packed_logprobs(trainer.model, batch.token_ids, batch.cu_seqlens, temperature=1.0)
    mask = batch.loss_mask
    log_w = (start - batch.logprobs)[mask].double()
    assert stats["kl_behav_prox"] == pytest.approx(float((log_w.expm1() - log_w).mean()), rel=1e-4)
    step_move = (new - start)[mask].double()
    assert stats["kl_prox_new"] == pytest.approx(
        float((step_move.expm1() - step_move).mean()), rel=1e-3
    )
    assert stats["kl_prox_new"] > 0 and stats["kl_behav_new"] > 0
    outside = ((log_w.exp() < 0.8) | (log_w.exp() > 1.2)).double().mean()
    assert stats["behav_w_outside_clip_frac"] == pytest.approx(float(outside))
    assert sum(v for k, v in stats.items() if k.startswith("behav_w_frac/")) == pytest.approx(1.0)
    if prox_logp == "behav":
        torch.testing.assert_close(trainer.last_prox[mask], batch.logprobs[mask])
    elif prox_logp == "recompute":
        torch.testing.assert_close(trainer.last_prox[mask], start[mask], atol=1e-5, rtol=0)
    else:  # interpolated between behav and the current policy: neither of them
        assert not torch.allclose(trainer.last_prox[mask], batch.logprobs[mask])


def test_without_the_option_only_the_recompute_objective_reports_the_weights(tiny_model_dir):
    for prox_logp, reported in (("behav", False), ("recompute", True)):
        cfg = load_config(
            overrides=[f"model.path={tiny_model_dir}", f"trainer.ppo.prox_logp={prox_logp}"]
        )
        stats = PPOTrainer(load_model(tiny_model_dir), cfg).step(_batch(tiny_model_dir), 3)
        assert ("kl_behav_prox" in stats) is reported and "kl_prox_new" not in stats
