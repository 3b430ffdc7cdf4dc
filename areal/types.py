"""Trajectories and their padding-free packed form.

A `Trajectory` is one sampled completion with everything the decoupled PPO objective
needs per token: the token, the behaviour log-prob recorded when it was sampled, and the
policy version that sampled it (-1 for prompt tokens). An episode (several model turns with
observations between them, docs/design.md section 10) is one trajectory too: its observation
tokens are stored like prompt tokens (version -1, log-prob 0, loss mask False), so nothing
downstream (packing, staleness, the loss) needs to know about turns. Arrays are numpy so
that they travel as raw ZeroMQ frames; `pack` turns a batch into flat torch tensors with
cumulative sequence lengths for varlen forward passes. Nothing here computes losses or
talks to processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict
from collections.abc import Sequence

import numpy as np
import torch

PROMPT_VERSION = -1
"""Version recorded for prompt tokens: they were not sampled by any policy."""


class VersionRuns(NamedTuple):
    """Per-token versions of a completion as runs: `lengths[r]` tokens (at least one) in a
    row sampled by `versions[r]` (both [R] int32). A completion's versions change only where
    a weight update interrupted it, so the controller keeps them as they travel
    (messages.Completions) and writes them out per token only when a batch is packed."""

    versions: np.ndarray
    lengths: np.ndarray

    def expanded(self) -> np.ndarray:
        """[T] int32, a version per token."""
        return np.repeat(self.versions, self.lengths)


class Trajectory:
    """One prompt + completion. The per-token arrays `token_ids`, `logprobs`, `versions`,
    `loss_mask` have shape [T] (T = prompt + completion).

    Two forms, the same trajectory to every reader. Built from full arrays (the constructor):
    they are kept as given. Built by `from_generation` from a completion whose arrays already
    have the trajectory's dtypes (what every rollout worker sends): the prompt's and the
    completion's arrays are kept as they are, without a copy (the controller builds one per
    finished sample, tens of millions of tokens per step at cluster scale), and the [T]
    arrays are joined the first time one is read. What the controller reads on its hot path
    (`num_tokens`, `output_ids`, `num_loss_tokens`, `oldest_version`, `pack_arrays`) never
    joins them: each token is copied once, into the Train message. A trajectory's arrays are
    never changed once it is built, so `oldest_version` is computed once; `from_generation`
    computes it at once, while the completion just received is in the CPU's cache (read at
    the step record, after thousands of other completions, it would be a cache miss per
    trajectory)."""

    __slots__ = (
        "_joined",
        "_oldest",
        "_parts",
        "episode",
        "finish_reason",
        "group_id",
        "num_prompt_tokens",
        "prompt_id",
        "reward",
        "timings",
    )

    def __init__(
        self,
        *,
        prompt_id: str,
        group_id: int,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        loss_mask: np.ndarray,
        num_prompt_tokens: int,
        reward: float = 0.0,
        finish_reason: str = "length",
        timings: dict[str, float] | None = None,
        episode: dict[str, Any] | None = None,
    ) -> None:
        lengths = {len(token_ids), len(logprobs), len(versions), len(loss_mask)}
        if len(lengths) != 1:
            raise ValueError(
                f"trajectory {prompt_id!r}: per-token arrays differ in length "
                f"(token_ids={len(token_ids)}, logprobs={len(logprobs)}, "
                f"versions={len(versions)}, loss_mask={len(loss_mask)})"
            )
        _check_num_prompt(prompt_id, num_prompt_tokens, len(token_ids))
        self._init(prompt_id, group_id, num_prompt_tokens, reward, finish_reason, timings, episode)
        # Exactly one of the two forms is set (None the other), which mypy cannot follow:
        # typed Any rather than checked on every read of the controller's hot path.
        self._joined: Any = (token_ids, logprobs, versions, loss_mask)
        self._parts: Any = None

    def _init(
        self,
        prompt_id: str,
        group_id: int,
        num_prompt_tokens: int,
        reward: float,
        finish_reason: str,
        timings: dict[str, float] | None,
        episode: dict[str, Any] | None,
    ) -> None:
        self.prompt_id = prompt_id
        self.group_id = group_id
        """Index of the prompt group (the samples of one prompt, one advantage group) in the
        run."""
        self.num_prompt_tokens = num_prompt_tokens
        self.reward = reward
        self.finish_reason = finish_reason
        self.timings: dict[str, float] = {} if timings is None else timings
        """Seconds: 'submitted', 'generated', 'rewarded' (controller clock), 'generation'
        (span)."""
        self.episode: dict[str, Any] = {} if episode is None else episode
        """Episodes only: 'turns', 'tool_calls', 'tool_errors' (counts), 'tool_s' (seconds)
        and 'end' (its EpisodeEnd value); empty for a single completion."""
        self._oldest: int | None = None

    def __repr__(self) -> str:
        return (
            f"Trajectory(prompt_id={self.prompt_id!r}, group_id={self.group_id}, "
            f"num_tokens={self.num_tokens}, num_prompt_tokens={self.num_prompt_tokens}, "
            f"reward={self.reward}, finish_reason={self.finish_reason!r})"
        )

    @classmethod
    def from_generation(
        cls,
        *,
        prompt_id: str,
        group_id: int,
        prompt_ids: Sequence[int] | np.ndarray,
        output_ids: Sequence[int] | np.ndarray,
        output_logprobs: Sequence[float] | np.ndarray,
        output_versions: Sequence[int] | np.ndarray,
        finish_reason: str = "length",
        output_loss_mask: Sequence[bool] | np.ndarray | None = None,
        oldest_version: int | None = None,
        timings: dict[str, float] | None = None,
    ) -> Trajectory:
        """Assemble prompt and completion; completion tokens are trained on, prompt tokens not.

        `output_loss_mask` [T]: False for observation tokens of an episode, which must carry
        version PROMPT_VERSION; None: every output token was sampled. `oldest_version`: the
        least of `output_versions` when the caller knows it (the first token's, when the
        versions never drop, as the controller checks a Completions' do), so that the
        arrays kept as they are need not be read; None: found here. `timings`: its
        `timings`, kept (None: empty)."""
        num_prompt, num_out = len(prompt_ids), len(output_ids)
        if not num_out == len(output_logprobs) == len(output_versions):
            raise ValueError(
                f"trajectory {prompt_id!r}: per-token arrays differ in length (output_ids="
                f"{num_out}, logprobs={len(output_logprobs)}, versions={len(output_versions)})"
            )
        # A single completion (no mask) is all sampled tokens: nothing to check or build.
        out_mask: Any = True if output_loss_mask is None else np.asarray(output_loss_mask, bool)
        if out_mask is not True and len(out_mask) == num_out and not out_mask.all():
            observed = np.asarray(output_versions)[~out_mask]
            if (observed != PROMPT_VERSION).any():
                raise ValueError(
                    f"trajectory {prompt_id!r}: observation tokens (loss mask "
                    f"False) must have version {PROMPT_VERSION}, got "
                    f"{sorted(set(observed.tolist()))}"
                )
        if _kept_as_is(prompt_ids, output_ids, output_logprobs, output_versions, out_mask):
            return cls.from_checked(
                prompt_id=prompt_id,
                group_id=group_id,
                prompt_ids=prompt_ids,  # type: ignore[arg-type]  # _kept_as_is: arrays
                output_ids=output_ids,  # type: ignore[arg-type]
                output_logprobs=output_logprobs,  # type: ignore[arg-type]
                output_versions=output_versions,  # type: ignore[arg-type]
                finish_reason=finish_reason,
                output_loss_mask=None if out_mask is True else out_mask,
                # now, while the completion just received is in the cache
                oldest_version=_oldest_sampled(output_versions)  # type: ignore[arg-type]
                if oldest_version is None
                else oldest_version,
                timings=timings,
            )
        # Anything else (lists, other dtypes, a mask of another length) is converted as
        # numpy assignment converts it, into arrays written once each.
        token_ids = np.empty(num_prompt + num_out, np.int32)
        token_ids[:num_prompt], token_ids[num_prompt:] = prompt_ids, output_ids
        logprobs = np.empty(num_prompt + num_out, np.float32)
        logprobs[:num_prompt], logprobs[num_prompt:] = 0.0, output_logprobs
        versions = np.empty(num_prompt + num_out, np.int32)
        versions[:num_prompt], versions[num_prompt:] = PROMPT_VERSION, output_versions
        loss_mask = np.empty(num_prompt + num_out, bool)
        loss_mask[:num_prompt], loss_mask[num_prompt:] = False, out_mask
        return cls(
            prompt_id=prompt_id,
            group_id=group_id,
            token_ids=token_ids,
            logprobs=logprobs,
            versions=versions,
            loss_mask=loss_mask,
            num_prompt_tokens=num_prompt,
            finish_reason=finish_reason,
            timings=timings,
        )

    @classmethod
    def from_checked(
        cls,
        *,
        prompt_id: str,
        group_id: int,
        prompt_ids: np.ndarray,
        output_ids: np.ndarray,
        output_logprobs: np.ndarray,
        output_versions: np.ndarray | VersionRuns,
        finish_reason: str,
        oldest_version: int,
        output_loss_mask: np.ndarray | None = None,
        timings: dict[str, float] | None = None,
    ) -> Trajectory:
        """`from_generation` of arrays that have the trajectory's own types already (1-D
        int32 ids and versions, float32 log-probs, a bool mask per output token or None),
        output arrays of one length (versions may be their runs, covering them), and
        `oldest_version` their least sampled version:
        kept as they are, without a copy, nothing read but their lengths (the controller
        builds one per finished sample, tens of millions of tokens a step at cluster
        scale). `timings`: its `timings`, kept (None: empty)."""
        _check_num_prompt(prompt_id, len(prompt_ids), len(prompt_ids) + len(output_ids))
        kept = cls.__new__(cls)
        kept._init(prompt_id, group_id, len(prompt_ids), 0.0, finish_reason, timings, None)
        kept._joined = None
        kept._parts = (prompt_ids, output_ids, output_logprobs, output_versions, output_loss_mask)
        kept._oldest = oldest_version
        return kept

    def _arrays(self) -> tuple[np.ndarray, ...]:
        """(token_ids, logprobs, versions, loss_mask), each [T]; joined once if kept apart."""
        if self._joined is None:
            prompt, ids, logprobs, versions, mask = self._parts
            n = self.num_prompt_tokens
            self._joined = (
                np.concatenate([prompt, ids]),
                np.concatenate([np.zeros(n, np.float32), logprobs]),
                np.concatenate([np.full(n, PROMPT_VERSION, np.int32), _per_token(versions)]),
                np.concatenate(
                    [np.zeros(n, bool), np.ones(len(ids), bool) if mask is None else mask]
                ),
            )
            self._parts = None
        return self._joined

    @property
    def token_ids(self) -> np.ndarray:
        """[T] int32."""
        return self._arrays()[0]

    @property
    def logprobs(self) -> np.ndarray:
        """[T] float32; behaviour log-prob of each sampled token, 0 for prompt."""
        return self._arrays()[1]

    @property
    def versions(self) -> np.ndarray:
        """[T] int32; policy version that sampled the token, -1 for prompt."""
        return self._arrays()[2]

    @property
    def loss_mask(self) -> np.ndarray:
        """[T] bool; True for tokens the loss trains on."""
        return self._arrays()[3]

    @property
    def num_tokens(self) -> int:
        if self._parts is not None:
            return self.num_prompt_tokens + len(self._parts[1])
        return len(self._joined[0])

    @property
    def output_ids(self) -> np.ndarray:
        if self._parts is not None:
            return self._parts[1]
        return self._joined[0][self.num_prompt_tokens :]

    @property
    def num_model_tokens(self) -> int:
        """Output tokens the model sampled (all of them, unless this is an episode)."""
        if self._parts is not None:
            mask = self._parts[4]
            return len(self._parts[1]) if mask is None else int(np.count_nonzero(mask))
        return int(np.count_nonzero(self._joined[3][self.num_prompt_tokens :]))

    @property
    def num_loss_tokens(self) -> int:
        """Tokens the loss trains on (loss mask True)."""
        if self._parts is not None:
            return self.num_model_tokens  # a prompt is never trained on
        return int(np.count_nonzero(self._joined[3]))

    def oldest_version(self) -> int:
        """Version of the oldest policy that sampled any token (staleness = current - this)."""
        if self._oldest is None:
            self._oldest = self._find_oldest()
        return self._oldest

    def _find_oldest(self) -> int:
        if self._parts is not None:  # kept apart: the prompt is all PROMPT_VERSION
            versions = self._parts[3]
            return _oldest_sampled(versions.versions if type(versions) is VersionRuns else versions)
        versions = self._joined[2]
        prompt = versions[: self.num_prompt_tokens]
        if prompt.min() == prompt.max() == PROMPT_VERSION:  # all but episodes' built ones
            return _oldest_sampled(versions[self.num_prompt_tokens :])
        return _oldest_sampled(versions)

    def newest_version(self) -> int:
        """Version of the newest policy that sampled any token (PROMPT_VERSION if none did),
        read without joining a kept trajectory's arrays."""
        if self._parts is not None:  # kept apart: the prompt is all PROMPT_VERSION
            versions = self._parts[3]
            return _newest_sampled(versions.versions if type(versions) is VersionRuns else versions)
        return _newest_sampled(self._joined[2])

    def _write(
        self,
        start: int,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        loss_mask: np.ndarray,
        trained: bool,
    ) -> None:
        """Write this trajectory into [start, start + T) of packed arrays (`pack_arrays`),
        each token of each array once. `trained` False: its loss mask is all False."""
        if self._parts is None:
            end = start + len(self._joined[0])
            token_ids[start:end], logprobs[start:end], versions[start:end] = self._joined[:3]
            loss_mask[start:end] = self._joined[3] if trained else False
            return
        prompt, ids, out_logprobs, out_versions, mask = self._parts
        mid = start + len(prompt)
        end = mid + len(ids)
        token_ids[start:mid], token_ids[mid:end] = prompt, ids
        logprobs[start:mid], logprobs[mid:end] = 0.0, out_logprobs
        versions[start:mid] = PROMPT_VERSION
        if type(out_versions) is VersionRuns:  # a few runs: each written as one value
            run_start = mid
            for version, length in zip(
                out_versions.versions.tolist(), out_versions.lengths.tolist(), strict=True
            ):
                versions[run_start : run_start + length] = version
                run_start += length
        else:
            versions[mid:end] = out_versions
        loss_mask[start:mid] = False
        loss_mask[mid:end] = (True if mask is None else mask) if trained else False


