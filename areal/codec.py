"""The wire codec of `areal.messages`: a message to frames and back, no pickle.

Framing of a message (after the ROUTER identity frame, when there is one):

    [type byte][msgpack header][raw array frame 0][raw array frame 1]...

The header is a msgpack map of the schema's fields, less those at their defaults (the
decoder fills them in), encoded by msgspec (in C: what a controller at cluster scale spends
most of its encoding on is walking the header). Arrays (numpy, or torch tensors of any
dtype including bfloat16) are not in the header: each is replaced by a msgpack extension
(dtype, shape, frame index) and travels as its own frame, sent with `copy=False` and
rebuilt with `frombuffer` on arrival (views of the received buffers, no copy).

Decoding trusts nothing: an unknown type byte, bytes that are not msgpack, a missing,
unknown or mistyped field, a dtype outside the allow-list, a frame whose size does not match
its dtype and shape, a missing or surplus frame, or a message over the size limit raises
`MessageError` naming the message kind and the field. Decoding never executes code, and its
cost is bounded per message: each kind bounds its header (`areal.messages.HEADER_LIMITS`:
bytes, list and map lengths, nesting) and its number of frames, checked before the header
is unpacked; a caller may accept only some kinds (`only`), checked on the type byte alone.

Torch is imported only when a tensor is encoded or a tensor field decoded. No sockets here
(see `areal.transport`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import threading
import types
import typing
from typing import Any
from collections.abc import Collection, Sequence

import msgpack
import msgspec
import numpy as np

from areal.codec_fast import decode_header
from areal.messages import (
    DEFAULT_MAX_BYTES,
    MAX_DEPTH,
    SCHEMAS,
    MessageError,
    MsgType,
    Tensor,
    header_limit,
    wire_fields,
)

_ARRAY_EXT = 1
"""msgpack extension code of an array reference: packb([dtype, shape, frame index])."""

_NUMPY_DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
)
_TORCH_ONLY_DTYPES = ("bfloat16",)


# ---------------------------------------------------------------------------------------------
# Encoding


def _array_bytes(value: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, contiguous byte view) of a numpy array or torch tensor."""
    if isinstance(value, np.ndarray):
        name = _DTYPE_NAMES.get(value.dtype)  # dtype.name is slow: it showed in profiles
        if name is None:
            raise MessageError(f"array dtype {value.dtype} cannot travel; allowed: {_NUMPY_DTYPES}")
        try:  # C-ordered data, viewed in place (the common case: no flags object to build)
            raw = memoryview(value).cast("B")  # type: ignore[arg-type]  # a buffer
        except TypeError:  # strided or Fortran-ordered (or empty with a 0 in a 2-d shape)
            raw = memoryview(value.tobytes())  # its elements in C order, copied
        return name, value.shape, raw
    if type(value).__module__.startswith("torch"):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _NUMPY_DTYPES + _TORCH_ONLY_DTYPES:
            raise MessageError(f"tensor dtype {tensor.dtype} cannot travel")
        raw = tensor.reshape(-1).view(torch_module().uint8).numpy()
        return dtype, tuple(tensor.shape), memoryview(raw)
    raise MessageError(f"{type(value).__name__} is not an array")


_DTYPE_NAMES = {np.dtype(name): name for name in _NUMPY_DTYPES}
_NUMPY_DTYPE_OBJECTS = {name: np.dtype(name) for name in _NUMPY_DTYPES}
_SCALARS = (str, int, float, bool, type(None), bytes)


_REQUIRED = object()


