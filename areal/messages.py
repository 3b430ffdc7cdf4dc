"""Every cross-process message: one typed schema per kind, and the bounds of each kind.

A message is a dataclass registered for one `MsgType` (`message`); its fields say
what travels, with shapes (T = completion tokens, P = prompt tokens, N = packed tokens, S =
sequences) and units. How a message becomes frames and back, checking every field against
its schema, is `areal.codec`; what each kind's header may hold before it is even unpacked
is `HEADER_LIMITS` here, next to the schemas it bounds.

This module imports nothing heavy (no torch, no sockets: see `areal.transport`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import types
import typing
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sized

import numpy as np

from areal.tasks.base import Verdict

DEFAULT_MAX_BYTES = 2 << 30
"""Largest message accepted by default (header and frames together)."""

REGISTER_MAX_BYTES = 4096
"""Largest Register (frames together): all an unregistered peer may send (transport.py)."""

PROTOCOL_VERSION = 4
"""The version of these schemas, as a whole, that a worker states in its Register: raised
whenever a message changes in a way that a peer of another release would refuse or misread
(a field added without a default, removed, or read differently; the run configuration a
Welcome carries among them: an option added, or a value an older release refuses, as 2's
null `controller.heartbeat_interval_s`; 3: a Heartbeat carries nothing; 4: reward.num_workers
may be 0, and a Completions then carries its rewards). The controller
refuses a worker of another version at registration and tells it both versions, before any
work is exchanged (controller/pool.py). 0 is what a worker from before versions sends
(nothing)."""

MAX_DEPTH = 32
"""Deepest nesting of lists and maps in an untyped (Any) field."""


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
    COMPLETIONS = 20


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
    """The environment or agent failed (raised, took longer than episode.step_timeout_s or
    agent.timeout_s, returned an unusable reward): reward 0, verdict error or timeout; the
    episode is kept, never lost (reward.on_error decides)."""
    AGENT = "agent"
    """The user's agent (agent.function) returned its reward."""


Tensor = typing.NewType("Tensor", object)
"""Annotation for a torch tensor field: any dtype, rebuilt with torch.frombuffer."""

_SCHEMAS: dict[MsgType, type] = {}
SCHEMAS: typing.Mapping[MsgType, type] = types.MappingProxyType(_SCHEMAS)
"""Every registered schema by kind, read-only (the codec's registry)."""


NOT_SENT = types.MappingProxyType({"sent": False})
"""A field's metadata: what the receiving side learns of a message and keeps with it, never
encoded nor read from the wire (`wire_fields` leaves it out)."""


def wire_fields(schema: type) -> tuple[dataclasses.Field, ...]:
    """The fields of `schema` that travel: all but those marked `NOT_SENT`."""
    return tuple(f for f in dataclasses.fields(schema) if f.metadata.get("sent", True))


def message(kind: MsgType):
    """Register a dataclass as the schema of one message kind."""

    def register(cls: type) -> type:
        if kind in _SCHEMAS:
            raise TypeError(f"message kind {kind.name} registered twice")
        cls.KIND = kind  # type: ignore[attr-defined]  # what makes it a schema
        _SCHEMAS[kind] = cls
        return cls

    return register


# ---------------------------------------------------------------------------------------------
# Schemas. Shapes: T = completion tokens, P = prompt tokens, N = packed tokens, S = sequences.


@message(MsgType.REGISTER)
@dataclass(kw_only=True, slots=True)
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
    protocol: int = 0
    """The sender's PROTOCOL_VERSION (0: a release from before versions, which sent none)."""


@message(MsgType.WELCOME)
@dataclass(kw_only=True, slots=True)
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
@dataclass(kw_only=True, slots=True)
class Ready:
    """Worker -> controller: set up (model loaded) and serving policy `version`; send work."""

    version: int = 0
    store: str = ""
    """Trainer rank 0 when process groups are used: "host:port" of the TCPStore it hosts,
    where groups meet (JoinGroup.store); empty otherwise."""


@message(MsgType.HEARTBEAT)
@dataclass(kw_only=True, slots=True)
class Heartbeat:
    """Both directions, every heartbeat interval (`RunConfig.heartbeat_interval`) in which
    the side sent the other nothing else: each declares the other lost after
    `controller.heartbeat_timeout_s` of silence. It carries nothing: its arrival is the
    news, and at cluster scale it is the most frequent message the controller decodes
    (an empty header, decoded without being unpacked: areal.codec)."""


