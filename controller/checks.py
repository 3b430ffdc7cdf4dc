"""Does a message from a registered worker fit what the controller knows? Decoding already
checked its shape (areal.messages); these check its meaning, before it touches the ledger.

    sender_problem     each kind comes only from the workers that send it (a rollout
                       worker does not answer a training step)
    generated_problem  a completion is one token id, log-prob and version per token, within
                       its request's budget, from versions that exist, with log-probs <= 0;
                       an episode's observation tokens carry PROMPT_VERSION and log-prob 0;
                       an agent episode's segments add up, each checked as a completion
    scored_problem     a reward is a finite number

Each returns the reason in words, or '' when the message fits. The controller drops what
does not fit (rate-limited log, see peer_log.py), re-queues the work it concerned, and the
run goes on: one bad message never ends it. This module holds no state.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from areal.codec import decode
from areal.messages import (
    LISTED_RUNS,
    Completions,
    Generated,
    GroupName,
    GroupStatus,
    Heartbeat,
    MsgType,
    Ready,
    Register,
    Scored,
    Trained,
    WeightsChunk,
    WeightsUpdated,
    WorkerError,
    WorkerKind,
)
from areal.types import PROMPT_VERSION
from areal.controller.pool import WorkerHandle

_ANY = frozenset(WorkerKind)
_SENDERS: dict[type, frozenset[WorkerKind]] = {
    Register: _ANY,
    Ready: _ANY,
    Heartbeat: _ANY,
    WorkerError: _ANY,
    Generated: frozenset({WorkerKind.ROLLOUT}),
    Completions: frozenset({WorkerKind.ROLLOUT}),
    WeightsUpdated: frozenset({WorkerKind.ROLLOUT}),
    Scored: frozenset({WorkerKind.REWARD}),
    Trained: frozenset({WorkerKind.TRAINER}),
    WeightsChunk: frozenset({WorkerKind.TRAINER}),
    GroupStatus: frozenset({WorkerKind.ROLLOUT, WorkerKind.TRAINER}),
}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""The unsigned integer type of each signed one's size (`_plain_completion_fits`)."""
_MIN, _MAX, _ALL = np.minimum.reduce, np.maximum.reduce, np.logical_and.reduce
"""Reductions as ufuncs: `a.max()` goes through a Python wrapper (numpy's _methods) that
cost as much as the pass over a 3,000-token completion (`_plain_completion_fits`)."""

LOGPROB_SLACK = 1e-3
"""A sampled token's log-prob is <= 0; this much above 0 is float rounding."""


def sender_problem(msg: Any, handle: WorkerHandle | None) -> str:
    name = type(msg).__name__
    if handle is None:
        return "" if isinstance(msg, Register) else f"{name} before registering"
    if handle.kind not in _SENDERS.get(type(msg), frozenset()):
        return f"{name} from a {handle.kind.value} worker"
    if isinstance(msg, Trained) and msg.rank != handle.rank:
        return f"Trained for rank {msg.rank} from rank {handle.rank}"
    if isinstance(msg, WeightsChunk) and handle.rank != 0:
        return f"WeightsChunk from trainer rank {handle.rank}; only rank 0 publishes"
    if (
        isinstance(msg, GroupStatus)
        and msg.group is GroupName.TRAINER
        and handle.kind is not WorkerKind.TRAINER
    ):
        return f"trainer-group status from a {handle.kind.value} worker"
    return ""


def generated_problem(
    msg: Generated, *, max_new_tokens: int, version: int, vocab_size: int | None
) -> str:
    if msg.segment_prompt_lens or msg.prompt_ids is not None:
        return _segments_problem(
            msg, max_new_tokens=max_new_tokens, version=version, vocab_size=vocab_size
        )
    if msg.loss_mask is None and _plain_completion_fits(msg, max_new_tokens, version, vocab_size):
        return ""
    return _generated_problem(
        msg, max_new_tokens=max_new_tokens, version=version, vocab_size=vocab_size
    )


