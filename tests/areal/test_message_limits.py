"""Decoding cost is bounded per message: header bytes, list and map lengths, nesting and
frame counts per kind, checked before the header is unpacked; `only` refuses other kinds on
the type byte."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from areal import codec
from areal.codec import decode, encode
from areal.messages import (
    HEADER_LIMITS,
    MAX_DEPTH,
    REGISTER_MAX_BYTES,
    Heartbeat,
    MessageError,
    MsgType,
    Register,
    Score,
    Trained,
    WorkerKind,
    header_limit,
)


def _frames(kind: MsgType, header: bytes, *arrays: bytes) -> list[bytes]:
    return [bytes([kind]), header, *arrays]


@pytest.fixture
def unpack_calls(monkeypatch):
    """Counts msgpack unpacking of headers (to show a refusal happened before it)."""
    calls = []
    real = msgpack.unpackb

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(codec.msgpack, "unpackb", counting)
    return calls


def test_a_header_over_its_kinds_limit_is_refused_before_unpacking(unpack_calls):
    # The probe of issue 14 held 2^20 entries (8 MB; tests/controller/test_hostile_peers.py);
    # any header over the kind's limit is refused alike.
    big = msgpack.packb({"stats": {str(i): 0 for i in range(1 << 14)}})
    assert len(big) > header_limit(MsgType.HEARTBEAT).max_bytes
    with pytest.raises(
        MessageError, match=r"HEARTBEAT: header of \d+ bytes exceeds the 65536-byte"
    ) as err:
        decode(_frames(MsgType.HEARTBEAT, big))
    assert err.value.reason == "too large" and unpack_calls == []


def test_a_list_longer_than_its_kind_allows_is_refused():
    limit = HEADER_LIMITS[MsgType.WORKER_ERROR].max_items
    ids = [str(i) for i in range(limit + 1)]
    header = msgpack.packb({"error": "e", "request_ids": ids})
    assert len(header) < HEADER_LIMITS[MsgType.WORKER_ERROR].max_bytes
    with pytest.raises(MessageError, match="WORKER_ERROR: header is not valid msgpack"):
        decode(_frames(MsgType.WORKER_ERROR, header))
    within = msgpack.packb({"error": "e", "request_ids": ids[:limit]})
    assert len(decode(_frames(MsgType.WORKER_ERROR, within)).request_ids) == limit


def test_only_refuses_other_kinds_on_the_type_byte(unpack_calls):
    with pytest.raises(MessageError, match="HEARTBEAT refused unread: only REGISTER") as err:
        decode(
            _frames(MsgType.HEARTBEAT, b"\xff" * 100), REGISTER_MAX_BYTES, only=(MsgType.REGISTER,)
        )
    assert err.value.reason == "not accepted" and unpack_calls == []
    register = Register(kind=WorkerKind.ROLLOUT, worker_id="w", pid=1, host="h", secret="s")
    assert decode(encode(register), REGISTER_MAX_BYTES, only=(MsgType.REGISTER,)) == register
    padded = Register(
        kind=WorkerKind.ROLLOUT, worker_id="w" * REGISTER_MAX_BYTES, pid=1, host="h", secret="s"
    )
    with pytest.raises(MessageError, match=f"exceeds the {REGISTER_MAX_BYTES}-byte") as err:
        decode(encode(padded), REGISTER_MAX_BYTES, only=(MsgType.REGISTER,))
    assert err.value.reason == "too large"


def test_deep_nesting_in_an_untyped_field_is_a_message_error_not_a_crash():
    for depth in (MAX_DEPTH + 1, 500, 5000):  # 5000: beyond msgpack's own stack
        header = (
            b"\x84"
            + msgpack.packb("request_ids")
            + msgpack.packb(["r"])
            + msgpack.packb("prompt_id")
            + msgpack.packb("p")
            + msgpack.packb("completion_ids")
            + msgpack.packb([msgpack.ExtType(1, msgpack.packb(["int32", [0], 0]))])
            + msgpack.packb("reference")
            + b"\x91" * depth
            + b"\xc0"
        )
        with pytest.raises(MessageError):
            decode(_frames(MsgType.SCORE, header, b""))
    shallow = Score(
        request_ids=["r"],
        prompt_id="p",
        completion_ids=[np.zeros(0, np.int32)],
        reference=[[[["deep enough"]]]],
    )
    assert decode(encode(shallow)).reference == [[[["deep enough"]]]]


def test_arrays_of_too_many_dimensions_and_too_many_frames_are_refused():
    ref = msgpack.ExtType(1, msgpack.packb(["int32", [1] * (MAX_DEPTH + 1), 0]))
    header = msgpack.packb(
        {"request_ids": ["r"], "prompt_id": "p", "completion_ids": [ref], "reference": 0}
    )
    with pytest.raises(MessageError, match="dimensions"):
        decode(_frames(MsgType.SCORE, header, b"\x00" * 4))
    limit = header_limit(MsgType.HEARTBEAT).max_items
    with pytest.raises(MessageError, match=f"array frames; at most {limit}"):
        decode(_frames(MsgType.HEARTBEAT, encode(Heartbeat())[1], *[b""] * (limit + 1)))


def test_every_kind_has_a_limit_its_real_messages_fit():
    assert all(header_limit(kind).max_bytes >= 4096 for kind in MsgType)
    assert header_limit(MsgType.REGISTER).max_bytes == REGISTER_MAX_BYTES
    stats = {f"train/stat_{i}": float(i) for i in range(200)}  # a trainer's step stats
    assert decode(encode(Trained(step=1, version=1, stats=stats))).stats == stats