@message(MsgType.GENERATE)
@dataclass(kw_only=True, slots=True)
class Generate:
    """Controller -> rollout worker: sample one completion of the prompt for each request id:
    the samples of one group that one dispatch sends to this worker (controller/
    generation.py), in one message instead of one per sample (the controller's cost at
    cluster scale). Single completions are answered in Completions, episodes and agent
    runs each in its own Generated."""

    request_ids: list[str]
    """One per completion, at least one, all different."""
    prompt_ids: np.ndarray
    """[P] int32 prompt tokens."""
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_id: str = ""
    """Episodes (episode.environment set), and every Generate when the rollout workers score
    (reward.num_workers=0): the task's prompt id."""
    reference: Any = None
    """As `prompt_id`: the prompt's reference (plain data) the environment, or the task's
    reward function on the rollout worker, rewards against."""
    prompt_text: str = ""
    """Agent episodes only (agent.function set): the task's prompt text, the agent's
    `sample.prompt` (an agent renders its own messages; `prompt_ids` are not used)."""
    seeds: list[int] | None = None
    """Each sample's own sampling stream (areal.seeds), one per request id, 0 <= seed <
    2**63; None: the engine's."""

    def samples(self) -> list[tuple[str, int | None]]:
        """(request id, seed) of each completion asked for; ValueError when the request ids
        are none or repeated, or the seeds do not match them one to one."""
        if not self.request_ids or len(set(self.request_ids)) != len(self.request_ids):
            raise ValueError(f"Generate needs distinct request ids, got {self.request_ids!r}")
        if self.seeds is None:
            return [(request_id, None) for request_id in self.request_ids]
        if len(self.seeds) != len(self.request_ids):
            raise ValueError(
                f"Generate has {len(self.seeds)} seeds for {len(self.request_ids)} request ids"
            )
        return list(zip(self.request_ids, self.seeds, strict=True))


@message(MsgType.GENERATED)
@dataclass(kw_only=True, slots=True)
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
    """Episodes, and single completions under reward.num_workers=0: the reward the
    rollout worker found (the controller does not score it again)."""
    verdict: Verdict | None = None
    """The verdict that goes with `reward`; None: not scored by the rollout worker."""
    check_retries: int = 0
    """Single completions scored by the rollout worker: how many times its check failed for
    want of infrastructure and was run again there before `verdict` (reward.retries)."""
    detail: str = ""
    num_turns: int = 1
    """Model turns in the episode."""
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    """Tool calls that failed (bad call, unknown tool, error, timeout): each became an
    observation saying so."""
    tool_s: float = 0.0
    """Seconds the environment took to answer, summed over turns (agents: the agent's own
    time between its chat calls)."""
    # -- agent episodes (agent.function): one or more training segments ------------------
    prompt_ids: np.ndarray | None = None
    """[sum P_s] int32: the prompt of each segment, concatenated (an agent's conversation
    is rendered on the worker); None: the Generate's prompt, one segment."""
    segment_prompt_lens: list[int] = field(default_factory=list)
    """P_s of each segment, in order; empty: one segment (not an agent episode). The
    per-token arrays above hold the segments' completions concatenated, T_s each."""
    segment_output_lens: list[int] = field(default_factory=list)
    """T_s of each segment (sum = T)."""
    segment_rewards: list[float] = field(default_factory=list)
    """Each segment's reward (areal.tasks.agent.segment_rewards); the last equals `reward`."""
    num_retries: int = 0
    """Agent episodes: client retries of a call answered from that call (not sampled again)."""
    queue_s: float = 0.0
    """Agent episodes: seconds from each call's arrival to its first submission to the
    engine (rendering, tokenizing, waiting for a weight update), summed over calls."""
    decode_s: float = 0.0
    """Agent episodes: seconds from each call's first submission to the engine to its
    result (decoding, interruptions included), summed over calls."""


def _cut_by(counts: list[int], total: int, first: np.ndarray, second: np.ndarray) -> bool:
    """Whether `counts` (summing to `total`), none negative, cut two 1-D arrays of `total`
    items each (`Completions.check`: the lengths the token arrays, the run counts the run
    arrays). A 0-d array's length is never asked."""
    return (
        min(counts) >= 0
        and first.ndim == 1
        and second.ndim == 1
        and len(first) == total
        and len(second) == total
    )


