"""The decoder's short paths (areal.codec._field_check) accept, convert and refuse exactly
what the general field check (`_check`, field by field, as decoding did before them) does.

Headers are drawn as msgpack would hand them over: a well-formed message's fields, each
possibly replaced by a hostile value (wrong type, wrong enum value, an array reference to a
missing, reused or mis-sized frame, nested lists and maps) or left out, plus unknown fields.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from areal import codec, messages
from areal.codec import encode
from areal.messages import MessageError, MsgType

from tests.areal.test_messages import FIELDED, SAMPLES


def reference_build(schema: type, header: dict[str, typing.Any], frames) -> typing.Any:
    """Decoding's last step as it was before the short paths: `_check` on every field."""
    name = schema.KIND.name
    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    if not names.issuperset(header):
        raise MessageError(f"{name}: unknown field(s) {sorted(set(header) - names)}")
    values, used = {}, set()
    for f in dataclasses.fields(schema):
        if f.name not in header:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{name}: required field {f.name!r} missing")
            continue
        values[f.name] = codec._check(
            header[f.name], hints[f.name], frames, f"{name}.{f.name}", used
        )
    if len(used) != len(frames):
        raise MessageError(f"{name}: {len(frames)} array frames sent, {len(used)} referenced")
    return schema(**values)


def _header_and_frames(msg) -> tuple[dict[str, typing.Any], list[memoryview]]:
    """What decoding sees of `msg`: its unpacked header (array references) and frames."""
    import msgpack

    frames = [memoryview(f) for f in encode(msg)]
    header = msgpack.unpackb(frames[1], ext_hook=codec._ext_hook, raw=False)
    return header, frames[2:]


def _outcome(build, schema, header, frames) -> tuple[str, typing.Any]:
    try:
        msg = build(schema, dict(header), frames)
    except Exception as err:
        return "error", (type(err).__name__, str(err))
    return "ok", {f.name: _plain(getattr(msg, f.name)) for f in dataclasses.fields(schema)}