def _segments_problem(
    msg: Generated, *, max_new_tokens: int, version: int, vocab_size: int | None
) -> str:
    """An agent episode's segments: lists that pair up, lengths that add up, prompts in the
    vocabulary, finite rewards, and each segment's tokens checked as one completion
    (versions never decrease within a segment; segments may run side by side)."""
    prompt_lens, output_lens = msg.segment_prompt_lens, msg.segment_output_lens
    if msg.prompt_ids is None or msg.loss_mask is None:
        return "a segmented episode without prompt_ids or loss_mask"
    if not len(prompt_lens) == len(output_lens) == len(msg.segment_rewards) >= 1:
        return (
            f"segment_prompt_lens, segment_output_lens, segment_rewards have lengths "
            f"{[len(prompt_lens), len(output_lens), len(msg.segment_rewards)]}: one of "
            "each per segment"
        )
    if min(prompt_lens) < 1 or min(output_lens) < 0:
        return "a segment with an empty prompt or a negative length"
    if msg.prompt_ids.ndim != 1 or sum(prompt_lens) != len(msg.prompt_ids):
        return (
            f"segment prompts of {sum(prompt_lens)} tokens but prompt_ids holds "
            f"{len(msg.prompt_ids)}"
        )
    if (
        msg.prompt_ids.dtype.kind not in "iu"
        or msg.prompt_ids.min() < 0
        or (vocab_size is not None and msg.prompt_ids.max() >= vocab_size)
    ):
        return "prompt_ids are not token ids of the vocabulary"
    if (
        not all(math.isfinite(r) for r in msg.segment_rewards)
        or msg.segment_rewards[-1] != msg.reward
    ):
        return "segment rewards must be finite, the last equal to the episode's reward"
    arrays = (msg.output_ids, msg.logprobs, msg.versions, msg.loss_mask)
    if any(a.ndim != 1 or len(a) != sum(output_lens) for a in arrays):
        return (
            f"segments of {sum(output_lens)} tokens but per-token arrays of lengths "
            f"{[len(a) for a in arrays]}"
        )
    start = 0
    for i, length in enumerate(output_lens):
        span = slice(start, start + length)
        part = Generated(
            request_id=msg.request_id,
            output_ids=msg.output_ids[span],
            logprobs=msg.logprobs[span],
            versions=msg.versions[span],
            loss_mask=msg.loss_mask[span],
            finish_reason=msg.finish_reason,
        )
        problem = _generated_problem(
            part, max_new_tokens=max_new_tokens, version=version, vocab_size=vocab_size
        )
        if problem:
            return f"segment {i}: {problem}"
        start += length
    return ""


@dataclass(frozen=True, slots=True)
class TokenBounds:
    """What `completions_fit` reads of a Completions' tokens: the extremes of its id and
    log-prob arrays. Finding them is a pass over every token the message carries, most of
    what receiving a completion costs at cluster scale, so the controller's intake finds
    them off its event loop's thread (areal/intake.py, `read_completions`)."""

    ids_max: int
    """The greatest id, each read unsigned: a negative id is above any vocabulary."""
    ids_negative: bool
    """Some id is negative (read off `ids_max`: for a signed dtype, 2**(bits - 1) or more)."""
    logprob_max: float
    """NaN if any log-prob is NaN (numpy's maximum and minimum propagate it)."""
    logprob_min: float


def token_bounds(msg: Completions) -> TokenBounds | None:
    """`msg`'s token bounds; None when they cannot be read (ids not integers, log-probs not
    floats, no tokens): `completions_fit` then says False and each completion is judged."""
    ids, logprobs = msg.output_ids, msg.logprobs
    if (
        ids.dtype.kind not in "iu"
        or logprobs.dtype.kind != "f"
        or not ids.size
        or not logprobs.size
    ):
        return None
    ids_max = int(_MAX(ids.view(_UNSIGNED[ids.dtype.itemsize]), axis=None))
    return TokenBounds(
        ids_max=ids_max,
        ids_negative=ids.dtype.kind == "i" and ids_max >= 1 << (8 * ids.dtype.itemsize - 1),
        logprob_max=float(_MAX(logprobs, axis=None)),
        logprob_min=float(_MIN(logprobs, axis=None)),
    )


INTAKE_MIN_BYTES = 32_768 * 8
"""The fewest bytes of array frames a Completions carries for the intake's thread to read it:
32,768 tokens as rollout workers send them (an int32 id and a float32 log-prob each; the
version runs add a few bytes a completion). Handing a message to the thread and taking it
back costs the loop's thread about 20-30 us of CPU, about what decoding and reading a
message of 4,096 tokens costs it, and half what one of this size does (bench/intake.py
measures both): a lower threshold would spare the loop a little more, not measured at
cluster scale (table (r) ran with this one). Below it the loop reads the message itself."""

_COMPLETIONS_TYPE = bytes([MsgType.COMPLETIONS.value])