LISTED_RUNS = 4096
"""A Completions with at most this many version runs (a few a completion: the usual one)
has them checked as Python ints (`Completions.check`, `controller.checks.completions_fit`):
for a handful of values that is a fraction of what numpy's per-call cost is, and the
controller checks thousands of these messages a step. More runs than this (a message from a
confused or hostile peer) go through numpy, which bounds the time any message takes."""


@message(MsgType.COMPLETIONS)
@dataclass(kw_only=True, slots=True)
class Completions:
    """Rollout worker -> controller: single completions (no episode, no agent), of any of
    its requests, sent together once its engine has a free slot and nothing queued for it
    (workers/rollout/worker.py, `Answered`), in place of one Generated each: the
    controller's cost is per message. A request cancelled or failed (its WorkerError sent)
    is left out. S = completions."""

    request_ids: list[str]
    lengths: list[int]
    """T of each completion, in order (sum = the arrays' length)."""
    output_ids: np.ndarray
    """[sum T] int32: the completions' tokens, concatenated in order."""
    logprobs: np.ndarray
    """[sum T] float32 behaviour log-probs."""
    num_runs: list[int]
    """R of each completion, in order: how many runs of equal versions its tokens fall in
    (one, plus one per weight update that interrupted it and changed the version)."""
    run_versions: np.ndarray
    """[sum R] int32: the policy version that sampled each run's tokens. A completion's
    runs are its own, in token order: run r of the message covers `run_lengths[r]` tokens."""
    run_lengths: np.ndarray
    """[sum R] int32, each at least 1: the tokens of each run (a completion's add up to its
    T). Per-token versions travel as runs, a handful over thousands of tokens: a third of
    the bytes of a Generated's three per-token arrays, and the controller checks them
    without reading a value per token."""
    finish_reasons: list[FinishReason]
    num_interruptions: list[int]
    generation_s: list[float]
    # -- scored by the rollout worker (reward.num_workers=0); empty: the reward workers score
    rewards: list[float] = field(default_factory=list)
    """Each completion's reward, in order, as a reward worker's Scored would carry it."""
    verdicts: list[Verdict] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    check_retries: list[int] = field(default_factory=list)
    """Each completion's checks run again after an infrastructure failure, before its
    verdict (Generated.check_retries)."""
    # -- kept by the receiving controller, never sent
    parts_fit: bool | None = field(default=None, compare=False, repr=False, metadata=NOT_SENT)
    """Whether `check` passed, found by the controller's intake off its event loop's thread
    (areal/intake.py); None: not checked there."""
    token_bounds: Any = field(default=None, compare=False, repr=False, metadata=NOT_SENT)
    """The extremes of the token arrays (controller/checks.py `TokenBounds`), read by the
    controller's intake off its event loop's thread (areal/intake.py); None: not read yet."""

    @property
    def scored(self) -> bool:
        """Whether its rollout worker checked its completions (`rewards` and the rest)."""
        return bool(self.rewards or self.verdicts or self.details or self.check_retries)

    def completions(self) -> list[Generated]:
        """Each completion as its own Generated (ids and log-probs are views of this
        message's arrays, versions its runs written out); ValueError as `check` raises it."""
        self.check()
        result, start = [], 0
        runs = itertools.pairwise(itertools.accumulate(self.num_runs, initial=0))
        for i, (length, (first, last)) in enumerate(zip(self.lengths, runs, strict=True)):
            end = start + length
            result.append(
                Generated(
                    request_id=self.request_ids[i],
                    output_ids=self.output_ids[start:end],
                    logprobs=self.logprobs[start:end],
                    versions=np.repeat(self.run_versions[first:last], self.run_lengths[first:last]),
                    finish_reason=self.finish_reasons[i],
                    num_interruptions=self.num_interruptions[i],
                    generation_s=self.generation_s[i],
                    **self._outcome(i),
                )
            )
            start = end
        return result

    def _outcome(self, i: int) -> dict[str, Any]:
        """Completion `i`'s outcome as Generated fields (none unscored)."""
        if not self.scored:
            return {}
        return {
            "reward": self.rewards[i],
            "verdict": self.verdicts[i],
            "detail": self.details[i],
            "check_retries": self.check_retries[i],
        }

    def _outcome_lists(self) -> tuple[Sized, ...]:
        return (self.rewards, self.verdicts, self.details, self.check_retries)

    def check(self) -> None:
        """ValueError when the lists do not pair up with the request ids (the outcome lists,
        when scored, too), the lengths do not add up to the arrays', or each completion's
        version runs to its length (the parts fit together; the values of tokens, versions
        and rewards are not judged)."""
        # Straight-line code, no generator per check: the controller runs this for every
        # Completions, each time with its caches cold (bench/cold_caches.py).
        n = len(self.request_ids)
        if not (
            n
            and len(self.lengths) == n
            and len(self.num_runs) == n
            and len(self.finish_reasons) == n
            and len(self.num_interruptions) == n
            and len(self.generation_s) == n
            and (not self.scored or all(len(values) == n for values in self._outcome_lists()))
        ):
            lists: list[Sized] = [
                self.lengths,
                self.num_runs,
                self.finish_reasons,
                self.num_interruptions,
                self.generation_s,
                *self._outcome_lists(),
            ]
            sizes = [len(values) for values in lists]
            raise ValueError(
                f"request_ids, lengths, num_runs, finish_reasons, num_interruptions, "
                f"generation_s, rewards, verdicts, details, check_retries have lengths "
                f"{[n, *sizes]}: one of each per completion, at least one (the last four: "
                "none when unscored)"
            )
        ids, logprobs = self.output_ids, self.logprobs
        total = sum(self.lengths)
        if not _cut_by(self.lengths, total, ids, logprobs):
            raise ValueError(
                f"lengths {self.lengths[:8]}{'...' if n > 8 else ''} (sum {total}) do not cut "
                f"arrays of shapes {[list(ids.shape), list(logprobs.shape)]}"
            )
        runs, lengths = self.run_versions, self.run_lengths
        num_runs = sum(self.num_runs)
        if not _cut_by(self.num_runs, num_runs, runs, lengths):
            raise ValueError(
                f"num_runs {self.num_runs[:8]}{'...' if n > 8 else ''} (sum {num_runs}) do "
                f"not cut run arrays of shapes {[list(runs.shape), list(lengths.shape)]}"
            )
        # A few runs a completion (the usual message): read as Python ints, in one call.
        listed = lengths.tolist() if num_runs <= LISTED_RUNS else None
        if lengths.dtype.kind not in "iu":
            fits = False
        elif listed is not None:
            fits = not listed or (min(listed) >= 1 and max(listed) <= total)
        else:  # bounded above too: sums of huge values could wrap around to the right total
            fits = not num_runs or 1 <= lengths.min() <= lengths.max() <= total
        if not fits:
            raise ValueError(
                f"run_lengths of dtype {lengths.dtype}: positive integers, none above the "
                f"{total} tokens"
            )
        if listed is not None:
            before = list(itertools.accumulate(listed, initial=0))  # tokens before each run
            adds_up = [before[end] for end in itertools.accumulate(self.num_runs)] == list(
                itertools.accumulate(self.lengths)
            )
        else:
            covered = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
            adds_up = np.array_equal(covered[np.cumsum(self.num_runs)], np.cumsum(self.lengths))
        if not adds_up:
            raise ValueError(
                "the version runs of some completion do not add up to its length "
                f"(lengths {self.lengths[:8]}, runs {self.num_runs[:8]})"
            )

    @classmethod
    def of(cls, completions: list[Generated]) -> Completions:
        """The single completions `completions` (at least one) in one message."""
        runs = [version_runs(c.versions) for c in completions]
        return cls(
            request_ids=[c.request_id for c in completions],
            lengths=[len(c.output_ids) for c in completions],
            output_ids=_joined([c.output_ids for c in completions]),
            logprobs=_joined([c.logprobs for c in completions]),
            num_runs=[len(values) for values, _ in runs],
            run_versions=_joined([values for values, _ in runs]),
            run_lengths=_joined([lengths for _, lengths in runs]),
            finish_reasons=[c.finish_reason for c in completions],
            num_interruptions=[c.num_interruptions for c in completions],
            generation_s=[c.generation_s for c in completions],
            **_outcomes(completions),
        )


