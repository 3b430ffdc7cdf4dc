"""Every cross-process message: one typed schema per kind, one wire framing, no pickle.

Framing of a message (after the ROUTER identity frame, when there is one):

    [type byte][msgpack header][raw array frame 0][raw array frame 1]...

The header is a msgpack map of the schema's fields, less those at their defaults (the
decoder fills them in). Arrays (numpy, or torch tensors of any dtype including bfloat16)
are not in the header: each is replaced by a msgpack extension (dtype, shape, frame index)
and travels as its own frame, sent with `copy=False` and rebuilt with `frombuffer` on
arrival (views of the received buffers, no copy).

Decoding trusts nothing: an unknown type byte, bytes that are not msgpack, a missing,
unknown or mistyped field, a dtype outside the allow-list, a frame whose size does not match
its dtype and shape, a missing or surplus frame, or a message over the size limit raises
`MessageError` naming the message kind and the field. Decoding never executes code, and its
cost is bounded per message: each kind bounds its header (`HEADER_LIMITS`: bytes, list and
map lengths, nesting) and its number of frames, checked before the header is unpacked; a
caller may accept only some kinds (`only`), checked on the type byte alone.

This module imports nothing heavy: torch is imported only when a tensor field is decoded.
It does not open sockets (see `areal.transport`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import threading
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

import msgpack
import numpy as np

from areal.tasks.base import Verdict

_ARRAY_EXT = 1
"""msgpack extension code of an array reference: packb([dtype, shape, frame index])."""

DEFAULT_MAX_BYTES = 2 << 30
"""Largest message accepted by default (header and frames together)."""

REGISTER_MAX_BYTES = 4096
"""Largest Register (frames together): all an unregistered peer may send (transport.py)."""

MAX_DEPTH = 32
"""Deepest nesting of lists and maps in an untyped (Any) field."""

_NUMPY_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                 "uint64", "float16", "float32", "float64")
_TORCH_ONLY_DTYPES = ("bfloat16",)


class MessageError(ValueError):
    """A message could not be encoded or decoded; the text says which kind and which field.
    `reason` is one of a few short keys (malformed, too large, not accepted) for counting."""

    def __init__(self, text: str, reason: str = "malformed") -> None:
        super().__init__(text)
        self.reason = reason


class MsgType(enum.IntEnum):
    REGISTER = 1
    WELCOME = 2
    HEARTBEAT = 3
    GENERATE = 4
    GENERATED = 5
    UPDATE_WEIGHTS = 6
    WEIGHTS_CHUNK = 7
    WEIGHTS_UPDATED = 8
    TRAIN = 9
    TRAINED = 10
    SCORE = 11
    SCORED = 12
    SHUTDOWN = 13
    WORKER_ERROR = 14
    CANCEL = 15
    READY = 16
    JOIN_GROUP = 17
    GROUP_STATUS = 18
    BROADCAST_WEIGHTS = 19


class WorkerKind(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"
    REWARD = "reward"


class GroupName(str, enum.Enum):
    """torch.distributed process groups the controller forms among workers."""

    TRAINER = "trainer"
    """The data-parallel trainer ranks (each rank's default process group)."""
    WEIGHTS = "weights"
    """Trainer rank 0 (rank 0, the sender) and the rollout workers: collective weight sync."""


class GroupState(str, enum.Enum):
    JOINED = "joined"
    FAILED = "failed"


class FinishReason(str, enum.Enum):
    """Why a generation ended. ABORT only ever appears for a partial, interrupted segment."""

    STOP = "stop"
    """An end-of-sequence or stop token was sampled (it is the last token)."""
    LENGTH = "length"
    """The token budget ran out."""
    ABORT = "abort"
    """Interrupted (pause for new weights, or cancellation); tokens so far are returned."""


class EpisodeEnd(str, enum.Enum):
    """How a multi-turn episode ended (areal.tasks.environment). Each ending carries its
    reward and verdict in Generated."""

    ENVIRONMENT = "environment"
    """The environment ended it with a reward (the model answered, or the environment chose)."""
    TURN_LIMIT = "turn_limit"
    """The model used episode.max_turns turns and the environment still expected more:
    reward 0, verdict no_answer."""
    TOKEN_LIMIT = "token_limit"
    """The episode's token budget (rollout.max_new_tokens after the prompt) ran out, or the
    next observation did not fit in it: reward 0, verdict no_answer."""
    ERROR = "error"
    """The environment failed (raised, or took longer than episode.step_timeout_s): reward
    0, verdict error or timeout; the episode is kept, never lost."""


Tensor = typing.NewType("Tensor", object)
"""Annotation for a torch tensor field: any dtype, rebuilt with torch.frombuffer."""

_SCHEMAS: dict[MsgType, type] = {}


def message(kind: MsgType):
    """Register a dataclass as the schema of one message kind."""

    def register(cls: type) -> type:
        if kind in _SCHEMAS:
            raise TypeError(f"message kind {kind.name} registered twice")
        cls.KIND = kind
        _SCHEMAS[kind] = cls
        return cls

    return register


# ---------------------------------------------------------------------------------------------
# Schemas. Shapes: T = completion tokens, P = prompt tokens, N = packed tokens, S = sequences.


@message(MsgType.REGISTER)
@dataclass(kw_only=True)
class Register:
    """Worker -> controller, first message on a new connection."""

    kind: WorkerKind
    worker_id: str
    pid: int
    host: str
    secret: str
    """Shared secret of the run; a wrong one gets the peer refused and logged."""
    rank: int = 0
    """Trainer rank (data-parallel index); 0 for other kinds."""


@message(MsgType.WELCOME)
@dataclass(kw_only=True)
class Welcome:
    """Controller -> worker: the resolved run config and where the policy stands."""

    config: dict[str, Any]
    version: int
    """Current policy version; the worker must serve these weights before taking work."""
    weights_path: str | None = None
    """Directory of the current weights when they differ from the config's model (disk)."""
    run_dir: str = ""
    checkpoint: str = ""
    """Trainer only: the checkpoint to resume from (areal.workers.trainer.checkpoint); empty:
    start from the config's model at version 0."""


@message(MsgType.READY)
@dataclass(kw_only=True)
class Ready:
    """Worker -> controller: set up (model loaded) and serving policy `version`; send work."""

    version: int = 0
    store: str = ""
    """Trainer rank 0 when process groups are used: "host:port" of the TCPStore it hosts,
    where groups meet (JoinGroup.store); empty otherwise."""


@message(MsgType.HEARTBEAT)
@dataclass(kw_only=True)
class Heartbeat:
    """Both directions, every `controller.heartbeat_interval_s`: each side declares the other
    lost after `controller.heartbeat_timeout_s` of silence."""

    num_running: int = 0
    stats: dict[str, float] = field(default_factory=dict)


@message(MsgType.GENERATE)
@dataclass(kw_only=True)
class Generate:
    """Controller -> rollout worker: sample one completion."""

    request_id: str
    prompt_ids: np.ndarray
    """[P] int32 prompt tokens."""
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_id: str = ""
    """Episodes only (episode.environment set): the task's prompt id, for the environment."""
    reference: Any = None
    """Episodes only: the prompt's reference (plain data) the environment rewards against."""


@message(MsgType.GENERATED)
@dataclass(kw_only=True)
class Generated:
    """Rollout worker -> controller: a finished completion with per-token provenance."""

    request_id: str
    output_ids: np.ndarray
    """[T] int32 sampled tokens."""
    logprobs: np.ndarray
    """[T] float32 behaviour log-probs (of the distribution actually sampled from)."""
    versions: np.ndarray
    """[T] int32 policy version that sampled each token."""
    finish_reason: FinishReason
    num_interruptions: int = 0
    generation_s: float = 0.0
    # -- episodes (multi-turn, areal.tasks.environment); defaults describe one completion --
    loss_mask: np.ndarray | None = None
    """[T] bool: True for tokens the model sampled (trained on), False for observation
    tokens an environment inserted, which carry version -1 (PROMPT_VERSION) and log-prob 0.
    None: every token was sampled (a single completion)."""
    episode_end: EpisodeEnd | None = None
    """How the episode ended; None: not an episode (the reward workers score it)."""
    reward: float = 0.0
    """Episodes: the reward the episode ended with (the controller does not score it again)."""
    verdict: Verdict | None = None
    """Episodes: the verdict that goes with `reward`."""
    detail: str = ""
    num_turns: int = 1
    """Model turns in the episode."""
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    """Tool calls that failed (bad call, unknown tool, error, timeout): each became an
    observation saying so."""
    tool_s: float = 0.0
    """Seconds the environment took to answer, summed over turns."""


@message(MsgType.CANCEL)
@dataclass(kw_only=True)
class Cancel:
    """Controller -> rollout worker: drop these requests (their results are not wanted)."""

    request_ids: list[str]


@message(MsgType.UPDATE_WEIGHTS)
@dataclass(kw_only=True)
class UpdateWeights:
    """Controller -> rollout worker: serve policy `version` from now on."""

    version: int
    mode: str
    """'disk' (read `path`), 'stream' (`num_chunks` WeightsChunk messages follow) or
    'collective' (join the broadcast group)."""
    path: str | None = None
    num_chunks: int = 0
    interrupt: bool = True
    """Interrupt in-flight sequences (async mode) or let them finish first."""
    generation: int = 0
    """Collective: the weights-group generation the broadcast runs in (see JoinGroup)."""
    manifest: list[dict[str, Any]] = field(default_factory=list)
    """Collective: the buckets to receive, in order; each {"num_bytes": int, "tensors":
    [[name, dtype, shape, byte offset, num_bytes], ...]} (areal.models.weights.TensorSpec)."""


@message(MsgType.WEIGHTS_CHUNK)
@dataclass(kw_only=True)
class WeightsChunk:
    """Trainer -> controller -> rollout workers: one bucket of a weight version (stream)."""

    version: int
    index: int
    num_chunks: int
    names: list[str]
    tensors: list[Tensor]


@message(MsgType.WEIGHTS_UPDATED)
@dataclass(kw_only=True)
class WeightsUpdated:
    """Rollout worker -> controller: now serving `version`; or, with `error`, loading
    `version` failed and the worker still serves its previous weights (the controller sends
    the newest version again)."""

    version: int
    pause_s: float = 0.0
    """Seconds from the interruption to resumed generation."""
    num_interrupted: int = 0
    error: str = ""


@message(MsgType.TRAIN)
@dataclass(kw_only=True)
class Train:
    """Controller -> trainer: one training step on a packed batch (see areal.types.PackedBatch)."""

    step: int
    version: int
    """Policy version of the trainer's weights before this step (i); publishes i + 1."""
    token_ids: np.ndarray  # [N] int32
    logprobs: np.ndarray  # [N] float32
    versions: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] bool
    cu_seqlens: np.ndarray  # [S+1] int32
    rewards: np.ndarray  # [S] float32
    group_ids: np.ndarray  # [S] int64
    advantages: np.ndarray | None = None
    """[S] float32 per-sequence advantages computed over the global batch (a data-parallel
    shard cannot compute group baselines); None: computed from this message's rewards."""
    minibatch_sizes: list[int] = field(default_factory=list)
    """Sequences of each PPO minibatch in this message, in order (every rank of a step
    lists the same number of minibatches, some possibly 0); empty: the trainer cuts the
    batch into trainer.num_minibatches itself."""
    minibatch_loss_tokens: list[int] = field(default_factory=list)
    """Loss tokens of each minibatch over all ranks: the loss normaliser of that minibatch's
    optimiser step."""
    minibatch_loss_seqs: list[int] = field(default_factory=list)
    """Sequences with loss tokens of each minibatch over all ranks: the normaliser of the
    sequence-mean loss aggregations (trainer.ppo.loss_agg_mode)."""
    replay: bool = False
    """A step already trained and published before the trainer was lost, sent again after
    its restart from a checkpoint: train it, publish nothing."""


