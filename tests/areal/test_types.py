"""Trajectories and packing: provenance arrays stay aligned through pack and select."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal import types as types_module
from areal.messages import version_runs
from areal.types import PROMPT_VERSION, Trajectory, VersionRuns, pack, pack_arrays


def _traj(num_prompt, num_out, version=0, group_id=0, reward=0.0):
    t = Trajectory.from_generation(
        prompt_id=f"p{group_id}",
        group_id=group_id,
        prompt_ids=np.arange(num_prompt) + 10,
        output_ids=np.arange(num_out) + 50,
        output_logprobs=-np.arange(num_out, dtype=np.float32),
        output_versions=np.full(num_out, version),
        finish_reason="stop",
    )
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
        prompt_id="p",
        group_id=0,
        prompt_ids=[1, 2],
        output_ids=[5, 6, 7, 8, 9],
        output_logprobs=[-1.0, 0.0, 0.0, -2.0, -3.0],
        output_versions=[3, -1, -1, 4, 4],
        output_loss_mask=[True, False, False, True, True],
    )
    assert list(t.loss_mask) == [False, False, True, False, False, True, True]
    assert t.num_model_tokens == 3 and t.oldest_version() == 3  # staleness: model tokens
    with pytest.raises(ValueError, match=r"observation tokens .* must have version -1, got \[3\]"):
        Trajectory.from_generation(
            prompt_id="p",
            group_id=0,
            prompt_ids=[1],
            output_ids=[5, 6],
            output_logprobs=[-1.0, 0.0],
            output_versions=[3, 3],
            output_loss_mask=[True, False],
        )


def test_misaligned_arrays_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory(
            prompt_id="p",
            group_id=0,
            token_ids=np.zeros(3, np.int32),
            logprobs=np.zeros(2, np.float32),
            versions=np.zeros(3, np.int32),
            loss_mask=np.zeros(3, bool),
            num_prompt_tokens=1,
        )
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


def _newest_by_definition(t: Trajectory) -> int:
    sampled = [int(v) for v in t.versions if v != PROMPT_VERSION]
    return max(sampled) if sampled else PROMPT_VERSION


@pytest.mark.parametrize("seed", range(5))
def test_oldest_and_newest_version_are_the_least_and_greatest_that_are_not_a_prompts(seed):
    """`oldest_version` and `newest_version`: their shortcuts (prompt all PROMPT_VERSION,
    completion without it) and their general paths agree with the definition, whatever the
    arrays hold: prompts with versions, completions with observation tokens or versions
    below PROMPT_VERSION, no sampled token at all."""
    rng = np.random.default_rng(seed)
    for _ in range(300):
        num_prompt, num_out = int(rng.integers(1, 6)), int(rng.integers(0, 6))
        versions = rng.integers(-3, 4, num_prompt + num_out).astype(np.int32)
        if rng.random() < 0.5:
            versions[:num_prompt] = PROMPT_VERSION
        if rng.random() < 0.3:
            versions[num_prompt:] = np.abs(versions[num_prompt:])
        n = num_prompt + num_out
        t = Trajectory(
            prompt_id="p",
            group_id=0,
            token_ids=np.zeros(n, np.int32),
            logprobs=np.zeros(n, np.float32),
            versions=versions,
            loss_mask=np.zeros(n, bool),
            num_prompt_tokens=num_prompt,
        )
        assert t.oldest_version() == _oldest_by_definition(t), versions.tolist()
        assert t.newest_version() == _newest_by_definition(t), versions.tolist()


def _both_forms(rng: np.random.Generator, episode: bool) -> tuple[Trajectory, Trajectory]:
    """The same completion built twice: from arrays of the trajectory's own dtypes (kept as
    they came) and from lists (copied into [T] arrays)."""
    num_prompt, num_out = int(rng.integers(1, 6)), int(rng.integers(0, 8))
    prompt = rng.integers(0, 100, num_prompt).astype(np.int32)
    ids = rng.integers(0, 100, num_out).astype(np.int32)
    logprobs = -rng.random(num_out).astype(np.float32)
    versions = np.sort(rng.integers(0, 4, num_out)).astype(np.int32)
    mask = None
    if episode:
        mask = rng.random(num_out) < 0.6
        versions[~mask], logprobs[~mask] = PROMPT_VERSION, 0.0
    kept, copied = (
        Trajectory.from_generation(
            prompt_id="p",
            group_id=3,
            prompt_ids=p,
            output_ids=i,
            output_logprobs=lp,
            output_versions=v,
            output_loss_mask=m,
            finish_reason="stop",
        )
        for p, i, lp, v, m in [
            (prompt, ids, logprobs, versions, mask),
            (
                prompt.tolist(),
                ids.tolist(),
                logprobs.tolist(),
                versions.tolist(),
                None if mask is None else mask.tolist(),
            ),
        ]
    )
    return kept, copied


def _runs_form(rng: np.random.Generator) -> tuple[Trajectory, Trajectory]:
    """A completion kept with its versions as runs (as the controller records the answers
    of a Completions message) and the same copied into [T] arrays."""
    num_prompt, num_out = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    prompt = rng.integers(0, 100, num_prompt).astype(np.int32)
    ids = rng.integers(0, 100, num_out).astype(np.int32)
    logprobs = -rng.random(num_out).astype(np.float32)
    versions = np.sort(rng.integers(0, 4, num_out)).astype(np.int32)
    kept = Trajectory.from_checked(
        prompt_id="p",
        group_id=3,
        prompt_ids=prompt,
        output_ids=ids,
        output_logprobs=logprobs,
        output_versions=VersionRuns(*version_runs(versions)),
        finish_reason="stop",
        oldest_version=int(versions[0]),
    )
    copied = Trajectory.from_generation(
        prompt_id="p",
        group_id=3,
        prompt_ids=prompt.tolist(),
        output_ids=ids.tolist(),
        output_logprobs=logprobs.tolist(),
        output_versions=versions.tolist(),
        finish_reason="stop",
    )
    return kept, copied


def test_a_completion_kept_with_its_version_runs_reads_as_the_copied_one():
    rng = np.random.default_rng(7)
    for _ in range(200):
        kept, copied = _runs_form(rng)
        assert kept._find_oldest() == copied.oldest_version() == _oldest_by_definition(copied)
        assert kept.num_tokens == copied.num_tokens
        for name in ("token_ids", "logprobs", "versions", "loss_mask"):
            got, expected = getattr(kept, name), getattr(copied, name)
            assert got.dtype == expected.dtype, name
            np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("episode", [False, True])
def test_a_completion_kept_as_it_came_reads_as_the_copied_one(episode):
    """`from_generation` keeps arrays of the trajectory's dtypes without a copy; every reader
    (the [T] arrays, counts, staleness, packing) sees what the copying path built."""
    rng = np.random.default_rng(int(episode))
    for _ in range(200):
        kept, copied = _both_forms(rng, episode)
        assert kept._parts is not None and copied._parts is None  # the two forms
        assert kept.num_tokens == copied.num_tokens
        assert kept.num_prompt_tokens == copied.num_prompt_tokens
        np.testing.assert_array_equal(kept.output_ids, copied.output_ids)
        assert kept.num_model_tokens == copied.num_model_tokens
        assert kept.num_loss_tokens == copied.num_loss_tokens == int(copied.loss_mask.sum())
        assert kept.oldest_version() == copied.oldest_version() == _oldest_by_definition(copied)
        assert kept.newest_version() == copied.newest_version() == _newest_by_definition(copied)
        for name in ("token_ids", "logprobs", "versions", "loss_mask"):
            got, expected = getattr(kept, name), getattr(copied, name)
            assert got.dtype == expected.dtype, name
            np.testing.assert_array_equal(got, expected, err_msg=name)


def test_a_kept_completion_shares_the_messages_arrays():
    ids = np.arange(4, dtype=np.int32)
    t = Trajectory.from_generation(
        prompt_id="p",
        group_id=0,
        prompt_ids=np.ones(2, np.int32),
        output_ids=ids,
        output_logprobs=np.zeros(4, np.float32),
        output_versions=np.zeros(4, np.int32),
    )
    assert t.output_ids is ids and t._parts is not None
    assert t.num_tokens == 6 and t._parts is not None  # nothing joined to count
    assert t.token_ids.tolist() == [1, 1, 0, 1, 2, 3] and t._parts is None  # joined once
    assert not np.shares_memory(t.token_ids, ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt_ids=np.zeros(0, np.int32)),  # no prompt
        dict(output_logprobs=np.zeros(2, np.float32)),  # misaligned
        dict(
            output_versions=np.array([1, 1, 1], np.int32),  # an observation with a version
            output_loss_mask=np.array([True, False, True]),
        ),
    ],
)
def test_a_kept_completion_is_refused_as_the_copied_one(kwargs):
    args = {
        **dict(
            prompt_id="p",
            group_id=0,
            prompt_ids=np.ones(2, np.int32),
            output_ids=np.arange(3, dtype=np.int32),
            output_logprobs=np.zeros(3, np.float32),
            output_versions=np.zeros(3, np.int32),
        ),
        **kwargs,
    }
    with pytest.raises(ValueError) as kept:
        Trajectory.from_generation(**args)
    listed = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in args.items()}
    with pytest.raises(ValueError) as copied:
        Trajectory.from_generation(**listed)
    assert str(kept.value) == str(copied.value)


def _garbage_empty(shape, dtype=float) -> np.ndarray:
    """`np.empty` as it may come: memory holding anything (0x5a bytes; bools all True)."""
    dtype, size = np.dtype(dtype), int(np.prod(shape))
    if dtype == np.bool_:
        return np.ones(shape, bool)
    return np.frombuffer(b"\x5a" * (size * dtype.itemsize), dtype).reshape(shape).copy()


@pytest.mark.parametrize("seed", range(3))
def test_pack_arrays_equals_concatenating_each_trajectorys_arrays(seed, monkeypatch):
    """Kept and copied trajectories, episodes among them, some masked out of the loss.
    The packed arrays start as garbage (they are not filled beforehand): every token of
    every field must be written."""
    monkeypatch.setattr(np, "empty", _garbage_empty)
    rng = np.random.default_rng(seed)
    trajs = [t for _ in range(12) for t in _both_forms(rng, episode=bool(rng.random() < 0.4))]
    trajs += [t for _ in range(6) for t in _runs_form(rng)]
    for t in trajs:
        t.reward = float(rng.random())
    masked = (rng.random(len(trajs)) < 0.3).tolist()
    got = pack_arrays(trajs, masked)
    expected = {
        "token_ids": np.concatenate([t.token_ids for t in trajs]),
        "logprobs": np.concatenate([t.logprobs for t in trajs]),
        "versions": np.concatenate([t.versions for t in trajs]),
        "loss_mask": np.concatenate(
            [t.loss_mask & (not m) for t, m in zip(trajs, masked, strict=True)]
        ),
        "cu_seqlens": np.cumsum([0] + [t.num_tokens for t in trajs]).astype(np.int32),
        "rewards": np.array([t.reward for t in trajs], np.float32),
        "group_ids": np.array([t.group_id for t in trajs], np.int64),
    }
    assert got.keys() == expected.keys()
    for name, array in expected.items():
        assert got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_a_received_completion_has_its_oldest_version_computed_on_arrival(monkeypatch):
    """`from_generation` finds the oldest version while the completion is fresh; asking
    later (the step record, strict staleness) reads no array again, and asking twice
    computes once."""
    versions = np.array([2, 2, 3, 5], np.int32)
    kept = Trajectory.from_generation(
        prompt_id="p",
        group_id=0,
        prompt_ids=np.array([7, 8], np.int32),
        output_ids=np.array([1, 2, 3, 4], np.int32),
        output_logprobs=np.zeros(4, np.float32),
        output_versions=versions,
    )
    built = Trajectory(
        prompt_id="p",
        group_id=0,
        token_ids=np.arange(3, dtype=np.int32),
        logprobs=np.zeros(3, np.float32),
        versions=np.array([PROMPT_VERSION, 4, 6], np.int32),
        loss_mask=np.array([False, True, True]),
        num_prompt_tokens=1,
    )
    calls = []
    real = types_module._oldest_sampled
    monkeypatch.setattr(types_module, "_oldest_sampled", lambda v: calls.append(len(v)) or real(v))
    assert kept.oldest_version() == 2 and calls == []
    assert built.oldest_version() == built.oldest_version() == 4 and len(calls) == 1
