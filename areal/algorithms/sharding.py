"""Cutting one training batch into data-parallel shards that reproduce the single-rank step.

Role: the controller holds the global batch of a step; each of R trainer ranks trains on a
share of it and the ranks sum their gradients. For the result to be *the same step* as one
rank training on the whole batch, three things must hold, and this module arranges them:

1. The same PPO minibatches. The batch is first cut into `num_minibatches` exactly as a
   single rank cuts it (`partition_balanced` over sequence lengths), and only then each
   minibatch is split across the ranks (`partition_balanced` again, so every rank gets a
   near-equal number of tokens of every minibatch). Every rank therefore takes the same
   number of optimiser steps, one per minibatch, in the same order.
2. The global normaliser. The loss of minibatch m is a sum over its tokens divided by the
   loss tokens of the *whole* minibatch m (all ranks): `Shard.minibatch_loss_tokens[m]`
   (or, for the sequence-mean aggregations, its sequences with loss tokens,
   `Shard.minibatch_loss_seqs[m]`). Summing the ranks' gradients then gives the loss of the
   global minibatch, not a mean of per-rank means.
3. Global advantages. Group baselines (GRPO and friends) and batch normalisation need every
   sequence of a group or batch, which a rank no longer sees; the caller computes the [S]
   advantages over the global batch and each shard carries its sequences' values.

A minibatch that holds no sequence at all is dropped from every shard (a single rank skips
it too). A rank's piece of a minibatch may be empty (fewer sequences than ranks): that
rank still takes part in the minibatch's gradient reduction and optimiser step.

Pure: no processes, no communication, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal.algorithms.packing import partition_balanced
from areal.types import PackedBatch


@dataclass(kw_only=True)
class Shard:
    """What one data-parallel rank trains on in one step."""

    batch: PackedBatch
    """This rank's sequences, minibatch by minibatch (ascending batch order inside each)."""
    seq_indices: list[int]
    """[S_r] index in the global batch of each sequence of `batch`."""
    advantages: torch.Tensor
    """[S_r] per-sequence advantages, computed over the global batch."""
    minibatch_sizes: list[int]
    """Sequences of each minibatch in `batch`, in order (may be 0); the same length on
    every rank."""
    minibatch_loss_tokens: list[int]
    """Loss tokens of each *global* minibatch (all ranks): the loss normaliser."""
    minibatch_loss_seqs: list[int] = field(default_factory=list)
    """Sequences with at least one loss token of each *global* minibatch: the normaliser
    of the sequence-mean loss aggregations (areal.algorithms.aggregation)."""


def plan_shards(lengths: list[int], num_ranks: int, num_minibatches: int) -> list[list[list[int]]]:
    """plan[rank][minibatch] = indices of the sequences of that rank's piece.

    Globally empty minibatches are left out, so every rank lists the same minibatches.
    """
    plan: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for minibatch in partition_balanced(lengths, num_minibatches):
        if not minibatch:
            continue
        pieces = [
            sorted(minibatch[j] for j in piece)
            for piece in partition_balanced([lengths[i] for i in minibatch], num_ranks)
        ]
        # The heaviest piece goes to the rank with the fewest tokens so far, so that the
        # step stays balanced too, not only each minibatch (ties: lower rank, lower piece).
        pieces.sort(key=lambda piece: -sum(lengths[i] for i in piece))
        ranks = sorted(range(num_ranks), key=lambda r: (loads[r], r))
        for rank, piece in zip(ranks, pieces, strict=True):
            plan[rank].append(piece)
            loads[rank] += sum(lengths[i] for i in piece)
    return plan


@dataclass(kw_only=True)
class ShardPlan:
    """Which sequences of the batch one rank trains on: `Shard` without the data."""

    seq_indices: list[int]
    minibatch_sizes: list[int]
    minibatch_loss_tokens: list[int]
    minibatch_loss_seqs: list[int]


def plan_shard_sequences(
    lengths: list[int], loss_tokens: list[int], num_ranks: int, num_minibatches: int
) -> list[ShardPlan]:
    """The R ranks' sequences (`plan_shards`) with the global per-minibatch loss tokens and
    loss sequences, from the sequences' lengths and loss tokens alone."""
    plan = plan_shards(lengths, num_ranks, num_minibatches)
    totals = [sum(loss_tokens[i] for rank in plan for i in rank[m]) for m in range(len(plan[0]))]
    seq_totals = [
        sum(loss_tokens[i] > 0 for rank in plan for i in rank[m]) for m in range(len(plan[0]))
    ]
    return [
        ShardPlan(
            seq_indices=[i for piece in pieces for i in piece],
            minibatch_sizes=[len(piece) for piece in pieces],
            minibatch_loss_tokens=list(totals),
            minibatch_loss_seqs=list(seq_totals),
        )
        for pieces in plan
    ]


def shard_batch(
    batch: PackedBatch, seq_advantages: torch.Tensor, num_ranks: int, num_minibatches: int
) -> list[Shard]:
    """The R shards of `batch` ([S] `seq_advantages` computed over all of it)."""
    if len(seq_advantages) != batch.num_seqs:
        raise ValueError(
            f"shard_batch: {len(seq_advantages)} advantages for {batch.num_seqs} sequences"
        )
    plans = plan_shard_sequences(
        batch.seqlens.tolist(), _loss_tokens_per_sequence(batch), num_ranks, num_minibatches
    )
    return [
        Shard(
            batch=batch.select(plan.seq_indices),
            seq_indices=plan.seq_indices,
            advantages=seq_advantages[plan.seq_indices].clone(),
            minibatch_sizes=plan.minibatch_sizes,
            minibatch_loss_tokens=plan.minibatch_loss_tokens,
            minibatch_loss_seqs=plan.minibatch_loss_seqs,
        )
        for plan in plans
    ]


def _loss_tokens_per_sequence(batch: PackedBatch) -> list[int]:
    per_seq = torch.zeros(batch.num_seqs, dtype=torch.long)
    per_seq.index_add_(0, batch.seq_index(), batch.loss_mask.long())
    return per_seq.tolist()