@message(MsgType.TRAINED)
@dataclass(kw_only=True)
class Trained:
    """Trainer -> controller: the step is done and weights `version` are published."""

    step: int
    version: int
    stats: dict[str, float]
    weights_path: str | None = None
    num_chunks: int = 0
    """Stream mode: WeightsChunk messages sent after this one."""
    manifest: list[dict[str, Any]] = field(default_factory=list)
    """Collective mode: the buckets rank 0 will broadcast (see UpdateWeights.manifest)."""
    rank: int = 0
    """Data-parallel rank that sent this; every rank answers each Train (rank 0 with the
    published weights), with the same reduced stats."""
    replay: bool = False
    """Answers a replayed Train: nothing was published."""
    checkpoint: str = ""
    """Rank 0: the trainer checkpoint this step saved (trainer.checkpoint_every), if any."""


@message(MsgType.JOIN_GROUP)
@dataclass(kw_only=True)
class JoinGroup:
    """Controller -> worker: join a torch.distributed process group (leaving any earlier
    generation of it). The worker answers GroupStatus."""

    group: GroupName
    generation: int
    """Increases each time the controller (re)forms this group; members of older
    generations are abandoned (the weights group is re-formed when its members change)."""
    rank: int
    world_size: int
    backend: str
    """'gloo' or 'nccl'."""
    store: str
    """"host:port" of the TCPStore hosted by trainer rank 0 (Ready.store)."""
    timeout_s: float = 600.0
    """Rendezvous and collective timeout of the group."""