def _per_token(versions: np.ndarray | VersionRuns) -> np.ndarray:
    return versions.expanded() if isinstance(versions, VersionRuns) else versions


def _oldest_sampled(versions: np.ndarray) -> int:
    """The least version in `versions` other than PROMPT_VERSION (PROMPT_VERSION if none).
    A completion without observation tokens holds no PROMPT_VERSION: its least is the
    answer, one reduction instead of a mask and a copy of every token (the controller asks
    for each trained trajectory)."""
    if len(versions):
        least = versions.min()
        if least != PROMPT_VERSION:
            return int(least)
    sampled = versions[versions != PROMPT_VERSION]
    return int(sampled.min()) if len(sampled) else PROMPT_VERSION


def _newest_sampled(versions: np.ndarray) -> int:
    """The greatest version in `versions` other than PROMPT_VERSION (PROMPT_VERSION if none):
    `_oldest_sampled`'s counterpart, one reduction when the greatest is a sampled one."""
    if len(versions):
        most = versions.max()
        if most != PROMPT_VERSION:
            return int(most)
    sampled = versions[versions != PROMPT_VERSION]
    return int(sampled.max()) if len(sampled) else PROMPT_VERSION


def _check_num_prompt(prompt_id: str, num_prompt_tokens: int, num_tokens: int) -> None:
    if not 0 < num_prompt_tokens <= num_tokens:
        raise ValueError(
            f"trajectory {prompt_id!r}: num_prompt_tokens={num_prompt_tokens} "
            f"outside (0, {num_tokens}]"
        )


