"""Wire format: every schema round-trips; malformed input is refused without executing it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pickle

import msgpack
import numpy as np
import pytest
import torch

from areal.codec import decode, encode
from areal import messages
from areal.messages import (
    Completions,
    BroadcastWeights,
    Cancel,
    EpisodeEnd,
    FinishReason,
    Generate,
    Generated,
    GroupName,
    GroupState,
    GroupStatus,
    Heartbeat,
    JoinGroup,
    MessageError,
    MsgType,
    Ready,
    Register,
    Score,
    Scored,
    Shutdown,
    Train,
    Trained,
    UpdateWeights,
    Welcome,
    WeightsChunk,
    WeightsUpdated,
    WorkerError,
    WorkerKind,
    schemas,
    version_runs,
)
from areal.tasks.base import Verdict


def _arange(n, dtype=np.int32):
    return np.arange(n, dtype=dtype)


SAMPLES = {
    MsgType.REGISTER: Register(
        kind=WorkerKind.TRAINER, worker_id="t0", pid=12, host="h", secret="s", rank=1
    ),
    MsgType.WELCOME: Welcome(
        config={"a": {"b": [1, 2.5, None, "x"]}},
        version=3,
        weights_path="/w",
        run_dir="/r",
        checkpoint="/r/checkpoints/x",
    ),
    MsgType.HEARTBEAT: Heartbeat(),
    MsgType.GENERATE: Generate(
        request_ids=["r1", "r2"],
        prompt_ids=_arange(7),
        max_new_tokens=9,
        temperature=0.7,
        top_p=0.9,
        stop_token_ids=[1, 2],
        seeds=[5, 2**63 - 1],
    ),
    MsgType.COMPLETIONS: Completions(
        request_ids=["r1", "r2"],
        lengths=[3, 0],
        output_ids=_arange(3),
        logprobs=np.linspace(-1, 0, 3, dtype=np.float32),
        num_runs=[2, 0],
        run_versions=np.array([0, 1], np.int32),
        run_lengths=np.array([2, 1], np.int32),
        finish_reasons=[FinishReason.STOP, FinishReason.LENGTH],
        num_interruptions=[1, 0],
        generation_s=[0.25, 0.5],
    ),
    MsgType.GENERATED: Generated(
        request_id="r1",
        output_ids=_arange(3),
        logprobs=np.linspace(-1, 0, 3, dtype=np.float32),
        versions=np.array([0, 0, 1], np.int32),
        finish_reason=FinishReason.STOP,
        num_interruptions=1,
        generation_s=0.25,
    ),
    MsgType.CANCEL: Cancel(request_ids=["a", "b"]),
    MsgType.UPDATE_WEIGHTS: UpdateWeights(
        version=2,
        mode="collective",
        num_chunks=3,
        interrupt=False,
        generation=5,
        manifest=[{"num_bytes": 32, "tensors": [["w", "bfloat16", [4, 2], 0, 16]]}],
    ),
    MsgType.WEIGHTS_CHUNK: WeightsChunk(
        version=2,
        index=0,
        num_chunks=1,
        names=["w", "b"],
        tensors=[torch.randn(4, 3).bfloat16(), torch.tensor(2.0)],
    ),
    MsgType.WEIGHTS_UPDATED: WeightsUpdated(version=2, pause_s=0.5, num_interrupted=7),
    MsgType.TRAIN: Train(
        step=1,
        version=1,
        token_ids=_arange(10),
        logprobs=np.zeros(10, np.float32),
        versions=np.full(10, -1, np.int32),
        loss_mask=np.ones(10, bool),
        cu_seqlens=np.array([0, 4, 10], np.int32),
        rewards=np.array([1.0, 0.0], np.float32),
        group_ids=np.array([5, 5], np.int64),
        advantages=np.array([0.5, -0.5], np.float32),
        minibatch_sizes=[1, 1],
        minibatch_loss_tokens=[3, 5],
        replay=True,
    ),
    MsgType.TRAINED: Trained(
        step=1,
        version=2,
        stats={"loss": 0.1},
        weights_path=None,
        replay=True,
        checkpoint="/r/checkpoints/step_000001",
    ),
    MsgType.SCORE: Score(
        request_ids=["r", "s"],
        prompt_id="p",
        completion_ids=[_arange(4), _arange(2)],
        reference={"answer": "12", "tests": [[1, 2]]},
    ),
    MsgType.SCORED: Scored(
        request_ids=["r", "s"],
        rewards=[1.0, 0.0],
        verdicts=[Verdict.OK, Verdict.WRONG],
        details=["", "no"],
        check_s=[0.1, 0.2],
    ),
    MsgType.SHUTDOWN: Shutdown(reason="done", rejoin=True),
    MsgType.READY: Ready(version=3, store="10.0.0.1:29500"),
    MsgType.JOIN_GROUP: JoinGroup(
        group=GroupName.WEIGHTS,
        generation=2,
        rank=1,
        world_size=3,
        backend="gloo",
        store="10.0.0.1:29500",
        timeout_s=60.0,
    ),
    MsgType.GROUP_STATUS: GroupStatus(
        group=GroupName.TRAINER, generation=1, state=GroupState.FAILED, error="timeout"
    ),
    MsgType.BROADCAST_WEIGHTS: BroadcastWeights(version=4, generation=2),
    MsgType.WORKER_ERROR: WorkerError(error="boom", fatal=True, request_id="r"),
}

FIELDED = [kind for kind in sorted(SAMPLES) if dataclasses.fields(type(SAMPLES[kind]))]
"""The kinds with a field a header could miss or mistype (a Heartbeat has none)."""


def _assert_same(a, b, where=""):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b), where
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for name in a.__dataclass_fields__:
            _assert_same(getattr(a, name), getattr(b, name), f"{where}.{name}")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def _num_arrays(msg):
    count = 0
    for name in msg.__dataclass_fields__:
        value = getattr(msg, name)
        values = value if isinstance(value, list) else [value]
        count += sum(isinstance(v, (np.ndarray, torch.Tensor)) for v in values)
    return count


EPISODE_GENERATE = Generate(
    request_ids=["r2"],
    prompt_ids=_arange(5),
    max_new_tokens=64,
    temperature=1.0,
    stop_token_ids=[1, 93],
    prompt_id="train-7",
    reference={"answer": 17834, "tests": [[1, "x"]]},
)
EPISODE_GENERATED = Generated(
    request_id="r2",
    output_ids=_arange(6),
    logprobs=np.array([-1, -2, 0, 0, -1, -1], np.float32),
    versions=np.array([3, 3, -1, -1, 4, 4], np.int32),
    loss_mask=np.array([True, True, False, False, True, True]),
    finish_reason=FinishReason.STOP,
    episode_end=EpisodeEnd.TURN_LIMIT,
    reward=0.0,
    verdict=Verdict.NO_ANSWER,
    detail="the episode ended at the turn limit",
    num_turns=2,
    num_tool_calls=1,
    num_tool_errors=1,
    tool_s=0.125,
)


@pytest.mark.parametrize(
    "msg", [EPISODE_GENERATE, EPISODE_GENERATED], ids=["generate", "generated"]
)
def test_episode_fields_round_trip(msg):
    frames = encode(msg)
    assert len(frames) == 2 + _num_arrays(msg)
    _assert_same(msg, decode(frames))


def test_a_single_completion_decodes_without_episode_fields():
    """A sender that knows nothing of episodes (a worker of an earlier version) is understood:
    the new fields are optional and default to 'one completion'."""
    plain = Generated(
        request_id="r",
        output_ids=_arange(2),
        logprobs=np.zeros(2, np.float32),
        versions=np.zeros(2, np.int32),
        finish_reason=FinishReason.STOP,
    )
    frames = encode(plain)
    header = msgpack.unpackb(frames[1], raw=False, ext_hook=msgpack.ExtType)
    legacy = {
        k: v
        for k, v in header.items()
        if k
        in (
            "request_id",
            "output_ids",
            "logprobs",
            "versions",
            "finish_reason",
            "num_interruptions",
            "generation_s",
        )
    }
    out = decode([frames[0], msgpack.packb(legacy), *frames[2:]])
    assert out.loss_mask is None and out.episode_end is None and out.verdict is None
    assert (out.num_turns, out.num_tool_calls, out.reward) == (1, 0, 0.0)
    _assert_same(plain, out)


def test_every_schema_has_a_sample():
    assert set(SAMPLES) == set(schemas())


@pytest.mark.parametrize("kind", list(SAMPLES), ids=lambda k: k.name)
def test_round_trip_of_every_schema(kind):
    msg = SAMPLES[kind]
    frames = encode(msg)
    assert len(frames) == 2 + _num_arrays(msg)
    _assert_same(msg, decode(frames))


def test_round_trip_survives_real_zmq_frames_without_copies():
    import zmq

    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://messages-test")
        b.connect("inproc://messages-test")
        big = np.random.default_rng(0).standard_normal(8_000_000).astype(np.float32)  # 32 MB
        msg = Train(
            step=0,
            version=0,
            token_ids=_arange(8_000_000),
            logprobs=big,
            versions=np.zeros(8_000_000, np.int32),
            loss_mask=np.ones(8_000_000, bool),
            cu_seqlens=np.array([0, 8_000_000], np.int32),
            rewards=np.zeros(1, np.float32),
            group_ids=np.zeros(1, np.int64),
        )
        a.send_multipart(encode(msg), copy=False)
        frames = b.recv_multipart(copy=False)
        out = decode(frames)
        _assert_same(msg, out)
        assert not out.logprobs.flags.owndata  # a view of the received buffer, not a copy
    finally:
        a.close(0)
        b.close(0)


@pytest.mark.parametrize(
    "value",
    [
        np.zeros((0,), np.int32),
        np.array(3.5, np.float64),
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # non-contiguous
        np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
        np.zeros((3, 0), np.float32),  # memoryview cannot cast a view with a 0 in its shape
        np.ones((2, 3), bool),
    ],
    ids=["empty", "scalar", "non-contiguous", "fortran-ordered", "empty-2d", "bool-2d"],
)
def test_array_edge_cases_round_trip(value):
    msg = Generate(request_ids=["x"], prompt_ids=value, max_new_tokens=1, temperature=1.0)
    out = decode(encode(msg))
    assert out.prompt_ids.dtype == value.dtype and out.prompt_ids.shape == value.shape
    assert np.array_equal(out.prompt_ids, value)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(0, 5, dtype=torch.bfloat16),
        torch.tensor(1.5, dtype=torch.bfloat16),
        torch.arange(20, dtype=torch.float16).reshape(4, 5).t(),
        torch.randn(3, 3, dtype=torch.float64),
    ],
    ids=["empty-bf16", "scalar-bf16", "transposed-fp16", "fp64"],
)
def test_tensor_edge_cases_round_trip(tensor):
    msg = WeightsChunk(version=0, index=0, num_chunks=1, names=["t"], tensors=[tensor])
    (out,) = decode(encode(msg)).tensors
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


def _frames(kind=MsgType.HEARTBEAT, header=None, arrays=()):
    return [bytes([kind]), msgpack.packb(header if header is not None else {}), *arrays]


@pytest.mark.parametrize(
    "frames, needle",
    [
        ([b"\x03"], "at least 2"),
        ([b"\x63", msgpack.packb({})], "unknown message type"),
        ([b"\x03\x03", msgpack.packb({})], "unknown message type"),
        ([b"\x03", b"\xc1\xff\x00"], "not valid msgpack"),
        ([b"\x03", msgpack.packb([1, 2])], "not a mapping"),
        (_frames(header={"evil": 2}), "unknown field"),
        (_frames(MsgType.READY, {"version": "many"}), "expected int"),
        (_frames(MsgType.READY, {"version": True}), "expected int"),
        (_frames(MsgType.SHUTDOWN, {"reason": 5}), "expected str"),
        (_frames(MsgType.CANCEL, {}), "required field 'request_ids' missing"),
        (
            _frames(
                MsgType.SCORED,
                {
                    "request_ids": ["r"],
                    "rewards": [1.0],
                    "verdicts": ["great"],
                    "details": [""],
                    "check_s": [0.0],
                },
            ),
            "not one of",
        ),
        (_frames(MsgType.TRAINED, {"step": 1, "version": 1, "stats": {1: 2.0}}), "strict"),
        (_frames(MsgType.HEARTBEAT, {}, [b"stray"]), "1 array frames sent, 0 referenced"),
    ],
    ids=[
        "one-frame",
        "unknown-type",
        "long-type",
        "garbage-header",
        "list-header",
        "unknown-field",
        "wrong-type",
        "bool-for-int",
        "int-for-str",
        "missing-field",
        "bad-enum",
        "int-keys",
        "surplus-frame",
    ],
)
def test_malformed_messages_are_refused_with_a_clear_error(frames, needle):
    with pytest.raises(MessageError, match=needle):
        decode(frames)


@pytest.mark.parametrize("kind", [MsgType.HEARTBEAT, MsgType.READY, MsgType.SHUTDOWN])
def test_an_empty_header_is_every_default_of_a_kind_that_has_them_all(kind):
    """Read without unpacking (the most frequent message, a bare Heartbeat, is one); the
    same message as the general path makes of an empty map written another way (map16)."""
    schema = messages.schemas()[kind]
    assert decode([bytes([kind]), b"\x80"]) == schema()
    assert decode([bytes([kind]), b"\xde\x00\x00"]) == schema()
    with pytest.raises(MessageError, match="refused unread"):
        decode([bytes([kind]), b"\x80"], only=[MsgType.REGISTER])


def _generate_header(ref):
    return {
        "request_ids": ["r"],
        "prompt_ids": msgpack.ExtType(1, msgpack.packb(ref)),
        "max_new_tokens": 1,
        "temperature": 1.0,
    }


def test_truncated_message_missing_its_array_frame_is_refused():
    frames = encode(SAMPLES[MsgType.GENERATE])
    with pytest.raises(MessageError, match="missing"):
        decode(frames[:-1])


def test_array_frame_of_the_wrong_size_is_refused():
    frames = _frames(MsgType.GENERATE, _generate_header(["int32", [4], 0]), [b"\x00" * 12])
    with pytest.raises(MessageError, match="needs 16"):
        decode(frames)


@pytest.mark.parametrize("ref", [["object", [1], 0], ["int32", [-1], 0], ["bfloat16", [1], 0]])
def test_disallowed_array_references_are_refused(ref):
    frames = _frames(MsgType.GENERATE, _generate_header(ref), [b"\x00" * 4])
    with pytest.raises(MessageError):
        decode(frames)


def test_array_smuggled_into_an_untyped_field_is_refused():
    header = {
        "request_ids": ["r"],
        "prompt_id": "p",
        "completion_ids": [msgpack.ExtType(1, msgpack.packb(["int32", [1], 0]))],
        "reference": [msgpack.ExtType(1, msgpack.packb(["int32", [1], 1]))],
    }
    with pytest.raises(MessageError, match="untyped"):
        decode(_frames(MsgType.SCORE, header, [b"\x00" * 4, b"\x00" * 4]))


def test_unknown_msgpack_extension_is_refused():
    header = {
        "request_id": "r",
        "prompt_ids": msgpack.ExtType(42, b"x"),
        "max_new_tokens": 1,
        "temperature": 1.0,
    }
    with pytest.raises(MessageError, match="extension"):
        decode(_frames(MsgType.GENERATE, header))


def test_oversized_message_is_refused():
    frames = encode(SAMPLES[MsgType.TRAIN])
    with pytest.raises(MessageError, match="exceeds"):
        decode(frames, max_bytes=64)


def test_pickle_payload_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Exploit())
    for frames in (
        [bytes([MsgType.HEARTBEAT]), payload],
        [payload, payload],
        [bytes([MsgType.GENERATE]), msgpack.packb(_generate_header(["int32", [1], 0])), payload],
    ):
        with pytest.raises(MessageError):
            decode(frames)
    assert not marker.exists()


def test_encoding_refuses_unserialisable_values():
    with pytest.raises(MessageError, match="not serialisable"):
        encode(Shutdown(reason=object()))
    with pytest.raises(MessageError, match="cannot travel"):
        encode(
            Generate(
                request_ids=["r"],
                prompt_ids=np.array(["a"], dtype=object),
                max_new_tokens=1,
                temperature=1.0,
            )
        )
    # The reused packer is left clean by a failed encoding: the next message is whole.
    assert decode(encode(Shutdown(reason="after"))).reason == "after"


def _generate(n: int) -> Generate:
    return Generate(
        request_ids=[f"r{n}"],
        prompt_ids=np.arange(n, dtype=np.int32),
        max_new_tokens=8,
        temperature=1.0,
        stop_token_ids=[n],
    )


def test_the_same_message_encodes_to_the_same_bytes_whatever_came_between():
    sizes = [3, 4, 3, 5, 6, 3]
    frames = [encode(_generate(n)) for n in sizes]
    assert frames[0][1] == frames[2][1] == frames[5][1]  # the same header, the same bytes
    assert frames[0][1] != frames[1][1]
    for n, message in zip(sizes, frames, strict=True):
        got = decode(message)
        assert got.request_ids == [f"r{n}"] and got.stop_token_ids == [n]
        np.testing.assert_array_equal(got.prompt_ids, np.arange(n, dtype=np.int32))


def test_threads_encoding_at_once_each_get_their_own_messages():
    """Each thread encodes with its own encoder and its own message's frames
    (codec._EncoderState)."""

    def encode_many(offset: int) -> list[Generate]:
        return [decode(encode(_generate(offset + i))) for i in range(200)]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(encode_many, [0, 1000, 2000, 3000]))
    for offset, got in zip([0, 1000, 2000, 3000], results, strict=True):
        assert [m.request_ids for m in got] == [[f"r{offset + i}"] for i in range(200)]
        assert all(len(m.prompt_ids) == int(m.request_ids[0][1:]) for m in got)


def test_fields_at_their_defaults_stay_off_the_wire_and_come_back():
    plain = Generated(
        request_id="r",
        output_ids=_arange(2),
        logprobs=np.zeros(2, np.float32),
        versions=np.zeros(2, np.int32),
        finish_reason=FinishReason.STOP,
    )
    frames = encode(plain)
    header = msgpack.unpackb(frames[1], raw=False, ext_hook=msgpack.ExtType)
    assert sorted(header) == ["finish_reason", "logprobs", "output_ids", "request_id", "versions"]
    _assert_same(plain, decode(frames))
    # Equal to the default but of another type: sent, and judged by the decoder as before.
    with pytest.raises(MessageError, match="READY.version: expected int, got bool"):
        decode(encode(Ready(version=False)))
    assert decode(encode(Ready())) == Ready()


def test_a_generate_names_its_samples_one_to_one():
    # One Generate carries a group's samples: each request id with its own seed (areal.seeds).
    msg = decode(encode(SAMPLES[MsgType.GENERATE]))
    assert msg.samples() == [("r1", 5), ("r2", 2**63 - 1)]
    unseeded = Generate(
        request_ids=["a", "b"], prompt_ids=_arange(2), max_new_tokens=1, temperature=1.0
    )
    assert decode(encode(unseeded)).samples() == [("a", None), ("b", None)]
    for request_ids, seeds, problem in [
        ([], None, "distinct request ids"),
        (["a", "a"], [1, 2], "distinct request ids"),
        (["a", "b"], [1], "1 seeds for 2 request ids"),
    ]:
        bad = Generate(
            request_ids=request_ids,
            prompt_ids=_arange(2),
            max_new_tokens=1,
            temperature=1.0,
            seeds=seeds,
        )
        with pytest.raises(ValueError, match=problem):
            decode(encode(bad)).samples()


def test_completions_come_apart_into_the_generated_they_carry():
    # A worker answers several single completions in one message (the controller's
    # cost is per message); each comes apart as a Generated of views into its arrays.
    parts = [
        Generated(
            request_id=f"g1-s{i}-a0",
            output_ids=_arange(n),
            logprobs=np.full(n, -0.5, np.float32),
            versions=np.full(n, i, np.int32),
            finish_reason=FinishReason.STOP if n % 2 else FinishReason.LENGTH,
            num_interruptions=i,
            generation_s=0.1 * i,
        )
        for i, n in enumerate([4, 1, 7])
    ]
    msg = decode(encode(Completions.of(parts)))
    assert msg.lengths == [4, 1, 7]
    for got, want in zip(msg.completions(), parts, strict=True):
        _assert_same(want, got)
    alone = Completions.of(parts[:1])
    assert alone.output_ids is parts[0].output_ids  # one completion: not copied


def test_completions_carry_their_rollout_workers_outcomes_only_when_each_has_one():
    # reward.num_workers=0: the rollout worker scored each completion before sending it.
    parts = [
        Generated(
            request_id=f"g1-s{i}-a0",
            output_ids=_arange(3),
            logprobs=np.full(3, -0.5, np.float32),
            versions=np.zeros(3, np.int32),
            finish_reason=FinishReason.STOP,
            reward=float(i),
            verdict=verdict,
            detail=f"check {i}",
            check_retries=2 * i,
        )
        for i, verdict in enumerate([Verdict.WRONG, Verdict.OK])
    ]
    msg = decode(encode(Completions.of(parts)))
    assert msg.scored and msg.rewards == [0.0, 1.0] and msg.details == ["check 0", "check 1"]
    assert msg.verdicts == [Verdict.WRONG, Verdict.OK] and msg.check_retries == [0, 2]
    for got, want in zip(msg.completions(), parts, strict=True):
        assert (got.reward, got.verdict, got.detail, got.check_retries) == (
            want.reward,
            want.verdict,
            want.detail,
            want.check_retries,
        )
    parts[1].verdict = None  # one unscored: the message carries no outcome at all
    unscored = decode(encode(Completions.of(parts)))
    assert not unscored.scored and unscored.rewards == unscored.verdicts == []
    assert [c.verdict for c in unscored.completions()] == [None, None]


def test_per_token_versions_travel_as_runs_and_come_back_per_token():
    interrupted = np.array([4, 4, 4, 5, 5, 7], np.int32)  # two weight updates mid-way
    parts = [
        Generated(
            request_id=f"g2-s{i}-a0",
            output_ids=_arange(len(versions)),
            logprobs=np.full(len(versions), -0.5, np.float32),
            versions=versions,
            finish_reason=FinishReason.STOP,
        )
        for i, versions in enumerate([interrupted, np.full(3, 7, np.int32)])
    ]
    msg = Completions.of(parts)
    assert msg.num_runs == [3, 1]
    assert msg.run_versions.tolist() == [4, 5, 7, 7] and msg.run_lengths.tolist() == [3, 2, 1, 3]
    for got, want in zip(decode(encode(msg)).completions(), parts, strict=True):
        _assert_same(want, got)


@pytest.mark.parametrize("values", [[4.0, 4.0, 5.0], [4.0, np.nan, 5.0], [np.inf]])
def test_version_runs_refuse_values_that_are_not_integers(values):
    """A float version (NaN and infinities among them) is refused, not cast to some int32."""
    with pytest.raises(ValueError, match="versions of dtype float64: integers expected"):
        version_runs(np.array(values))
    part = Generated(
        request_id="g0-s0-a0",
        output_ids=_arange(len(values)),
        logprobs=np.zeros(len(values), np.float32),
        versions=np.array(values, np.float32),
        finish_reason=FinishReason.STOP,
    )
    with pytest.raises(ValueError, match="float32: integers expected"):
        Completions.of([part])


@pytest.mark.parametrize(
    "change, problem",
    [
        (dict(lengths=[3]), r"lengths \[2, 1, 2, 2, 2, 2, 0, 0, 0, 0\]"),
        (dict(num_runs=[2]), r"lengths \[2, 2, 1, 2, 2, 2, 0, 0, 0, 0\]"),
        # scored by the rollout worker: an outcome for every completion, or none
        (dict(rewards=[1.0]), r"lengths \[2, 2, 2, 2, 2, 2, 1, 0, 0, 0\]"),
        (
            dict(
                rewards=[1.0, 0.0],
                verdicts=[Verdict.OK, Verdict.WRONG],
                details=["", ""],
                check_retries=[0],
            ),
            r"lengths \[2, 2, 2, 2, 2, 2, 2, 2, 2, 1\]",
        ),
        (
            dict(
                request_ids=[],
                lengths=[],
                num_runs=[],
                finish_reasons=[],
                num_interruptions=[],
                generation_s=[],
            ),
            "at least one",
        ),
        (dict(lengths=[2, 2]), r"\(sum 4\) do not cut"),
        (dict(lengths=[4, -1]), "do not cut"),
        (dict(num_runs=[1, 0]), r"\(sum 1\) do not cut run arrays"),
        (dict(num_runs=[3, -1]), "do not cut run arrays"),
        (dict(run_versions=np.zeros((2, 1), np.int32)), "do not cut run arrays"),
        (dict(run_lengths=np.array([3, 0], np.int32)), "positive integers"),
        (dict(run_lengths=np.array([1.0, 2.0])), "positive integers"),
        (dict(run_lengths=np.array([2**63, 2**63 + 3], np.uint64)), "none above"),  # sum 3
        # a run of the first completion's spills into the second's tokens
        (dict(lengths=[2, 1], num_runs=[1, 1], run_lengths=np.array([3, 0])), "positive"),
        (
            dict(lengths=[1, 2], num_runs=[1, 1], run_lengths=np.array([2, 1], np.int32)),
            "do not add up to its length",
        ),
    ],
)
@pytest.mark.parametrize("listed_runs", [messages.LISTED_RUNS, -1], ids=["listed", "numpy"])
def test_completions_whose_parts_do_not_fit_together_are_refused(
    change, problem, listed_runs, monkeypatch
):
    """Either way of reading the runs: as Python ints (a few) or with numpy (many)."""
    monkeypatch.setattr(messages, "LISTED_RUNS", listed_runs)
    msg = dataclasses.replace(SAMPLES[MsgType.COMPLETIONS], **change)
    with pytest.raises(ValueError, match=problem):
        decode(encode(msg)).completions()