@message(MsgType.GROUP_STATUS)
@dataclass(kw_only=True)
class GroupStatus:
    """Worker -> controller: the outcome of a JoinGroup, or a failed collective in a group."""

    group: GroupName
    generation: int
    state: GroupState
    error: str = ""


@message(MsgType.BROADCAST_WEIGHTS)
@dataclass(kw_only=True)
class BroadcastWeights:
    """Controller -> trainer rank 0: broadcast published version `version` in weights-group
    `generation` (the rollout workers got the matching UpdateWeights)."""

    version: int
    generation: int


@message(MsgType.SCORE)
@dataclass(kw_only=True)
class Score:
    """Controller -> reward worker: score completions of one prompt, together.

    A group's samples are sent in one message once all of them are generated (a retried
    check alone): one message per group instead of one per sample, which halved the
    messages the controller handles at 512 accelerators (README, table f)."""

    request_ids: list[str]
    prompt_id: str
    completion_ids: list[np.ndarray]
    """[T] int32 completion tokens of each request, in order (decoded by the worker's
    tokenizer)."""
    reference: Any


@message(MsgType.SCORED)
@dataclass(kw_only=True)
class Scored:
    """Reward worker -> controller: the outcome of each completion of one Score, in order."""

    request_ids: list[str]
    rewards: list[float]
    verdicts: list[Verdict]
    details: list[str]
    check_s: list[float]