@functools.cache
def _field_defaults(schema: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each field of `schema`; `_REQUIRED` for a field without one."""
    out = []
    for f in wire_fields(schema):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, f.default_factory()))  # [] or {}: compared, never handed out
        else:
            out.append((f.name, _REQUIRED))
    return tuple(out)


@functools.cache
def _origin_args(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(annotation), typing.get_args(annotation)


def torch_module():
    import torch

    return torch


def encode(msg: Any) -> list[Any]:
    """Frames of `msg`: [type byte, header, *array buffers]. Buffers are not copied."""
    kind = getattr(type(msg), "KIND", None)
    if kind is None or SCHEMAS.get(kind) is not type(msg):
        raise MessageError(f"{type(msg).__name__} is not a registered message schema")
    header = {}
    schema: Any = type(msg)
    for name, default in _field_defaults(schema):
        value = getattr(msg, name)
        # A field at its default is left out (the decoder fills it in): a Generated of one
        # completion carries 5-7 of its 17 fields. Same type only: 0 is not taken for False.
        if type(value) is type(default) and value == default:
            continue
        header[name] = value
    buffers: list[memoryview] = []
    state = _ENCODERS
    state.buffers = buffers
    try:
        packed = state.encoder.encode(header)
    except (TypeError, ValueError, OverflowError) as err:
        raise MessageError(f"{kind.name}: a field is not serialisable: {err}") from None
    except MessageError as err:
        raise MessageError(f"{kind.name}: {err}") from None
    finally:
        state.buffers = []
    return [bytes([kind]), packed, *buffers]


class _EncoderState(threading.local):
    """This thread's msgpack encoder (msgspec's, which walks the header in C: lists,
    maps, enums by their value, scalars) and the array frames of the message it is
    encoding, which its hook appends to."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self._array_reference)

    def _array_reference(self, value: Any) -> Any:
        """What msgspec cannot encode itself: an array (numpy, torch) becomes a reference
        to a frame appended to the message's; a numpy scalar its Python value."""
        if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
            dtype, shape, raw = _array_bytes(value)
            self.buffers.append(raw)
            return _array_ext(dtype, shape, len(self.buffers) - 1)
        if isinstance(value, np.generic):
            return value.item()
        raise TypeError(f"{type(value).__name__} is not serialisable")


_ENCODERS = _EncoderState()


def _array_ext(dtype: str, shape: tuple[int, ...], index: int) -> msgspec.msgpack.Ext:
    """The msgpack extension that stands for an array in a header (see `_ARRAY_EXT`).
    Packed afresh for each array: as cheap as a dictionary hit, and the (dtype, shape,
    frame) of a completion's arrays seldom recur (their lengths vary), so a cache of them
    mostly missed, and a miss cost several times a packing."""
    return msgspec.msgpack.Ext(_ARRAY_EXT, msgspec.msgpack.encode((dtype, shape, index)))


# ---------------------------------------------------------------------------------------------
# Decoding


class _ArrayRef(typing.NamedTuple):  # a tuple: built for every array of every message
    dtype: str
    shape: tuple[int, ...]
    index: int  # type: ignore[assignment]  # shadows tuple.index, which is never called


_ALLOWED_DTYPES = frozenset(_NUMPY_DTYPES + _TORCH_ONLY_DTYPES)


_REF_CACHE: dict[bytes, _ArrayRef] = {}
_REF_CACHE_ITEMS = 1 << 16
_REF_CACHE_KEY_BYTES = 32
"""Array references already accepted, by their bytes: a reference is a pure function of
them. Those of small arrays recur across the tens of thousands of messages a step carries
(a Completions' version runs: a handful of lengths); those of token arrays, whose lengths
are the completions', mostly miss, and a miss parses the reference (`_array_ref`).
Bounded: short keys only, emptied when full."""


def _ext_hook(code: int, data: bytes) -> Any:
    ref = _REF_CACHE.get(data) if code == _ARRAY_EXT else None
    if ref is None:
        ref = _array_ref(code, data)
        if len(data) <= _REF_CACHE_KEY_BYTES:
            if len(_REF_CACHE) >= _REF_CACHE_ITEMS:
                _REF_CACHE.clear()
            _REF_CACHE[data] = ref
    return ref


def _array_ref(code: int, data: bytes) -> _ArrayRef:
    """Parse and check one array reference (every check of `_ext_hook`, uncached)."""
    if code != _ARRAY_EXT:
        raise MessageError(f"unknown msgpack extension type {code}")
    try:
        dtype, shape, index = msgpack.unpackb(data)
        if type(shape) is list and len(shape) == 1 and type(shape[0]) is int:
            shape = (shape[0],)  # what the general conversion below gives, without a loop
        else:
            shape = tuple(int(s) for s in shape)
        ref = _ArrayRef(str(dtype), shape, int(index))
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as err:
        raise MessageError(f"malformed array reference: {err}") from None
    if ref.dtype not in _ALLOWED_DTYPES:
        raise MessageError(f"array dtype {ref.dtype!r} is not allowed")
    if len(ref.shape) > MAX_DEPTH:
        raise MessageError(f"array of {len(ref.shape)} dimensions; at most {MAX_DEPTH}")
    if ref.index < 0 or (ref.shape and min(ref.shape) < 0):
        raise MessageError(f"array reference with negative shape or index: {ref}")
    return ref