def _plain(value: typing.Any) -> typing.Any:
    """A comparable form that keeps types (an enum member is not its value; NaN == NaN)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            value.reshape(-1).view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, list):
        return ("list", [_plain(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(k, _plain(v)) for k, v in value.items()])
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


_REFS = st.builds(
    codec._ArrayRef,
    st.sampled_from(["int32", "float32", "int64", "bool", "bfloat16", "uint8"]),
    st.lists(st.integers(0, 6), max_size=2).map(tuple),
    st.integers(0, 4),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(
        [
            "stop",
            "length",
            "abort",
            "ok",
            "wrong",
            "rollout",
            "trainer",
            "joined",
            "environment",
            "STOP",
            "",
        ]
    ),
)
_HOSTILE = st.recursive(
    st.one_of(_SCALARS, _REFS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 3)), inner, max_size=3),
    ),
    max_leaves=6,
)
_NEAR_MISSES = [
    "STOP",
    "Stop",
    "stop ",
    "OK",
    "Ok",
    "ok",
    "length",
    1,
    0,
    -1,
    1.0,
    2.5,
    True,
    False,
    None,
    b"x",
    "",
    [],
    {},
    [1, "a"],
    [1.0],
    ["a", "b"],
]
_FRAMES = st.lists(st.binary(max_size=24).map(memoryview), max_size=4)


@st.composite
def mutated_messages(draw, kinds) -> tuple[MsgType, dict[str, typing.Any], list[memoryview]]:
    """A message of one of `kinds` as decoding sees it, with each header field kept, replaced
    by a near miss (another field's value, an enum value in another case, a number of the
    neighbouring type) or a hostile value, or left out; sometimes other frames and an unknown
    field."""
    kind = draw(st.sampled_from(kinds), label="kind")
    header, frames = _header_and_frames(SAMPLES[kind])
    near = st.sampled_from([*header.values(), *_NEAR_MISSES])
    for name in list(header):
        change = draw(st.sampled_from(["keep", "keep", "near", "hostile", "drop"]), label=name)
        if change == "near":
            header[name] = draw(near, label=f"{name} value")
        elif change == "hostile":
            header[name] = draw(_HOSTILE, label=f"{name} value")
        elif change == "drop":
            del header[name]
    if draw(st.booleans(), label="other frames"):
        frames = draw(_FRAMES, label="frames")
    if draw(st.integers(0, 9), label="unknown field") == 0:
        header["surplus"] = 1
    return kind, header, frames


def near_miss_headers(kind) -> typing.Iterator[tuple[str, typing.Any, dict[str, typing.Any]]]:
    """Each field of a well-formed `kind` header replaced in turn by each near miss and by each
    other field's value: (field, value, changed header). Exhaustive over a finite set, where
    the random draws above rarely land on one exact value."""
    header, _ = _header_and_frames(SAMPLES[kind])
    candidates = [*header.values(), *_NEAR_MISSES, float("nan"), float("inf"), 2**64 - 1]
    for name in header:
        for value in candidates:
            yield name, value, {**header, name: value}


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(drawn=mutated_messages(sorted(SAMPLES)))
def test_the_short_paths_decide_every_header_as_the_general_check_does(drawn):
    kind, header, frames = drawn
    schema = messages.schemas()[kind]
    assert _outcome(codec._build, schema, header, frames) == _outcome(
        reference_build, schema, header, frames
    )


@pytest.mark.parametrize("kind", [MsgType.GENERATED, MsgType.SCORED])
def test_a_well_formed_hot_message_decodes_to_what_the_general_check_gives(kind):
    schema = messages.schemas()[kind]
    header, frames = _header_and_frames(SAMPLES[kind])
    fast = _outcome(codec._build, schema, header, frames)
    assert fast[0] == "ok"
    assert fast == _outcome(reference_build, schema, header, frames)


@pytest.mark.parametrize("kind", FIELDED)
def test_every_near_miss_in_every_field_is_decided_as_the_general_check_does(kind):
    schema = messages.schemas()[kind]
    _, frames = _header_and_frames(SAMPLES[kind])
    refused = 0
    for name, value, changed in near_miss_headers(kind):
        fast = _outcome(codec._build, schema, changed, frames)
        assert fast == _outcome(reference_build, schema, changed, frames), (name, value)
        refused += fast[0] == "error"
    assert refused  # the candidates do reach the refusals


def _ref_outcome(parse, code, data) -> tuple[str, typing.Any]:
    try:
        return "ok", parse(code, data)
    except MessageError as err:
        return "error", str(err)


_REF_PARTS = st.one_of(
    st.integers(-3, 1 << 40),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
)
_REF_DATA = st.one_of(
    st.binary(max_size=40),
    st.builds(
        lambda d, s, i: msgpack.packb([d, s, i]),
        st.one_of(st.sampled_from(["int32", "float32", "bool", "bfloat16", "object"]), _REF_PARTS),
        st.one_of(st.lists(st.integers(-2, 1 << 20), max_size=3), _REF_PARTS),
        _REF_PARTS,
    ),
)


@pytest.mark.slow
@settings(max_examples=800, deadline=None)
@given(code=st.sampled_from([codec._ARRAY_EXT, 0, 7]), data=_REF_DATA)
@example(code=codec._ARRAY_EXT, data=msgpack.packb([None, [], float("inf")]))
def test_a_cached_array_reference_is_decided_as_an_uncached_one(code, data):
    """`_ext_hook` remembers accepted references by their bytes: the first and every later
    time it gives what parsing them afresh (`_array_ref`) gives, the same error included."""
    expected = _ref_outcome(codec._array_ref, code, data)
    assert _ref_outcome(codec._ext_hook, code, data) == expected
    assert _ref_outcome(codec._ext_hook, code, data) == expected


@pytest.mark.parametrize(
    "shape, index",
    [([float("inf")], 0), ([4], float("inf")), ([4], float("-inf")), ([4], float("nan"))],
)
def test_an_infinite_or_nan_shape_or_index_is_a_malformed_reference(shape, index):
    """int() of an infinity raises OverflowError (of a nan, ValueError): both are a hostile
    peer's malformed message, refused as such, never an uncaught error in the receive loop."""
    data = msgpack.packb(["int32", shape, index])
    for parse in (codec._array_ref, codec._ext_hook):
        with pytest.raises(MessageError, match="malformed array reference"):
            parse(codec._ARRAY_EXT, data)


def test_the_array_reference_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(codec, "_REF_CACHE", {})
    monkeypatch.setattr(codec, "_REF_CACHE_ITEMS", 10)
    for n in range(25):
        data = msgpack.packb(["int32", [n], 0])
        assert codec._ext_hook(codec._ARRAY_EXT, data) == ("int32", (n,), 0)
        assert len(codec._REF_CACHE) <= 10
    long_shape = msgpack.packb(["int32", [1 << 40] * 4, 0])  # over the key size: not kept
    codec._ext_hook(codec._ARRAY_EXT, long_shape)
    assert long_shape not in codec._REF_CACHE


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_the_encoder_writes_the_header_msgpack_itself_would(kind):
    """The header is encoded by msgspec (in C); its bytes are what msgpack-python packs for
    the same values, array references included, so either library reads them back."""
    frames = encode(SAMPLES[kind])
    header = msgpack.unpackb(frames[1], raw=False, ext_hook=msgpack.ExtType, strict_map_key=False)
    assert msgpack.packb(header) == bytes(frames[1])


@pytest.mark.parametrize("view_format", ["B", "b", "c"])
def test_the_type_frame_is_read_as_its_byte_whatever_the_view_format(view_format):
    frames = [memoryview(bytes(f)) for f in encode(SAMPLES[MsgType.GENERATED])]
    frames[0] = frames[0].cast(view_format)
    decoded = codec.decode(frames)
    assert type(decoded) is messages.Generated
    assert decoded.request_id == SAMPLES[MsgType.GENERATED].request_id