@message(MsgType.SHUTDOWN)
@dataclass(kw_only=True)
class Shutdown:
    """Controller -> worker: exit (exit code 0; REJOIN_EXIT_CODE when `rejoin`)."""

    reason: str = ""
    rejoin: bool = False
    """The run goes on without this process, but needs it back: start it again (a trainer
    rank whose group lost a member resumes from the newest checkpoint)."""
    final: bool = False
    """The run finished: write its final artifacts (trainer rank 0: `final_model`). A worker
    never writes them on its own (a lost controller, a failed run, a restart)."""


REJOIN_EXIT_CODE = 75
"""Exit code of a worker told to stop and be started again (EX_TEMPFAIL)."""


@message(MsgType.WORKER_ERROR)
@dataclass(kw_only=True)
class WorkerError:
    """Worker -> controller: something failed. `request_id` names the work item if any."""

    error: str
    fatal: bool = False
    request_id: str = ""
    request_ids: list[str] = field(default_factory=list)
    """Every request of the failed work item when it held several (a reward worker's Score,
    a group's): the controller checks each again elsewhere."""


@dataclass(frozen=True)
class HeaderLimit:
    """What one kind's header may hold; checked before it is unpacked."""

    max_bytes: int
    """Largest msgpack header (strings and binaries are bounded by it too)."""
    max_items: int
    """Longest list or map anywhere in the header, and most array frames."""


