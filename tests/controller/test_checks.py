"""What a registered worker's message must fit before it touches the ledger."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal import messages
from areal.controller import checks
from areal.controller.checks import (
    generated_problem,
    model_vocab_size,
    reward_problem,
    scored_problem,
    sender_problem,
)
from areal.controller.pool import WorkerHandle
from areal.codec import encode
from areal.messages import (
    DEFAULT_MAX_BYTES,
    LISTED_RUNS,
    Completions,
    FinishReason,
    Generated,
    GroupName,
    GroupState,
    GroupStatus,
    Heartbeat,
    MessageError,
    Register,
    Scored,
    Trained,
    WeightsChunk,
    WorkerKind,
)
from areal.tasks.base import Verdict


def _generated(ids=(1, 2, 3), logprobs=(-0.1, -0.2, -0.3), versions=(0, 1, 1), **kwargs):
    return Generated(
        request_id="g0-s0-a0",
        output_ids=np.asarray(ids, np.int32),
        logprobs=np.asarray(logprobs, np.float32),
        versions=np.asarray(versions, np.int32),
        finish_reason=FinishReason.LENGTH,
        **kwargs,
    )


def _problem(msg):
    return generated_problem(msg, max_new_tokens=8, version=2, vocab_size=100)


def test_a_consistent_completion_fits():
    assert _problem(_generated()) == "" and _problem(_generated((), (), ())) == ""


@pytest.mark.parametrize(
    "msg, reason",
    [
        (_generated(logprobs=(-0.1, -0.2)), "lengths [3, 2, 3]"),
        (_generated(ids=np.ones((3, 1))), "shape [3, 1]"),
        (
            _generated(ids=range(9), logprobs=[-1.0] * 9, versions=[0] * 9),
            "9 tokens for a request of at most 8",
        ),
        (_generated(ids=(1, 2, 100)), "outside the vocabulary [0, 100)"),
        (_generated(ids=(1, -2, 3)), "outside the vocabulary"),
        (_generated(versions=(0, 3, 3)), "token versions 0..3 outside 0..2"),
        (_generated(versions=(1, 0, 0)), "decrease"),
        (_generated(logprobs=(-0.1, 0.5, -0.3)), "log-probs must be finite and <= 0"),
        (_generated(logprobs=(-0.1, float("nan"), -0.3)), "log-probs must be finite"),
    ],
)
def test_an_inconsistent_completion_is_named(msg, reason):
    assert reason in _problem(msg)


def _episode(versions, logprobs, mask):
    return _generated(
        ids=(1, 2, 3, 4), logprobs=logprobs, versions=versions, loss_mask=np.asarray(mask, bool)
    )


def test_an_episode_with_observation_tokens_fits():
    """Observation tokens (version -1, log-prob 0) sit between sampled ones in an episode."""
    assert (
        _problem(_episode((0, -1, -1, 1), (-0.5, 0.0, 0.0, -0.2), (True, False, False, True))) == ""
    )
    assert _problem(_episode((-1,) * 4, (0.0,) * 4, (False,) * 4)) == ""


@pytest.mark.parametrize(
    "versions, logprobs, mask, reason",
    [
        ((0, 1, -1, 1), (-0.5, -0.1, 0.0, -0.2), (True, False, False, True), "observation tokens"),
        ((0, -1, -1, 1), (-0.5, -0.3, 0.0, -0.2), (True, False, False, True), "observation tokens"),
        ((0, -1, -1, 1), (-0.5, 0.0, 0.0, -0.2), (True, False, True, True), "outside 0..2"),
        ((1, -1, -1, 0), (-0.5, 0.0, 0.0, -0.2), (True, False, False, True), "decrease"),
        ((0, -1, -1, 1), (-0.5, 0.0, 0.0, -0.2), (1, 0, 0, 1), "loss_mask has shape"),
    ],
)
def test_an_inconsistent_episode_is_named(versions, logprobs, mask, reason):
    msg = _episode(versions, logprobs, (True,) * 4)
    msg.loss_mask = np.asarray(mask, np.int8 if type(mask[0]) is int else bool)
    assert reason in _problem(msg)


def test_float_token_ids_are_refused():
    msg = _generated()
    msg.output_ids = msg.output_ids.astype(np.float32)
    assert "integers" in _problem(msg)


def test_each_kind_comes_only_from_its_senders():
    rollout = WorkerHandle(worker_id="r", kind=WorkerKind.ROLLOUT)
    trainer1 = WorkerHandle(worker_id="t1", kind=WorkerKind.TRAINER, rank=1)
    trained = Trained(step=1, version=1, stats={}, rank=1)
    assert sender_problem(trained, rollout) == "Trained from a rollout worker"
    assert sender_problem(trained, trainer1) == ""
    assert "rank 0 from rank 1" in sender_problem(Trained(step=1, version=1, stats={}), trainer1)
    assert "only rank 0" in sender_problem(
        WeightsChunk(version=1, index=0, num_chunks=1, names=[], tensors=[]), trainer1
    )
    status = GroupStatus(group=GroupName.TRAINER, generation=0, state=GroupState.JOINED)
    assert "trainer-group status from a rollout" in sender_problem(status, rollout)
    assert sender_problem(Heartbeat(), None) == "Heartbeat before registering"
    assert (
        sender_problem(
            Register(kind=WorkerKind.ROLLOUT, worker_id="w", pid=1, host="h", secret=""), None
        )
        == ""
    )


def test_rewards_must_be_finite():
    assert "not a finite number" in reward_problem(float("inf"))
    assert "not a finite number" in reward_problem(float("nan"))
    assert reward_problem(0.5) == ""


def test_a_scored_pairs_one_outcome_with_each_request():
    scored = Scored(
        request_ids=["a", "b"],
        rewards=[1.0, 0.0],
        verdicts=[Verdict.OK] * 2,
        details=["", ""],
        check_s=[0.1, 0.1],
    )
    assert scored_problem(scored) == ""
    scored.rewards = [1.0]
    assert "lengths [2, 1, 2, 2, 2]" in scored_problem(scored)


def test_the_vocabulary_size_comes_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))
    assert model_vocab_size(str(tmp_path)) == 151936
    assert model_vocab_size(str(tmp_path / "missing")) is None and model_vocab_size(None) is None


_FLAWS = ["value", "value", "dtype", "length", "swap", "shape"]


@st.composite
def _completion(draw, n: int, version: int) -> dict[str, np.ndarray]:
    """A well-formed completion of n tokens with up to two flaws: one value set to a
    boundary or special number, a dtype changed, an array cut or grown, two versions
    swapped, an array given a second dimension."""
    arrays = {
        "output_ids": np.array(
            draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)), np.int32
        ),
        "logprobs": np.array(draw(st.lists(st.floats(-30, 0), min_size=n, max_size=n)), np.float32),
        "versions": np.sort(
            np.array(draw(st.lists(st.integers(0, version), min_size=n, max_size=n)), np.int32)
        ),
    }
    for flaw in draw(st.lists(st.sampled_from(_FLAWS), max_size=2)):
        name = draw(st.sampled_from(sorted(arrays)))
        array = arrays[name]
        if flaw == "value" and len(array):
            value = draw(
                st.sampled_from(
                    [
                        -1,
                        -3,
                        100,
                        version + 1,
                        1e-3,
                        2e-3,
                        float("nan"),
                        float("inf"),
                        -float("inf"),
                    ]
                )
            )
            if array.dtype.kind in "iu" and not np.isfinite(value):
                continue
            array = array.astype(np.float64 if array.dtype.kind == "f" else np.int64)
            array[draw(st.sampled_from([0, -1, draw(st.integers(0, len(array) - 1))]))] = value
            array = array.astype(
                arrays[name].dtype if array.dtype.kind == "f" or value >= 0 else np.int64
            )
        elif flaw == "dtype":
            dtype = draw(st.sampled_from(["int64", "uint16", "float16", "float64"]))
            with np.errstate(invalid="ignore", over="ignore"):
                array = np.nan_to_num(array).astype(dtype)
        elif flaw == "length":
            array = (
                array[:-1]
                if len(array) and draw(st.booleans())
                else np.resize(array, (len(array) + 1, *array.shape[1:]))
            )
        elif flaw == "swap" and len(array) > 1:
            array = array.copy()
            array[[0, -1]] = array[[-1, 0]]
        elif flaw == "shape":
            array = array.reshape(-1, 1)
        arrays[name] = array
    return arrays


@settings(max_examples=500, deadline=None)
@given(
    data=st.data(),
    n=st.integers(0, 9),
    version=st.integers(0, 3),
    vocab_size=st.sampled_from([None, 100]),
)
@pytest.mark.slow
def test_the_short_path_accepts_only_what_the_full_check_accepts(data, n, version, vocab_size):
    msg = Generated(
        request_id="g0-s0-a0",
        finish_reason=FinishReason.LENGTH,
        **data.draw(_completion(n, version)),
    )
    full = checks._generated_problem(msg, max_new_tokens=8, version=version, vocab_size=vocab_size)
    if checks._plain_completion_fits(msg, 8, version, vocab_size):
        assert full == ""
    assert generated_problem(msg, max_new_tokens=8, version=version, vocab_size=vocab_size) == full


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    version=st.integers(0, 3),
    vocab_size=st.sampled_from([None, 100]),
)
@pytest.mark.slow
@pytest.mark.parametrize("listed_runs", [LISTED_RUNS, -1], ids=["listed", "numpy"])
def test_a_whole_completions_message_passes_only_when_each_completion_would(
    data, lengths, version, vocab_size, listed_runs
):
    with pytest.MonkeyPatch.context() as patch:  # runs read as Python ints, or with numpy
        patch.setattr(checks, "LISTED_RUNS", listed_runs)
        patch.setattr(messages, "LISTED_RUNS", listed_runs)
        _passes_only_when_each_would(data, lengths, version, vocab_size)


def _passes_only_when_each_would(data, lengths, version, vocab_size) -> None:
    parts = [
        Generated(
            request_id=f"g0-s{i}-a0",
            finish_reason=FinishReason.LENGTH,
            **data.draw(_completion(n, version)),
        )
        for i, n in enumerate(lengths)
    ]
    try:
        msg = Completions.of(parts)
        completions = msg.completions()
    except ValueError:  # parts that do not fit together: refused whole before any check
        return
    each = [
        generated_problem(c, max_new_tokens=8, version=version, vocab_size=vocab_size)
        for c in completions
    ]
    fit = checks.completions_fit(msg, max_new_tokens=8, version=version, vocab_size=vocab_size)
    if fit:
        assert each == [""] * len(each)
    checks.read_completions(msg)  # what the intake does before the loop judges it
    assert (
        checks.completions_fit(msg, max_new_tokens=8, version=version, vocab_size=vocab_size) == fit
    )


@pytest.mark.parametrize("listed_runs", [LISTED_RUNS, -1], ids=["listed", "numpy"])
def test_a_completions_message_of_well_formed_completions_passes_in_one_check(
    listed_runs, monkeypatch
):
    monkeypatch.setattr(checks, "LISTED_RUNS", listed_runs)
    parts = [_generated(), _generated(), _generated()]
    msg = Completions.of(parts)
    assert checks.completions_fit(msg, max_new_tokens=8, version=2, vocab_size=100)
    # a version that drops inside a completion, not where one begins, fails it
    parts[0].versions = np.array([0, 2, 1], np.int32)
    msg = Completions.of(parts)  # runs [0, 2, 1 | 0, 1 | 0, 1]
    assert not checks.completions_fit(msg, max_new_tokens=8, version=2, vocab_size=100)
    assert [bool(_problem(c)) for c in msg.completions()] == [True, False, False]
    # the same drop where a completion begins is no drop
    parts[0].versions = np.array([0, 1, 2], np.int32)
    assert checks.completions_fit(
        Completions.of(parts), max_new_tokens=8, version=2, vocab_size=100
    )


@pytest.mark.parametrize(
    ("ids", "logprobs", "vocab_size", "fits"),
    [
        ([5, 6, 7], [-1.0, -0.5, 0.0], 100, True),
        ([5, 6, 7], [-1.0, -0.5, 0.0], None, True),
        ([5, -1, 7], [-1.0, -0.5, 0.0], None, False),  # negative, no vocabulary to compare
        ([5, -1, 7], [-1.0, -0.5, 0.0], 100, False),  # read unsigned: above the vocabulary
        ([5, 100, 7], [-1.0, -0.5, 0.0], 100, False),
        ([5, 6, 7], [-1.0, float("nan"), 0.0], 100, False),
        ([5, 6, 7], [-1.0, -float("inf"), 0.0], 100, False),
        ([5, 6, 7], [-1.0, 2e-3, 0.0], 100, False),  # above the slack
        ([5, 6, 7], [-1.0, 5e-4, 0.0], 100, True),  # within it
    ],
)
def test_the_intakes_token_bounds_decide_a_completions_as_reading_it_on_the_loop_does(
    ids, logprobs, vocab_size, fits
):
    msg = Completions.of([_generated(), _generated(ids=ids, logprobs=logprobs)])
    on_loop = checks.completions_fit(msg, max_new_tokens=8, version=2, vocab_size=vocab_size)
    checks.read_completions(msg)
    assert msg.token_bounds is not None
    assert (
        checks.completions_fit(msg, max_new_tokens=8, version=2, vocab_size=vocab_size)
        == on_loop
        == fits
    )


def test_the_intake_checks_the_parts_and_reads_bounds_only_of_a_message_whose_parts_fit():
    msg = Completions.of([_generated(), _generated()])
    checks.read_completions(msg)
    assert msg.parts_fit is True and msg.token_bounds == checks.token_bounds(msg)
    misfit = Completions.of([_generated(), _generated()])
    misfit.num_runs = [1, 5]  # more runs than the run arrays hold: never raised on the thread
    checks.read_completions(misfit)
    assert misfit.parts_fit is False and misfit.token_bounds is None
    with pytest.raises(ValueError, match="do not cut run arrays"):
        misfit.check()  # what the loop words for the refusal


def test_the_intake_reads_only_completions_with_enough_tokens_to_be_worth_handing_over():
    def completions(tokens: int) -> Completions:
        return Completions.of(  # as rollout workers send them: int32 ids, float32 log-probs
            [
                _generated(
                    ids=np.ones(tokens, np.int32),
                    logprobs=np.full(tokens, -0.1, np.float32),
                    versions=np.ones(tokens, np.int32),
                )
            ]
        )

    # told from the frames after the identity, before they are decoded
    assert checks.worth_the_intake(encode(completions(checks.INTAKE_MIN_BYTES // 8)))
    assert not checks.worth_the_intake(encode(completions(checks.INTAKE_MIN_BYTES // 16)))
    kind, header = encode(completions(1))[:2]
    at_least = [kind, header, b"x" * (checks.INTAKE_MIN_BYTES - 10), b"y" * 10]
    assert checks.worth_the_intake(at_least)
    assert not checks.worth_the_intake([kind, header, b"x" * (checks.INTAKE_MIN_BYTES - 1)])
    many = _generated(ids=[1] * 40_000, logprobs=[-0.1] * 40_000, versions=[1] * 40_000)
    assert not checks.worth_the_intake(encode(many))  # a single Generated: read on the loop
    assert not checks.worth_the_intake(encode(Heartbeat()))


def test_the_intakes_reading_decodes_a_completions_as_the_channel_does_and_reads_it():
    msg = Completions.of([_generated(), _generated()])
    read = checks.intake_reading(DEFAULT_MAX_BYTES)(encode(msg))
    assert read.request_ids == msg.request_ids
    assert np.array_equal(read.output_ids, msg.output_ids)
    assert read.parts_fit is True and read.token_bounds == checks.token_bounds(msg)
    with pytest.raises(MessageError, match="exceeds the 64-byte limit"):
        checks.intake_reading(64)(encode(msg))  # the channel's limit holds there too
    with pytest.raises(MessageError, match="only COMPLETIONS accepted"):
        checks.intake_reading(DEFAULT_MAX_BYTES)(encode(_generated()))


def test_token_bounds_are_none_where_they_cannot_be_read_and_the_message_is_then_judged_whole():
    parts = [_generated(), _generated()]
    msg = Completions.of(parts)
    msg.output_ids = msg.output_ids.astype(np.float32)  # ids that are not integers
    assert checks.token_bounds(msg) is None
    assert not checks.completions_fit(msg, max_new_tokens=8, version=2, vocab_size=100)


@pytest.mark.parametrize("name", ["output_ids", "logprobs", "versions"])
@pytest.mark.parametrize("index", [0, 1, -1])
@pytest.mark.parametrize(
    "value", [-3, -1, 0, 2, 3, 99, 100, 1e-3, 2e-3, float("nan"), float("inf"), -float("inf")]
)
def test_each_boundary_value_at_each_end_is_judged_as_the_full_check_does(name, index, value):
    """Exhaustive over single flaws, where the short path reads only the ends."""
    arrays = {
        "output_ids": np.array([5, 6, 7]),
        "logprobs": np.array([-1.0, -0.5, 0.0]),
        "versions": np.array([0, 1, 2]),
    }
    arrays[name] = arrays[name].astype(
        float if name == "logprobs" or not np.isfinite(value) else np.int64
    )
    arrays[name][index] = value
    msg = Generated(request_id="g0-s0-a0", finish_reason=FinishReason.LENGTH, **arrays)
    full = checks._generated_problem(msg, max_new_tokens=8, version=2, vocab_size=100)
    assert not (checks._plain_completion_fits(msg, 8, 2, 100) and full)
    assert generated_problem(msg, max_new_tokens=8, version=2, vocab_size=100) == full


def test_the_short_path_takes_a_well_formed_completion():
    assert checks._plain_completion_fits(_generated(), 8, 2, 100)


def _segmented(**changes):
    """An agent episode of two segments: prompts [7, 8] and [9]; outputs of 2 and 3 tokens
    (the second segment's run of sampled, observation, sampled tokens)."""
    fields = dict(
        output_ids=[1, 2, 3, 4, 5],
        logprobs=[-0.1, -0.2, -0.3, 0.0, -0.5],
        versions=[1, 2, 0, -1, 1],
        loss_mask=[True, True, True, False, True],
        prompt_ids=[7, 8, 9],
        segment_prompt_lens=[2, 1],
        segment_output_lens=[2, 3],
        segment_rewards=[0.5, 1.0],
        reward=1.0,
    )
    fields.update(changes)
    arrays = {
        "output_ids": np.int32,
        "versions": np.int32,
        "prompt_ids": np.int32,
        "logprobs": np.float32,
        "loss_mask": bool,
    }
    for name, dtype in arrays.items():
        fields[name] = np.asarray(fields[name], dtype)
    return Generated(request_id="g0-s0-a0", finish_reason=FinishReason.STOP, **fields)


def test_an_agent_episodes_segments_are_checked_one_by_one():
    # Versions drop from segment 1 to segment 2 (they ran side by side): fine.
    assert _problem(_segmented()) == ""
    # Each segment within the budget, not the episode as a whole.
    assert generated_problem(_segmented(), max_new_tokens=3, version=2, vocab_size=100) == ""


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"segment_rewards": [0.5]}, "one of each per segment"),
        ({"segment_prompt_lens": [2, 2]}, "prompt_ids holds 3"),
        ({"segment_output_lens": [2, 2]}, "per-token arrays of lengths"),
        ({"segment_rewards": [float("nan"), 1.0]}, "must be finite"),
        ({"reward": 0.0}, "the last equal to the episode's reward"),
        ({"prompt_ids": [7, 8, 900]}, "vocabulary"),
        ({"versions": [2, 1, 0, -1, 1]}, "segment 0: token versions decrease"),
        ({"loss_mask": None}, "without prompt_ids or loss_mask"),
        (
            {
                "segment_output_lens": [2, 3],
                "output_ids": [1, 2, 3, 4, 5],
                "segment_prompt_lens": [3, 0],
                "prompt_ids": [7, 8, 9],
            },
            "empty prompt",
        ),
    ],
)
def test_an_inconsistent_agent_episode_is_named(changes, reason):
    if changes.get("loss_mask", 0) is None:
        msg = _segmented()
        msg.loss_mask = None
    else:
        msg = _segmented(**changes)
    assert reason in _problem(msg)