def _kept_as_is(prompt_ids: Any, output_ids: Any, logprobs: Any, versions: Any, mask: Any) -> bool:
    """The arrays have the trajectory's own types (1-D int32 ids and versions, float32
    log-probs, a bool mask per token or none): `from_generation` keeps them without a copy,
    and every reader sees what the copy would have held."""
    return (
        type(prompt_ids) is type(output_ids) is type(logprobs) is type(versions) is np.ndarray
        and prompt_ids.dtype == output_ids.dtype == versions.dtype == np.int32
        and logprobs.dtype == np.float32
        and prompt_ids.ndim == output_ids.ndim == logprobs.ndim == versions.ndim == 1
        and (mask is True or (mask.ndim == 1 and len(mask) == len(output_ids)))
    )


@dataclass(kw_only=True)
class PackedBatch:
    """Sequences concatenated without padding. N = total tokens, S = number of sequences.

    `logprobs[t]`, `versions[t]` and `loss_mask[t]` describe token t itself; a causal LM
    predicts token t from position t-1, so the first token of each sequence has no
    prediction and is never in the loss (prompts are at least one token long).
    """

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32, behaviour
    versions: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    cu_seqlens: torch.Tensor  # [S+1] int32, cu_seqlens[0] = 0, cu_seqlens[-1] = N
    rewards: torch.Tensor  # [S] float32
    group_ids: torch.Tensor  # [S] int64

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def seqlens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def position_ids(self) -> torch.Tensor:
        """[N] position of each token within its own sequence."""
        starts = torch.repeat_interleave(self.cu_seqlens[:-1].long(), self.seqlens.long())
        return torch.arange(len(self.token_ids)) - starts

    def seq_index(self) -> torch.Tensor:
        """[N] index of the sequence each token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_seqs), self.seqlens.long())

    def token_index(self, seq_indices: Sequence[int]) -> torch.Tensor:
        """[M] positions in this batch of the tokens of the given sequences, in that order."""
        starts, ends = self.cu_seqlens[:-1], self.cu_seqlens[1:]
        parts = [torch.arange(int(starts[i]), int(ends[i])) for i in seq_indices]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def select(self, seq_indices: Sequence[int]) -> PackedBatch:
        """A new packed batch holding the given sequences, in the given order."""
        starts, ends = self.cu_seqlens[:-1], self.cu_seqlens[1:]
        idx = list(seq_indices)
        token_index = self.token_index(idx)
        lengths = torch.tensor([int(ends[i] - starts[i]) for i in idx], dtype=torch.int32)
        return PackedBatch(
            token_ids=self.token_ids[token_index],
            logprobs=self.logprobs[token_index],
            versions=self.versions[token_index],
            loss_mask=self.loss_mask[token_index],
            cu_seqlens=torch.cat(
                [torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0, dtype=torch.int32)]
            ),
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
        )


def pack(trajectories: Sequence[Trajectory]) -> PackedBatch:
    """Concatenate trajectories into one padding-free batch."""
    if not trajectories:
        raise ValueError("cannot pack an empty list of trajectories")
    lengths = torch.tensor([t.num_tokens for t in trajectories], dtype=torch.int32)
    return PackedBatch(
        token_ids=torch.from_numpy(np.concatenate([t.token_ids for t in trajectories])).long(),
        logprobs=torch.from_numpy(np.concatenate([t.logprobs for t in trajectories])).float(),
        versions=torch.from_numpy(np.concatenate([t.versions for t in trajectories])).long(),
        loss_mask=torch.from_numpy(np.concatenate([t.loss_mask for t in trajectories])).bool(),
        cu_seqlens=torch.cat(
            [torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0, dtype=torch.int32)]
        ),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
    )


class PackedArrays(TypedDict):
    """The packed arrays of a Train message (areal.messages.Train), by field name."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray
    rewards: np.ndarray
    group_ids: np.ndarray