def _view(frame: Any) -> memoryview:
    """The bytes of a received frame: a zmq Frame's `buffer`, or a view of a bytes-like
    object. A memoryview or bytes is told by its type: `hasattr` on them raises and
    catches an AttributeError, which showed in profiles (every frame of every message)."""
    if type(frame) is memoryview:
        return frame
    if type(frame) is bytes:
        return memoryview(frame)
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _build_array(ref: _ArrayRef, frames: Sequence[Any], as_tensor: bool, where: str) -> Any:
    if ref.index >= len(frames):
        raise MessageError(f"{where}: array frame {ref.index} missing (message truncated?)")
    buf = frames[ref.index]
    buf = _view(buf)
    count = math.prod(ref.shape)
    if not as_tensor and ref.dtype in _TORCH_ONLY_DTYPES:
        raise MessageError(f"{where}: dtype {ref.dtype} needs a tensor field, not a numpy one")
    if as_tensor:
        torch = torch_module()
        dtype = getattr(torch, ref.dtype)
        itemsize = torch.empty(0, dtype=dtype).element_size()
    else:
        dtype = _NUMPY_DTYPE_OBJECTS[ref.dtype]
        itemsize = dtype.itemsize
    if buf.nbytes != count * itemsize:
        raise MessageError(
            f"{where}: frame holds {buf.nbytes} bytes but {ref.dtype}{list(ref.shape)} needs "
            f"{count * itemsize}"
        )
    if not as_tensor:
        return _numpy_view(buf, dtype, count, ref.shape)
    if count == 0:
        return torch.empty(ref.shape, dtype=dtype)
    import warnings

    with warnings.catch_warnings():  # bytes objects are read-only buffers; consumers copy out
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count).reshape(ref.shape)


def _numpy_view(buf: memoryview, dtype: np.dtype, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """`buf` (checked to hold `count` items) as an array of `shape`, no copy. Positional
    arguments: keywords made `frombuffer` take twice as long."""
    array = np.frombuffer(buf, dtype, count)
    return array if len(shape) == 1 else array.reshape(shape)  # 1-d: already its shape


def _check(value: Any, annotation: Any, frames: Sequence[Any], where: str, used: set[int]) -> Any:
    """Validate `value` against `annotation`, rebuilding arrays; returns the typed value."""
    if type(value) is annotation:  # a scalar of exactly the declared type (the common case)
        return value
    origin, args = _origin_args(annotation)
    if annotation is Any:
        return _plain(value, where)
    if origin in (typing.Union, types.UnionType):
        options = args
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _check(value, inner, frames, where, used)
    if annotation in (np.ndarray, Tensor):
        if not isinstance(value, _ArrayRef):
            raise MessageError(f"{where}: expected an array, got {type(value).__name__}")
        if value.index in used:
            raise MessageError(f"{where}: array frame {value.index} referenced twice")
        used.add(value.index)
        return _build_array(value, frames, annotation is Tensor, where)
    if origin is list:
        (inner,) = args
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list, got {type(value).__name__}")
        if inner in _SCALARS and all(type(v) is inner for v in value):
            return value  # e.g. request ids, token ids: nothing to rebuild or convert
        return [_check(v, inner, frames, f"{where}[{i}]", used) for i, v in enumerate(value)]
    if origin is dict:
        key_type, value_type = args
        if not isinstance(value, dict) or not all(isinstance(k, key_type) for k in value):
            raise MessageError(f"{where}: expected a mapping with {key_type.__name__} keys")
        return {k: _check(v, value_type, frames, f"{where}.{k}", used) for k, v in value.items()}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        try:
            return annotation(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in annotation)
            raise MessageError(f"{where}: {value!r} is not one of {allowed}") from None
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float, str, bool, bytes):
        if type(value) is not annotation:
            raise MessageError(
                f"{where}: expected {annotation.__name__}, got {type(value).__name__}"
            )
        return value
    raise MessageError(f"{where}: unsupported annotation {annotation!r}")


FieldCheck = typing.Callable[[Any, Sequence[Any], str, set], Any]