_SMALL = HeaderLimit(64 << 10, 256)
HEADER_LIMITS: dict[MsgType, HeaderLimit] = {
    MsgType.REGISTER: HeaderLimit(REGISTER_MAX_BYTES, 16),
    MsgType.HEARTBEAT: HeaderLimit(64 << 10, 1024),  # stats: a few dozen numbers
    MsgType.WELCOME: HeaderLimit(16 << 20, 1 << 16),  # the resolved run config
    MsgType.GENERATE: HeaderLimit(1 << 20, 1 << 16),  # stop token ids
    MsgType.UPDATE_WEIGHTS: HeaderLimit(64 << 20, 1 << 20),  # collective: every tensor's spec
    MsgType.WEIGHTS_CHUNK: HeaderLimit(16 << 20, 1 << 20),  # a bucket's tensor names and refs
    MsgType.TRAIN: HeaderLimit(1 << 20, 1 << 16),  # minibatch lists
    MsgType.TRAINED: HeaderLimit(64 << 20, 1 << 20),  # stats, collective manifest
    MsgType.SCORE: HeaderLimit(256 << 20, 1 << 22),  # reference: a code problem's unit tests
    MsgType.SCORED: HeaderLimit(16 << 20, 1 << 16),  # a group's outcomes and checkers' messages
    MsgType.WORKER_ERROR: HeaderLimit(1 << 20, 1 << 12),  # a traceback, a group's request ids
    MsgType.CANCEL: HeaderLimit(16 << 20, 1 << 20),  # request ids
}
"""Per-kind header bounds; kinds not listed hold a few scalars (`_SMALL`)."""


def header_limit(kind: MsgType) -> HeaderLimit:
    return HEADER_LIMITS.get(kind, _SMALL)


# ---------------------------------------------------------------------------------------------
# Encoding


def _array_bytes(value: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, contiguous byte view) of a numpy array or torch tensor."""
    if isinstance(value, np.ndarray):
        arr = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d shape
        name = _DTYPE_NAMES.get(arr.dtype)  # dtype.name is slow: it showed in profiles
        if name is None:
            raise MessageError(f"array dtype {arr.dtype} cannot travel; allowed: {_NUMPY_DTYPES}")
        return name, arr.shape, memoryview(arr).cast("B")
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
_SCALAR_TYPES = frozenset(_SCALARS)
"""For `_SCALAR_TYPES.issuperset(map(type, values))`: a list's element types checked in C,
2.6x faster than a generator over it for a Generate's 300 prompt token ids."""


_REQUIRED = object()


