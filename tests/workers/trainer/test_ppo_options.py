"""The trainer step under the sequence-level corrections and aggregations: cutting the batch
into micro-batches, or into the shards of two data-parallel ranks (areal.algorithms.sharding,
each rank dividing by the global sequence count), gives the gradient of the whole batch.

In one process: each "rank" is a trainer on the same initial weights training its shard with
the global plan; their gradients (recorded at the optimiser step, before any reduction)
must add up to the single trainer's. The real two-process reduction is tested, for the
default options, in test_data_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from trainer_batches import random_sequences, record_gradients

from areal.algorithms.advantages import compute_advantages
from areal.algorithms.sharding import shard_batch
from areal.config import load_config
from areal.models.hf import load_model
from areal.types import PackedBatch
from areal.workers.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow

LENGTHS = [7, 19, 33, 12, 26, 9, 41, 15, 5, 22, 30, 11]
NUM_PROMPT = 4
VERSION = 1
OPTIONS = {
    "gspo-seqmean-seqweight": [
        "trainer.ppo.policy_loss=gspo",
        "trainer.ppo.loss_agg_mode=seq-mean-token-mean",
        "trainer.ppo.behav_imp_level=sequence",
        "trainer.ppo.behav_imp_floor=0.9",
        "trainer.ppo.behav_imp_cap=1.1",
    ],
    "cispo-drgrpo-clamp": [
        "trainer.ppo.policy_loss=cispo",
        "trainer.ppo.loss_agg_mode=seq-mean-token-sum-norm",
        "trainer.ppo.behav_cap_mode=clamp",
        "trainer.ppo.behav_imp_cap=1.05",
        "trainer.ppo.eps_clip=0.01",
    ],
}


def _config(model_dir: str, options: list[str], micro_batch_tokens: int):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            "trainer.grad_clip=1e9",
            f"trainer.micro_batch_tokens={micro_batch_tokens}",
            "rollout.max_new_tokens=40",
            *options,
        ]
    )


def _batch(model_dir: str) -> PackedBatch:
    """Unequal sequences with behaviour log-probs near the model's own, half of the tokens
    sampled by the proximal version (fresh), one sequence without loss tokens."""
    gen = torch.Generator().manual_seed(0)
    seqs = random_sequences(model_dir, LENGTHS, NUM_PROMPT, gen)
    mask, cu, total = seqs.loss_mask.clone(), seqs.cu_seqlens, len(seqs.tokens)
    mask[cu[4] : cu[5]] = False
    seq_offset = torch.repeat_interleave(
        0.15 * torch.randn(len(LENGTHS), generator=gen), torch.tensor(LENGTHS)
    )
    behav = torch.where(
        mask, seqs.own_logprobs + seq_offset + 0.1 * torch.randn(total, generator=gen), 0.0
    )
    versions = torch.where(torch.rand(total, generator=gen) < 0.5, VERSION, VERSION - 1)
    return PackedBatch(
        token_ids=seqs.tokens,
        logprobs=behav.float(),
        versions=torch.where(mask, versions, -1),
        loss_mask=mask,
        cu_seqlens=cu,
        rewards=torch.rand(len(LENGTHS), generator=gen),
        group_ids=torch.arange(len(LENGTHS)) // 3,
    )


def _gradients(trainer: PPOTrainer, batch: PackedBatch, **plan) -> tuple[dict, dict]:
    """(gradients at the optimiser step, stats) of one step (one minibatch)."""
    recorded = record_gradients(trainer)
    stats = trainer.step(batch, VERSION, **plan)
    (grads,) = recorded
    return grads, stats


@pytest.mark.parametrize("name", list(OPTIONS))
def test_micro_batches_and_ranks_give_the_whole_batch_gradient(name, tiny_model_dir):
    options = OPTIONS[name]
    batch = _batch(tiny_model_dir)
    whole_cfg = _config(tiny_model_dir, options, micro_batch_tokens=4096)
    whole, whole_stats = _gradients(PPOTrainer(load_model(tiny_model_dir), whole_cfg), batch)
    # (r = 1 in a step's first minibatch: the clip is exercised by the loss's own tests.)
    assert whole_stats["behav_cap_frac"] > 0, whole_stats
    assert 0 < whole_stats["fresh_token_frac"] < 1, whole_stats

    micro_cfg = _config(tiny_model_dir, options, micro_batch_tokens=48)
    micro, micro_stats = _gradients(PPOTrainer(load_model(tiny_model_dir), micro_cfg), batch)
    advantages = compute_advantages(batch.rewards, batch.group_ids, whole_cfg.trainer.advantage)
    ranks = []
    for shard in shard_batch(batch, advantages, num_ranks=2, num_minibatches=1):
        assert shard.minibatch_loss_seqs == [len(LENGTHS) - 1]
        ranks.append(
            _gradients(
                PPOTrainer(load_model(tiny_model_dir), micro_cfg),
                shard.batch,
                advantages=shard.advantages,
                minibatch_sizes=shard.minibatch_sizes,
                minibatch_loss_tokens=shard.minibatch_loss_tokens,
                minibatch_loss_seqs=shard.minibatch_loss_seqs,
            )[0]
        )
    for param, ref in whole.items():
        scale = ref.abs().max() + 1e-12
        for what, got in (
            ("micro-batches", micro[param]),
            ("two ranks", ranks[0][param] + ranks[1][param]),
        ):
            diff = (got - ref).abs().max()
            assert diff <= 1e-5 * scale, f"{what}, {param}: max diff {diff:.2e} at {scale:.2e}"
    for key in (
        "loss",
        "clip_frac",
        "behav_cap_frac",
        "logprob_diff_fresh",
        "logprob_diff_stale_max",
        "behav_kl_stale",
    ):
        assert micro_stats[key] == pytest.approx(whole_stats[key], rel=1e-5, abs=1e-8), key