@functools.cache
def _field_check(annotation: Any) -> FieldCheck:
    """`_check` specialised once for `annotation`. What a well-behaved peer sends (a scalar of
    the declared type, an array reference, an enum's value, a list of plain scalars, None
    for an optional field) takes a short path; anything else (a conversion, an error) goes
    through `_check` itself. So both accept, convert and refuse exactly the same values,
    with the same errors (tests/areal/test_codec_fast_path.py). The controller decodes
    every Generated and Scored (tens of thousands of messages per step at cluster scale)."""

    def general(value: Any, frames: Sequence[Any], where: str, used: set) -> Any:
        return _check(value, annotation, frames, where, used)

    origin, args = _origin_args(annotation)
    if annotation in (int, float, str, bool, bytes):

        def scalar(value, frames, where, used):
            return value if type(value) is annotation else general(value, frames, where, used)

        return scalar
    if annotation is np.ndarray:

        def array(value, frames, where, used):
            # A reference to an unused frame of a numpy dtype, of the size it says: a view
            # of it. Anything else, `_check` decides (and words the refusal).
            if type(value) is _ArrayRef and value.index not in used and value.index < len(frames):
                dtype = _NUMPY_DTYPE_OBJECTS.get(value.dtype)
                buf = frames[value.index]
                count = math.prod(value.shape)
                if (
                    dtype is not None
                    and type(buf) is memoryview
                    and buf.nbytes == count * dtype.itemsize
                ):
                    used.add(value.index)
                    return _numpy_view(buf, dtype, count, value.shape)
            return general(value, frames, where, used)

        return array
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        members = {m.value: m for m in annotation if type(m.value) is str}

        def member(value, frames, where, used):
            found = members.get(value) if type(value) is str else None
            return found if found is not None else general(value, frames, where, used)

        return member
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        inner_check = _field_check(inner)

        def optional(value, frames, where, used):
            return None if value is None else inner_check(value, frames, where, used)

        return optional
    if origin is list and args[0] in _SCALARS:
        (inner,) = args
        only_inner = frozenset({inner})

        def scalars(value, frames, where, used):
            if type(value) is list and only_inner.issuperset(map(type, value)):
                return value
            return general(value, frames, where, used)

        return scalars
    return general


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """Plain data only (an untyped field must not smuggle array references), nested at most
    MAX_DEPTH deep."""
    if isinstance(value, _ArrayRef):
        raise MessageError(f"{where}: unexpected array in an untyped field")
    if isinstance(value, (list, dict)) and depth >= MAX_DEPTH:
        raise MessageError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        return [_plain(v, where, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v, where, depth + 1) for k, v in value.items()}
    return value