@functools.cache
def _field_defaults(schema: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each field of `schema`; `_REQUIRED` for a field without one."""
    out = []
    for f in dataclasses.fields(schema):
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
    if kind is None or _SCHEMAS.get(kind) is not type(msg):
        raise MessageError(f"{type(msg).__name__} is not a registered message schema")
    buffers: list[memoryview] = []
    header = {}
    for name, default in _field_defaults(type(msg)):
        value = getattr(msg, name)
        # A field at its default is left out (the decoder fills it in): a Generated of one
        # completion carries 5-7 of its 17 fields. Same type only: 0 is not taken for False.
        if type(value) is type(default) and value == default:
            continue
        # Most fields are plain scalars: no call for them (every Generate and Score).
        header[name] = value if type(value) in _SCALARS else _pack_value(value, buffers)
    try:
        packed = _packer().pack(header)
    except TypeError as err:
        raise MessageError(f"{kind.name}: a field is not serialisable: {err}") from None
    return [bytes([kind]), packed, *buffers]


_PACKERS = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's reusable Packer: `msgpack.packb` builds a new one (and its buffer) per
    call, which cost the replayed controller at 512 accelerators 7% of its time for the
    small array references alone (py-spy, 2026-12-02); `pack` resets it after each use."""
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer()
    return packer


_EXT_CACHE: dict[tuple[str, tuple[int, ...], int], msgpack.ExtType] = {}
_EXT_CACHE_ITEMS = 1 << 16
"""Array references already packed, by (dtype, shape, frame index): the same few recur
across a step's messages (each of a group's 16 Generates carries its prompt's). Bounded:
emptied when full. The decoding side keeps the same kind of cache (`_REF_CACHE`)."""


def _array_ext(dtype: str, shape: tuple[int, ...], index: int) -> msgpack.ExtType:
    """The msgpack extension that stands for an array in a header (see `_ARRAY_EXT`)."""
    key = (dtype, shape, index)
    ext = _EXT_CACHE.get(key)
    if ext is None:
        if len(_EXT_CACHE) >= _EXT_CACHE_ITEMS:
            _EXT_CACHE.clear()
        ext = _EXT_CACHE[key] = msgpack.ExtType(_ARRAY_EXT, _packer().pack([dtype, list(shape),
                                                                            index]))
    return ext


def _pack_value(value: Any, buffers: list[memoryview]) -> Any:
    """`value` as msgpack can hold it; each array becomes a reference to a frame appended to
    `buffers`."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
        dtype, shape, raw = _array_bytes(value)
        buffers.append(raw)
        return _array_ext(dtype, shape, len(buffers) - 1)
    if isinstance(value, enum.Enum):
        return value.value
    if type(value) is list and _SCALAR_TYPES.issuperset(map(type, value)):
        return value  # e.g. stop token ids, request ids: msgpack packs them as they are
    if isinstance(value, (list, tuple)):
        return [_pack_value(v, buffers) for v in value]
    if isinstance(value, dict):
        return {k: _pack_value(v, buffers) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


# ---------------------------------------------------------------------------------------------
# Decoding


class _ArrayRef(typing.NamedTuple):  # a tuple: built for every array of every message
    dtype: str
    shape: tuple[int, ...]
    index: int


_ALLOWED_DTYPES = frozenset(_NUMPY_DTYPES + _TORCH_ONLY_DTYPES)


_REF_CACHE: dict[bytes, _ArrayRef] = {}
_REF_CACHE_ITEMS = 1 << 16
_REF_CACHE_KEY_BYTES = 32
"""Array references already accepted, by their bytes: a reference is a pure function of
them, and the same few (dtype, length, frame) recur across the tens of thousands of
messages a step carries. Bounded: short keys only, emptied when full."""


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
        array = np.frombuffer(buf, dtype=dtype, count=count)  # 1-d: already its shape
        return array if len(ref.shape) == 1 else array.reshape(ref.shape)
    if count == 0:
        return torch.empty(ref.shape, dtype=dtype)
    import warnings

    with warnings.catch_warnings():  # bytes objects are read-only buffers; consumers copy out
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count).reshape(ref.shape)


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
                f"{where}: expected {annotation.__name__}, got {type(value).__name__}")
        return value
    raise MessageError(f"{where}: unsupported annotation {annotation!r}")


FieldCheck = typing.Callable[[Any, Sequence[Any], str, set], Any]


@functools.cache
def _field_check(annotation: Any) -> FieldCheck:
    """`_check` specialised once for `annotation`. What a well-behaved peer sends (a scalar of
    the declared type, an array reference, an enum's value, a list of plain scalars, None
    for an optional field) takes a short path; anything else (a conversion, an error) goes
    through `_check` itself. So both accept, convert and refuse exactly the same values,
    with the same errors (tests/areal/test_message_fast_path.py). The controller decodes
    every Generated and Scored (about 16,000 messages per step at 512 accelerators)."""

    def general(value: Any, frames: Sequence[Any], where: str, used: set) -> Any:
        return _check(value, annotation, frames, where, used)

    origin, args = _origin_args(annotation)
    if annotation in (int, float, str, bool, bytes):
        def scalar(value, frames, where, used):
            return value if type(value) is annotation else general(value, frames, where, used)
        return scalar
    if annotation is np.ndarray:
        def array(value, frames, where, used):
            if type(value) is _ArrayRef and value.index not in used:
                used.add(value.index)
                return _build_array(value, frames, False, where)
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


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES, *,
           only: Collection[MsgType] | None = None) -> Any:
    """Rebuild a message from its frames (without the ROUTER identity). Raises MessageError.
    `only`: the kinds accepted; any other is refused on its type byte, nothing else read."""
    if len(frames) < 2:
        raise MessageError(f"message has {len(frames)} frame(s); at least 2 expected")
    first = _view(frames[0])
    type_frame = first[:8].tobytes()
    kind = _KINDS.get(type_frame[0]) if first.nbytes == 1 else None
    if kind is None:
        raise MessageError(f"unknown message type {type_frame!r}")
    if only is not None and kind not in only:
        raise MessageError(f"{kind.name} refused unread: only "
                           f"{', '.join(k.name for k in only)} accepted here", reason="not accepted")
    limit = header_limit(kind)
    if len(frames) - 2 > limit.max_items:
        raise MessageError(f"{kind.name}: {len(frames) - 2} array frames; at most {limit.max_items}",
                           reason="too large")
    raw = [_view(f) for f in frames]
    total = sum(b.nbytes for b in raw)
    if total > max_bytes:
        raise MessageError(f"{kind.name}: message of {total} bytes exceeds the {max_bytes}-byte "
                           "limit", reason="too large")
    if raw[1].nbytes > limit.max_bytes:
        raise MessageError(f"{kind.name}: header of {raw[1].nbytes} bytes exceeds the "
                           f"{limit.max_bytes}-byte limit of its kind", reason="too large")
    schema = _SCHEMAS[kind]
    try:
        header = msgpack.unpackb(raw[1], ext_hook=_ext_hook, raw=False, strict_map_key=True,
                                 max_map_len=limit.max_items, max_array_len=limit.max_items,
                                 max_str_len=limit.max_bytes, max_bin_len=limit.max_bytes,
                                 max_ext_len=1024)
    except MessageError as err:
        raise MessageError(f"{kind.name}: {err}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise MessageError(f"{kind.name}: header is not valid msgpack ({err})") from None
    if not isinstance(header, dict):
        raise MessageError(f"{kind.name}: header is a {type(header).__name__}, not a mapping")
    return _build(schema, header, raw[2:])


_KINDS = {kind.value: kind for kind in MsgType}


@functools.cache
def _schema_fields(schema: type) -> tuple[list[tuple[str, FieldCheck, bool, str, frozenset]],
                                          frozenset[str]]:
    """([(field, its check, required, where, types taken as they are)], names) of a schema,
    resolved once: `get_type_hints` alone cost about two thirds of decoding a small message."""
    hints = typing.get_type_hints(schema)
    fields = [(f.name, _field_check(hints[f.name]), f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING, f"{schema.KIND.name}.{f.name}",
               _taken_as_is(hints[f.name]))
              for f in dataclasses.fields(schema)]
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
    name = schema.KIND.name
    fields, names = _schema_fields(schema)
    if not names.issuperset(header):
        raise MessageError(f"{name}: unknown field(s) {sorted(set(header) - names)}")
    values, used = {}, set()
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


def schemas() -> dict[MsgType, type]:
    """Every registered schema by kind (for tests and documentation)."""
    return dict(_SCHEMAS)