def worth_the_intake(body: Sequence[Any]) -> bool:
    """Whether the intake's thread reads a received message (`intake_reading`), told from its
    frames (after the identity) before they are decoded: a Completions whose array frames
    hold at least INTAKE_MIN_BYTES. Any other message, a Heartbeat first among them, costs
    this a length and at most one byte's read."""
    return (
        len(body) > 2
        and memoryview(body[0]).tobytes() == _COMPLETIONS_TYPE
        and sum(memoryview(frame).nbytes for frame in body[2:]) >= INTAKE_MIN_BYTES
    )


def read_completions(msg: Completions) -> None:
    """A Completions keeps whether its parts fit together (`Completions.check`,
    `parts_fit`) and, when they do, its token bounds. Never raises for a message decoding
    let through (one whose parts do not fit is refused, and its error worded, on the loop)."""
    try:
        msg.check()
    except ValueError:
        msg.parts_fit = False
        return
    msg.parts_fit = True
    msg.token_bounds = token_bounds(msg)


def intake_reading(max_bytes: int) -> Callable[[Sequence[Any]], Completions]:
    """The controller's intake work (areal/intake.py) on the frames of a message
    `worth_the_intake` took: decoded as the channel decodes (at most `max_bytes`, and
    nothing but a Completions: MessageError otherwise, which the channel raises as the
    peer's), then read (`read_completions`). Runs on the intake's thread."""

    def read(body: Sequence[Any]) -> Completions:
        msg = decode(body, max_bytes, only=(MsgType.COMPLETIONS,))
        read_completions(msg)
        return msg

    return read


def completions_fit(
    msg: Completions, *, max_new_tokens: int, version: int, vocab_size: int | None
) -> bool:
    """True only when every completion of `msg` (whose parts fit together:
    `Completions.check` passed) would pass `generated_problem`, judged once for the whole
    message instead of once per completion: the ids in the vocabulary, the log-probs finite
    and at most 0 (with slack), read off its `TokenBounds` (the intake's, else found here);
    the versions in [0, `version`] and never decreasing within a completion (read off its
    runs: a drop only where a completion's first run begins), each completion 1 to
    max_new_tokens tokens. When it says False, each completion is judged (and worded) on its
    own."""
    versions, lengths = msg.run_versions, msg.lengths
    if versions.dtype.kind not in "iu":
        return False
    if not (min(lengths) > 0 and max(lengths) <= max_new_tokens):
        return False  # every completion has a token, so at least one run
    bounds = msg.token_bounds if msg.token_bounds is not None else token_bounds(msg)
    if bounds is None:
        return False
    if vocab_size is not None:
        if bounds.ids_max >= vocab_size:
            return False
    elif bounds.ids_negative:
        return False
    if len(versions) <= LISTED_RUNS:  # the usual message: a few runs a completion
        if not _listed_runs_fit(versions.tolist(), msg.num_runs, version):
            return False
    else:
        if not (_MIN(versions) >= 0 and _MAX(versions) <= version):
            return False
        drops = versions[1:] < versions[:-1]  # drops[r]: from run r to r + 1
        drops[np.cumsum(msg.num_runs[:-1], dtype=np.intp) - 1] = False  # may start lower
        if drops.any():
            return False
    return bounds.logprob_max <= LOGPROB_SLACK and bounds.logprob_min > -math.inf


def _listed_runs_fit(versions: list[int], num_runs: list[int], version: int) -> bool:
    """`completions_fit`'s judgement of the run versions (each completion's, `num_runs` of
    them in order) read as Python ints: all in [0, `version`], none lower than the run
    before it in the same completion."""
    if versions and not (min(versions) >= 0 and max(versions) <= version):
        return False
    start = 0
    for count in num_runs:
        if count > 1:  # one run (no version change while it was generated) cannot drop
            for before, after in itertools.pairwise(versions[start : start + count]):
                if after < before:
                    return False
        start += count
    return True