def _outcomes(completions: list[Generated]) -> dict[str, Any]:
    """Completions fields of the completions' outcomes: all of them when each carries a
    verdict (its rollout worker scored it), else none."""
    if any(c.verdict is None for c in completions):
        return {}
    return {
        "rewards": [c.reward for c in completions],
        "verdicts": [c.verdict for c in completions],
        "details": [c.detail for c in completions],
        "check_retries": [c.check_retries for c in completions],
    }


def version_runs(versions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values [R] int32, lengths [R] int32) of the runs of equal values in `versions`
    (per-token versions of one completion, or any array of int32-sized values), in order;
    none for no values. ValueError for values that are not integers (a cast would turn a
    NaN or an infinity into some version without a word)."""
    if versions.dtype.kind not in "iu":
        raise ValueError(f"versions of dtype {versions.dtype}: integers expected")
    if not len(versions):
        return np.empty(0, np.int32), np.empty(0, np.int32)
    starts = np.flatnonzero(versions[1:] != versions[:-1]) + 1
    bounds = np.concatenate([[0], starts, [len(versions)]])
    return versions[bounds[:-1]].astype(np.int32, copy=False), np.diff(bounds).astype(np.int32)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """One array as it is (no copy), several concatenated."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


@message(MsgType.CANCEL)
@dataclass(kw_only=True, slots=True)
class Cancel:
    """Controller -> rollout worker: drop these requests (their results are not wanted)."""

    request_ids: list[str]


