"""Trajectories and packing: provenance arrays stay aligned through pack and select."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal.types import PROMPT_VERSION, Trajectory, pack


def _traj(num_prompt, num_out, version=0, group_id=0, reward=0.0):
    t = Trajectory.from_generation(
        prompt_id=f"p{group_id}", group_id=group_id, prompt_ids=np.arange(num_prompt) + 10,
        output_ids=np.arange(num_out) + 50, output_logprobs=-np.arange(num_out, dtype=np.float32),
        output_versions=np.full(num_out, version), finish_reason="stop")
    t.reward = reward
    return t


def test_from_generation_marks_prompt_tokens():
    t = _traj(3, 2, version=4)
    assert t.num_tokens == 5 and list(t.output_ids) == [50, 51]
    assert list(t.versions) == [PROMPT_VERSION] * 3 + [4, 4]
    assert list(t.loss_mask) == [False, False, False, True, True]
    assert list(t.logprobs) == [0, 0, 0, 0, -1]
    assert t.oldest_version() == 4


def test_an_episode_keeps_its_observation_tokens_out_of_the_loss():
    t = Trajectory.from_generation(
        prompt_id="p", group_id=0, prompt_ids=[1, 2], output_ids=[5, 6, 7, 8, 9],
        output_logprobs=[-1.0, 0.0, 0.0, -2.0, -3.0], output_versions=[3, -1, -1, 4, 4],
        output_loss_mask=[True, False, False, True, True])
    assert list(t.loss_mask) == [False, False, True, False, False, True, True]
    assert t.num_model_tokens == 3 and t.oldest_version() == 3  # staleness: model tokens
    with pytest.raises(ValueError, match=r"observation tokens .* must have version -1, got \[3\]"):
        Trajectory.from_generation(
            prompt_id="p", group_id=0, prompt_ids=[1], output_ids=[5, 6],
            output_logprobs=[-1.0, 0.0], output_versions=[3, 3], output_loss_mask=[True, False])


def test_misaligned_arrays_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory(prompt_id="p", group_id=0, token_ids=np.zeros(3, np.int32),
                   logprobs=np.zeros(2, np.float32), versions=np.zeros(3, np.int32),
                   loss_mask=np.zeros(3, bool), num_prompt_tokens=1)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        _traj(0, 3)


def test_pack_concatenates_and_select_recovers_sequences():
    trajs = [_traj(3, 2, 0, 0, 1.0), _traj(1, 4, 1, 0, 0.0), _traj(2, 1, 2, 7, 0.5)]
    batch = pack(trajs)
    assert batch.cu_seqlens.tolist() == [0, 5, 10, 13]
    assert batch.num_seqs == 3 and batch.seqlens.tolist() == [5, 5, 3]
    assert batch.position_ids().tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.seq_index().tolist() == [0] * 5 + [1] * 5 + [2] * 3
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5] and batch.group_ids.tolist() == [0, 0, 7]
    sub = batch.select([2, 0])
    assert sub.cu_seqlens.tolist() == [0, 3, 8]
    assert torch.equal(sub.token_ids, torch.cat([batch.token_ids[10:13], batch.token_ids[0:5]]))
    assert torch.equal(sub.versions, torch.cat([batch.versions[10:13], batch.versions[0:5]]))
    assert sub.rewards.tolist() == [0.5, 1.0]


def test_pack_refuses_empty_batches():
    with pytest.raises(ValueError, match="empty"):
        pack([])


def _oldest_by_definition(t: Trajectory) -> int:
    sampled = [int(v) for v in t.versions if v != PROMPT_VERSION]
    return min(sampled) if sampled else PROMPT_VERSION


@pytest.mark.parametrize("seed", range(5))
def test_oldest_version_is_the_least_version_that_is_not_a_prompts(seed):
    """Its shortcut (prompt all PROMPT_VERSION, completion without it) and the general path
    agree with the definition, whatever the arrays hold: prompts with versions, completions
    with observation tokens or versions below PROMPT_VERSION, no sampled token at all."""
    rng = np.random.default_rng(seed)
    for _ in range(300):
        num_prompt, num_out = int(rng.integers(1, 6)), int(rng.integers(0, 6))
        versions = rng.integers(-3, 4, num_prompt + num_out).astype(np.int32)
        if rng.random() < 0.5:
            versions[:num_prompt] = PROMPT_VERSION
        if rng.random() < 0.3:
            versions[num_prompt:] = np.abs(versions[num_prompt:])
        n = num_prompt + num_out
        t = Trajectory(prompt_id="p", group_id=0, token_ids=np.zeros(n, np.int32),
                       logprobs=np.zeros(n, np.float32), versions=versions,
                       loss_mask=np.zeros(n, bool), num_prompt_tokens=num_prompt)
        assert t.oldest_version() == _oldest_by_definition(t), versions.tolist()

