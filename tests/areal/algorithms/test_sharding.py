"""Data-parallel shards: every sequence once, the single-rank minibatches, global normalisers."""

from __future__ import annotations

import pytest
import torch

from areal.algorithms.packing import partition_balanced
from areal.algorithms.sharding import plan_shards, shard_batch
from areal.types import PackedBatch


def _batch(lengths: list[int], num_prompt: int = 3) -> PackedBatch:
    total = sum(lengths)
    mask = torch.zeros(total, dtype=torch.bool)
    offset = 0
    for length in lengths:
        mask[offset + min(num_prompt, length) : offset + length] = True
        offset += length
    return PackedBatch(
        token_ids=torch.arange(total),
        logprobs=torch.zeros(total),
        versions=torch.zeros(total, dtype=torch.long),
        loss_mask=mask,
        cu_seqlens=torch.cat(
            [
                torch.zeros(1, dtype=torch.int32),
                torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            ]
        ),
        rewards=torch.arange(len(lengths), dtype=torch.float32),
        group_ids=torch.arange(len(lengths)) // 2,
    )


@pytest.mark.parametrize("num_ranks,num_minibatches", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 4)])
def test_shards_cover_the_batch_once_with_single_rank_minibatches(num_ranks, num_minibatches):
    lengths = [17, 5, 40, 9, 9, 23, 31, 4, 12, 28]
    batch = _batch(lengths)
    advantages = torch.linspace(-1, 1, len(lengths))
    shards = shard_batch(batch, advantages, num_ranks, num_minibatches)
    assert len(shards) == num_ranks
    seen = sorted(i for s in shards for i in s.seq_indices)
    assert seen == list(range(len(lengths)))
    single = [sorted(m) for m in partition_balanced(lengths, num_minibatches) if m]
    num_mb = len(shards[0].minibatch_sizes)
    assert all(len(s.minibatch_sizes) == num_mb == len(single) for s in shards)
    for m in range(num_mb):
        members = []
        for s in shards:
            start = sum(s.minibatch_sizes[:m])
            members += s.seq_indices[start : start + s.minibatch_sizes[m]]
        assert sorted(members) == single[m]
        expected_tokens = int(sum(batch.select(single[m]).loss_mask))
        assert all(s.minibatch_loss_tokens[m] == expected_tokens for s in shards)
    for s in shards:
        assert torch.equal(s.advantages, advantages[s.seq_indices])
        assert torch.equal(s.batch.token_ids, batch.select(s.seq_indices).token_ids)


def test_ranks_get_near_equal_tokens_of_every_minibatch():
    lengths = [50, 3, 47, 8, 30, 30, 12, 19, 25, 6, 41, 2]
    for rank_pieces in zip(*plan_shards(lengths, 3, 2), strict=True):  # per minibatch
        loads = [sum(lengths[i] for i in piece) for piece in rank_pieces]
        longest = max(lengths[i] for piece in rank_pieces for i in piece)
        assert max(loads) - min(loads) <= longest, loads


def test_fewer_sequences_than_ranks_leaves_empty_pieces_but_equal_minibatch_counts():
    batch = _batch([10, 20])
    shards = shard_batch(batch, torch.zeros(2), num_ranks=3, num_minibatches=1)
    assert [s.minibatch_sizes for s in shards] == [[1], [1], [0]]
    assert shards[2].batch.num_seqs == 0 and len(shards[2].batch.token_ids) == 0
    assert {s.minibatch_loss_tokens[0] for s in shards} == {int(batch.loss_mask.sum())}


def test_globally_empty_minibatches_are_dropped_everywhere():
    shards = shard_batch(_batch([10, 20]), torch.zeros(2), num_ranks=2, num_minibatches=4)
    assert [s.minibatch_sizes for s in shards] == [[1, 0], [0, 1]]


def test_advantages_must_match_the_batch():
    with pytest.raises(ValueError, match="3 advantages for 2 sequences"):
        shard_batch(_batch([10, 20]), torch.zeros(3), 2, 1)