@message(MsgType.UPDATE_WEIGHTS)
@dataclass(kw_only=True, slots=True)
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
@dataclass(kw_only=True, slots=True)
class WeightsChunk:
    """Trainer -> controller -> rollout workers: one bucket of a weight version (stream)."""

    version: int
    index: int
    num_chunks: int
    names: list[str]
    tensors: list[Tensor]


@message(MsgType.WEIGHTS_UPDATED)
@dataclass(kw_only=True, slots=True)
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
@dataclass(kw_only=True, slots=True)
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
@dataclass(kw_only=True, slots=True)
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
    """Rank 0: a trainer checkpoint completed since the last Trained (trainer.checkpoint_every),
    if any: this step's, or with trainer.checkpoint_async one written in the background."""
    checkpoint_step: int = 0
    """The step whose state `checkpoint` holds (0 from a sender that predates it: this step)."""


@message(MsgType.JOIN_GROUP)
@dataclass(kw_only=True, slots=True)
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
@dataclass(kw_only=True, slots=True)
class GroupStatus:
    """Worker -> controller: the outcome of a JoinGroup, or a failed collective in a group."""

    group: GroupName
    generation: int
    state: GroupState
    error: str = ""


@message(MsgType.BROADCAST_WEIGHTS)
@dataclass(kw_only=True, slots=True)
class BroadcastWeights:
    """Controller -> trainer rank 0: broadcast published version `version` in weights-group
    `generation` (the rollout workers got the matching UpdateWeights)."""

    version: int
    generation: int


@message(MsgType.SCORE)
@dataclass(kw_only=True, slots=True)
class Score:
    """Controller -> reward worker: score completions of one prompt, together.

    A group's samples are sent in one message once all of them are generated (a retried
    check alone): one message per group instead of one per sample, each way, so the
    controller handles about half as many messages per completion."""

    request_ids: list[str]
    prompt_id: str
    completion_ids: list[np.ndarray]
    """[T] int32 completion tokens of each request, in order (decoded by the worker's
    tokenizer)."""
    reference: Any


@message(MsgType.SCORED)
@dataclass(kw_only=True, slots=True)
class Scored:
    """Reward worker -> controller: the outcome of each completion of one Score, in order."""

    request_ids: list[str]
    rewards: list[float]
    verdicts: list[Verdict]
    details: list[str]
    check_s: list[float]


@message(MsgType.SHUTDOWN)
@dataclass(kw_only=True, slots=True)
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
@dataclass(kw_only=True, slots=True)
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
    MsgType.WELCOME: HeaderLimit(16 << 20, 1 << 16),  # the resolved run config
    MsgType.GENERATE: HeaderLimit(1 << 20, 1 << 16),  # stop token ids, an agent's prompt text
    MsgType.GENERATED: HeaderLimit(1 << 20, 1 << 12),  # an agent episode's segment lists
    MsgType.COMPLETIONS: HeaderLimit(1 << 20, 1 << 16),  # the per-completion lists
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


def schemas() -> dict[MsgType, type]:
    """Every registered schema by kind (for tests and documentation)."""
    return dict(_SCHEMAS)
