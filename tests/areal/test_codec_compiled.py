"""The codec's compiled path (areal.codec_fast, msgspec) decodes every message as its Python
path does: the same message when both accept it, the same refusal (worded by the Python
path) when not. Headers are drawn by test_codec_fast_path.py's strategies: a well-formed
message's fields, each possibly replaced by a near miss or a hostile value or left out, plus
unknown fields."""

from __future__ import annotations

import dataclasses
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings

from areal import codec, messages
from areal.codec import decode, encode
from areal.codec_fast import wire_struct
from areal.messages import FinishReason, Generated, HeaderLimit, MsgType, Scored
from areal.tasks.base import Verdict

from tests.areal.test_codec_fast_path import (
    _header_and_frames,
    _plain,
    mutated_messages,
    near_miss_headers,
)
from tests.areal.test_messages import FIELDED, SAMPLES

COMPILED = sorted(k for k in SAMPLES if wire_struct(messages.schemas()[k]) is not None)


def _packed(value):
    """A decoded header value packed again (array references as the extension they were)."""
    if isinstance(value, codec._ArrayRef):
        return msgpack.ExtType(
            codec._ARRAY_EXT, msgpack.packb([value.dtype, list(value.shape), value.index])
        )
    if isinstance(value, list):
        return [_packed(v) for v in value]
    if isinstance(value, dict):
        return {k: _packed(v) for k, v in value.items()}
    return value


def _decoded(frames, compiled: bool):
    try:
        msg = decode(frames, compiled=compiled)
    except messages.MessageError as err:
        return "error", str(err)
    return "ok", {f.name: _plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)}


def _both(kind, header, frames):
    raw = [bytes([kind]), msgpack.packb(_packed(header)), *frames]
    compiled, python = _decoded(raw, True), _decoded(raw, False)
    assert compiled == python, (header, compiled, python)
    return compiled


def test_the_messages_a_controller_receives_most_take_the_compiled_path():
    assert {MsgType.GENERATED, MsgType.SCORED, MsgType.HEARTBEAT, MsgType.WEIGHTS_UPDATED} <= set(
        COMPILED
    )
    # an untyped field must hold plain data only, which msgspec does not check
    assert MsgType.SCORE not in COMPILED and MsgType.GENERATE not in COMPILED


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(drawn=mutated_messages(COMPILED))
def test_the_compiled_path_decides_every_header_as_the_python_path_does(drawn):
    kind, header, frames = drawn
    _both(kind, header, frames)


@pytest.mark.parametrize("kind", [k for k in COMPILED if k in FIELDED])
def test_every_near_miss_in_every_field_is_decided_alike(kind):
    _, frames = _header_and_frames(SAMPLES[kind])
    outcomes = {_both(kind, changed, frames)[0] for _, _, changed in near_miss_headers(kind)}
    assert outcomes == {"ok", "error"}


def test_a_completion_decodes_to_the_same_arrays_in_place():
    msg = Generated(
        request_id="g1-s2-a0",
        output_ids=np.arange(40, dtype=np.int32),
        logprobs=np.full(40, -0.5, np.float32),
        versions=np.ones(40, np.int32),
        finish_reason=FinishReason.LENGTH,
        num_interruptions=2,
    )
    frames = [memoryview(bytes(f)) for f in encode(msg)]
    fast = decode(frames)
    assert _decoded(frames, True) == _decoded(frames, False)
    assert np.shares_memory(fast.output_ids, np.frombuffer(frames[2], np.uint8))
    assert fast.finish_reason is FinishReason.LENGTH


def test_lists_beyond_their_kinds_bound_are_refused_on_both_paths(monkeypatch):
    monkeypatch.setitem(messages.HEADER_LIMITS, MsgType.SCORED, HeaderLimit(1 << 20, 4))
    n = 5
    msg = Scored(
        request_ids=[f"r{i}" for i in range(n)],
        rewards=[1.0] * n,
        verdicts=[Verdict.OK] * n,
        details=[""] * n,
        check_s=[0.0] * n,
    )
    frames = encode(msg)
    for compiled in (True, False):
        with pytest.raises(messages.MessageError):
            decode(frames, compiled=compiled)