def decode(
    frames: Sequence[Any],
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    only: Collection[MsgType] | None = None,
    compiled: bool = True,
) -> Any:
    """Rebuild a message from its frames (without the ROUTER identity). Raises MessageError.
    `only`: the kinds accepted; any other is refused on its type byte, nothing else read.
    `compiled`: try msgspec's checks first (areal.codec_fast), which accept and refuse what
    the Python path does; False: the Python path alone (sim/speed.py's yardstick)."""
    if len(frames) < 2:
        raise MessageError(f"message has {len(frames)} frame(s); at least 2 expected")
    first = _view(frames[0])
    kind = _KINDS.get(first.tobytes()[0]) if first.nbytes == 1 else None  # any view format
    if kind is None:
        raise MessageError(f"unknown message type {first[:8].tobytes()!r}")
    if only is not None and kind not in only:
        raise MessageError(
            f"{kind.name} refused unread: only {', '.join(k.name for k in only)} accepted here",
            reason="not accepted",
        )
    if len(frames) == 2 and kind in _ALL_DEFAULTS:
        header = _view(frames[1])
        if header.nbytes == 1 and header.tobytes() == _EMPTY_MAP:
            return _ALL_DEFAULTS[kind]()
    limit = header_limit(kind)
    if len(frames) - 2 > limit.max_items:
        raise MessageError(
            f"{kind.name}: {len(frames) - 2} array frames; at most {limit.max_items}",
            reason="too large",
        )
    raw = list(map(_view, frames))
    total = sum(map(_NBYTES, raw))
    if total > max_bytes:
        raise MessageError(
            f"{kind.name}: message of {total} bytes exceeds the {max_bytes}-byte limit",
            reason="too large",
        )
    if raw[1].nbytes > limit.max_bytes:
        raise MessageError(
            f"{kind.name}: header of {raw[1].nbytes} bytes exceeds the "
            f"{limit.max_bytes}-byte limit of its kind",
            reason="too large",
        )
    schema = SCHEMAS[kind]
    if compiled:
        message = decode_header(schema, raw[1], raw[2:], limit, _NUMPY_DTYPE_OBJECTS, _ext_hook)
        if message is not None:
            return message
    try:
        header = msgpack.unpackb(
            raw[1],
            ext_hook=_ext_hook,
            raw=False,
            strict_map_key=True,
            max_map_len=limit.max_items,
            max_array_len=limit.max_items,
            max_str_len=limit.max_bytes,
            max_bin_len=limit.max_bytes,
            max_ext_len=1024,
        )
    except MessageError as err:
        raise MessageError(f"{kind.name}: {err}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise MessageError(f"{kind.name}: header is not valid msgpack ({err})") from None
    if not isinstance(header, dict):
        raise MessageError(f"{kind.name}: header is a {type(header).__name__}, not a mapping")
    return _build(schema, header, raw[2:])


_KINDS = {kind.value: kind for kind in MsgType}
_NBYTES = operator.attrgetter("nbytes")


@functools.cache
def _schema_fields(
    schema: Any,
) -> tuple[list[tuple[str, FieldCheck, bool, str, frozenset]], frozenset[str]]:
    """([(field, its check, required, where, types taken as they are)], names) of a schema,
    resolved once: `get_type_hints` alone cost about two thirds of decoding a small message."""
    hints = typing.get_type_hints(schema)
    fields = [
        (
            f.name,
            _field_check(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            f"{schema.KIND.name}.{f.name}",
            _taken_as_is(hints[f.name]),
        )
        for f in wire_fields(schema)
    ]
    return fields, frozenset(f[0] for f in fields)


@functools.cache
def _taken_as_is(annotation: Any) -> frozenset[type]:
    """Types of value that `_field_check(annotation)` returns unchanged, with nothing to
    check (a scalar of the declared type, None for an optional field, a plain scalar for an
    untyped one): decoding takes them without calling it, most fields of every message."""
    if annotation is Any:
        return frozenset(_SCALARS)
    if annotation in (int, float, str, bool, bytes):
        return frozenset({annotation})
    origin, args = _origin_args(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return frozenset({type(None)}) | _taken_as_is(inner)
    return frozenset()


def _build(schema: type, header: dict[str, Any], frames: Sequence[memoryview]) -> Any:
    """The message of `header`'s fields, each checked against its schema's type. A header
    that is all well-formed (every message a worker sends) takes the loop over its own
    fields, not over all of the schema's (a Generated sends 5-7 of 17); anything that fails
    there is decided again by `_build_checked`, field by field in the schema's order, which
    raises the error (tests/areal/test_codec_fast_path.py holds the two to each other)."""
    by_name, required = _schema_lookup(schema)
    if required <= header.keys():
        values: dict[str, Any] = {}
        used: set[str] = set()
        try:
            for fname, value in header.items():
                check, where, as_is = by_name[fname]
                values[fname] = value if type(value) in as_is else check(value, frames, where, used)
        except (KeyError, MessageError):
            pass  # an unknown field or a refused value: worded below
        else:
            if len(used) == len(frames):
                return schema(**values)
    return _build_checked(schema, header, frames)


@functools.cache
def _schema_lookup(
    schema: type,
) -> tuple[dict[str, tuple[FieldCheck, str, frozenset]], frozenset[str]]:
    """({field: (its check, where, types taken as they are)}, required fields)."""
    fields, _ = _schema_fields(schema)
    return (
        {name: (check, where, as_is) for name, check, _, where, as_is in fields},
        frozenset(name for name, _, required, _, _ in fields if required),
    )


def _build_checked(schema: Any, header: dict[str, Any], frames: Sequence[memoryview]) -> Any:
    name = schema.KIND.name
    fields, names = _schema_fields(schema)
    if not names.issuperset(header):
        raise MessageError(f"{name}: unknown field(s) {sorted(set(header) - names)}")
    values: dict[str, Any] = {}
    used: set[str] = set()
    for fname, check, required, where, as_is in fields:
        if fname not in header:
            if required:
                raise MessageError(f"{name}: required field {fname!r} missing")
            continue
        value = header[fname]
        values[fname] = value if type(value) in as_is else check(value, frames, where, used)
    if len(used) != len(frames):
        raise MessageError(f"{name}: {len(frames)} array frames sent, {len(used)} referenced")
    return schema(**values)


_EMPTY_MAP = msgpack.packb({})
_ALL_DEFAULTS = {
    kind: schema
    for kind, schema in SCHEMAS.items()
    if not any(required for _, _, required, _, _ in _schema_fields(schema)[0])
}
"""The kinds whose every field has a default, by schema: an empty header is all of them
(decoded without reading it further: a Heartbeat, the most frequent message at cluster
scale, is one)."""