def _plain_completion_fits(
    msg: Generated, max_new_tokens: int, version: int, vocab_size: int | None
) -> bool:
    """True only when `_generated_problem` finds nothing in a single completion (no loss
    mask), with fewer numpy calls: every Generated a rollout worker sends passes here
    (thousands per step at cluster scale). Versions that never decrease have their least and
    greatest at the ends; a log-prob maximum that is NaN or +inf fails `<=`, and a minimum
    of -inf fails `>`. Anything it does not accept is judged (and worded) by
    `_generated_problem`."""
    ids, logprobs, versions = msg.output_ids, msg.logprobs, msg.versions
    if not (type(ids) is type(logprobs) is type(versions) is np.ndarray):
        return False
    if ids.ndim != 1 or logprobs.ndim != 1 or versions.ndim != 1:
        return False
    n = len(ids)
    if not 0 < n <= max_new_tokens or len(logprobs) != n or len(versions) != n:
        return False
    if ids.dtype.kind not in "iu" or versions.dtype.kind not in "iu" or logprobs.dtype.kind != "f":
        return False
    if vocab_size is not None:  # one pass for both bounds: a negative id read unsigned is
        if _MAX(ids.view(_UNSIGNED[ids.dtype.itemsize])) >= vocab_size:  # above any vocabulary
            return False
    elif _MIN(ids) < 0:
        return False
    if not (versions[0] >= 0 and versions[-1] <= version):
        return False
    if n > 1 and not _ALL(versions[1:] >= versions[:-1]):
        return False
    return bool(_MAX(logprobs) <= LOGPROB_SLACK and _MIN(logprobs) > -math.inf)


def _generated_problem(
    msg: Generated, *, max_new_tokens: int, version: int, vocab_size: int | None
) -> str:
    arrays = {"output_ids": msg.output_ids, "logprobs": msg.logprobs, "versions": msg.versions}
    for name, array in arrays.items():
        if array.ndim != 1:
            return f"{name} has shape {list(array.shape)}, not [T]"
    lengths = [len(array) for array in arrays.values()]
    if len(set(lengths)) != 1:
        return f"output_ids, logprobs, versions have lengths {lengths}: one of each per token"
    if lengths[0] > max_new_tokens:
        return f"{lengths[0]} tokens for a request of at most {max_new_tokens}"
    if (
        msg.output_ids.dtype.kind not in "iu"
        or msg.versions.dtype.kind not in "iu"
        or msg.logprobs.dtype.kind != "f"
    ):
        return (
            f"dtypes {msg.output_ids.dtype}, {msg.logprobs.dtype}, {msg.versions.dtype}: "
            "token ids and versions are integers, log-probs floats"
        )
    if not lengths[0]:
        return ""
    ids, versions, logprobs = msg.output_ids, msg.versions, msg.logprobs
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        return f"token ids {ids.min()}..{ids.max()} outside the vocabulary [0, {vocab_size})"
    if msg.loss_mask is not None:
        problem = _observation_problem(msg.loss_mask, versions, logprobs)
        if problem:
            return problem
        versions, logprobs = versions[msg.loss_mask], logprobs[msg.loss_mask]
        if not len(versions):
            return ""
    if versions.min() < 0 or versions.max() > version:
        return f"token versions {versions.min()}..{versions.max()} outside 0..{version} (published)"
    if np.any(np.diff(versions) < 0):
        return "token versions decrease along the sequence"
    if not np.all(np.isfinite(logprobs)) or logprobs.max() > LOGPROB_SLACK:
        return "log-probs must be finite and <= 0"
    return ""


def _observation_problem(loss_mask: np.ndarray, versions: np.ndarray, logprobs: np.ndarray) -> str:
    """An episode's observation tokens (loss_mask False) carry PROMPT_VERSION and log-prob 0;
    the checks on versions and log-probs then apply to the sampled tokens only."""
    if loss_mask.shape != versions.shape or loss_mask.dtype != np.bool_:
        return (
            f"loss_mask has shape {list(loss_mask.shape)} and dtype {loss_mask.dtype}: "
            f"one bool per token ({len(versions)})"
        )
    observed = ~loss_mask
    if np.any(versions[observed] != PROMPT_VERSION) or np.any(logprobs[observed] != 0):
        return f"observation tokens (loss_mask False) carry version {PROMPT_VERSION} and log-prob 0"
    return ""


def scored_problem(msg: Scored) -> str:
    """What makes a whole Scored unusable: lists that do not pair an outcome with each
    request."""
    lengths = [
        len(msg.request_ids),
        len(msg.rewards),
        len(msg.verdicts),
        len(msg.details),
        len(msg.check_s),
    ]
    if len(set(lengths)) != 1:
        return (
            f"request_ids, rewards, verdicts, details, check_s have lengths {lengths}: "
            "one of each per request"
        )
    return ""


def reward_problem(reward: float) -> str:
    """What makes one outcome of a Scored unusable."""
    return "" if math.isfinite(reward) else f"reward {reward!r} is not a finite number"


def model_vocab_size(model_path: str | None) -> int | None:
    """The model's vocabulary size from its config.json (None when it does not say)."""
    if model_path is None:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None