def pack_arrays(
    trajectories: Sequence[Trajectory], masked: Sequence[bool] | None = None
) -> PackedArrays:
    """`pack` as the numpy arrays of a Train message (areal.messages.Train): token_ids,
    versions and cu_seqlens int32, logprobs and rewards float32, loss_mask bool, group_ids
    int64. One copy of each trajectory's arrays, none of the whole batch in int64: the
    controller builds each data-parallel rank's share with it (tens of millions of tokens
    per step at cluster scale). An empty list gives empty arrays (a rank with no sequence).
    `masked[i]`: no token of trajectory i is trained on (loss mask all False)."""
    lengths = np.fromiter((t.num_tokens for t in trajectories), np.int32, len(trajectories))
    cu_seqlens = np.concatenate([np.zeros(1, np.int32), np.cumsum(lengths, dtype=np.int32)])
    total = int(cu_seqlens[-1])
    # Each token of each field written once (Trajectory._write, prompts' constants
    # included): filling the arrays beforehand would be a second pass over every token of
    # the batch, for the few that are prompts.
    arrays = {
        "token_ids": np.empty(total, np.int32),
        "logprobs": np.empty(total, np.float32),
        "versions": np.empty(total, np.int32),
        "loss_mask": np.empty(total, bool),
    }
    for i, (t, start) in enumerate(zip(trajectories, cu_seqlens[:-1].tolist(), strict=True)):
        t._write(start, **arrays, trained=masked is None or not masked[i])
    return PackedArrays(
        token_ids=arrays["token_ids"],
        logprobs=arrays["logprobs"],
        versions=arrays["versions"],
        loss_mask=arrays["loss_mask"],
        cu_seqlens=cu_seqlens,
        rewards=np.array([t.reward for t in trajectories], dtype=np.float32),
        group_ids=np.array([t.group_id for t in trajectories], dtype=np.int64),
    )
