"""Trajectories and their padding-free packed form.

A `Trajectory` is one sampled completion with everything the decoupled PPO objective
needs per token: the token, the behaviour log-prob recorded when it was sampled, and the
policy version that sampled it (-1 for prompt tokens). An episode (several model turns with
observations between them, DESIGN.md section 10) is one trajectory too: its observation
tokens are stored like prompt tokens (version -1, log-prob 0, loss mask False), so nothing
downstream (packing, staleness, the loss) needs to know about turns. Arrays are numpy so
that they travel as raw ZeroMQ frames; `pack` turns a batch into flat torch tensors with
cumulative sequence lengths for varlen forward passes. Nothing here computes losses or
talks to processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

PROMPT_VERSION = -1
"""Version recorded for prompt tokens: they were not sampled by any policy."""


@dataclass(kw_only=True)
class Trajectory:
    """One prompt + completion. All per-token arrays have shape [T] (T = prompt + completion)."""

    prompt_id: str
    group_id: int
    """Index of the prompt group (the samples of one prompt, one advantage group) in the run."""
    token_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32; behaviour log-prob of each sampled token, 0 for prompt
    versions: np.ndarray  # [T] int32; policy version that sampled the token, -1 for prompt
    loss_mask: np.ndarray  # [T] bool; True for tokens the loss trains on
    num_prompt_tokens: int
    reward: float = 0.0
    finish_reason: str = "length"
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: 'submitted', 'generated', 'rewarded' (controller clock), 'generation' (span)."""
    episode: dict[str, Any] = field(default_factory=dict)
    """Episodes only: 'turns', 'tool_calls', 'tool_errors' (counts), 'tool_s' (seconds) and
    'end' (its EpisodeEnd value); empty for a single completion."""

    def __post_init__(self) -> None:
        lengths = {len(self.token_ids), len(self.logprobs), len(self.versions), len(self.loss_mask)}
        if len(lengths) != 1:
            raise ValueError(
                f"trajectory {self.prompt_id!r}: per-token arrays differ in length "
                f"(token_ids={len(self.token_ids)}, logprobs={len(self.logprobs)}, "
                f"versions={len(self.versions)}, loss_mask={len(self.loss_mask)})"
            )
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"trajectory {self.prompt_id!r}: num_prompt_tokens={self.num_prompt_tokens} "
                f"outside (0, {len(self.token_ids)}]"
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
    ) -> "Trajectory":
        """Assemble prompt and completion; completion tokens are trained on, prompt tokens not.

        `output_loss_mask` [T]: False for observation tokens of an episode, which must carry
        version PROMPT_VERSION; None: every output token was sampled."""
        num_prompt, num_out = len(prompt_ids), len(output_ids)
        if not num_out == len(output_logprobs) == len(output_versions):
            raise ValueError(
                f"trajectory {prompt_id!r}: per-token arrays differ in length (output_ids="
                f"{num_out}, logprobs={len(output_logprobs)}, versions={len(output_versions)})")
        # A single completion (no mask) is all sampled tokens: nothing to check or build.
        out_mask = True if output_loss_mask is None else np.asarray(output_loss_mask, bool)
        if out_mask is not True and len(out_mask) == num_out and not out_mask.all():
            observed = np.asarray(output_versions)[~out_mask]
            if (observed != PROMPT_VERSION).any():
                raise ValueError(f"trajectory {prompt_id!r}: observation tokens (loss mask "
                                 f"False) must have version {PROMPT_VERSION}, got "
                                 f"{sorted(set(observed.tolist()))}")
        # Filled in place (no temporaries): the controller builds one per finished sample.
        # Each element written once (no zero fill first): the controller builds one per
        # finished sample, thousands per step at cluster scale.
        token_ids = np.empty(num_prompt + num_out, np.int32)
        token_ids[:num_prompt], token_ids[num_prompt:] = prompt_ids, output_ids
        logprobs = np.empty(num_prompt + num_out, np.float32)
        logprobs[:num_prompt], logprobs[num_prompt:] = 0.0, output_logprobs
        versions = np.empty(num_prompt + num_out, np.int32)
        versions[:num_prompt], versions[num_prompt:] = PROMPT_VERSION, output_versions
        loss_mask = np.empty(num_prompt + num_out, bool)
        loss_mask[:num_prompt], loss_mask[num_prompt:] = False, out_mask
        return cls(prompt_id=prompt_id, group_id=group_id, token_ids=token_ids,
                   logprobs=logprobs, versions=versions, loss_mask=loss_mask,
                   num_prompt_tokens=num_prompt, finish_reason=finish_reason)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> np.ndarray:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_model_tokens(self) -> int:
        """Output tokens the model sampled (all of them, unless this is an episode)."""
        return int(np.count_nonzero(self.loss_mask[self.num_prompt_tokens:]))

    def oldest_version(self) -> int:
        """Version of the oldest policy that sampled any token (staleness = current - this)."""
        # Most trajectories: a prompt of PROMPT_VERSION only and a completion without it
        # (not an episode), whose least version is the answer. Three reductions instead of a
        # mask and a copy of every token (the controller asks for each trained trajectory).
        prompt, completion = self.versions[:self.num_prompt_tokens], \
            self.versions[self.num_prompt_tokens:]
        if len(prompt) and len(completion) and prompt.min() == prompt.max() == PROMPT_VERSION:
            least = completion.min()
            if least != PROMPT_VERSION:
                return int(least)
        sampled = self.versions[self.versions != PROMPT_VERSION]
        return int(sampled.min()) if len(sampled) else PROMPT_VERSION


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

    def select(self, seq_indices: Sequence[int]) -> "PackedBatch":
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
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int32),
                                  torch.cumsum(lengths, 0, dtype=torch.int32)]),
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
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int32),
                              torch.cumsum(lengths, 0, dtype=torch.int32)]),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
    )


def pack_arrays(trajectories: Sequence[Trajectory],
                masked: Sequence[bool] | None = None) -> dict[str, np.ndarray]:
    """`pack` as the numpy arrays of a Train message (areal.messages.Train): token_ids,
    versions and cu_seqlens int32, logprobs and rewards float32, loss_mask bool, group_ids
    int64. One copy of each trajectory's arrays, none of the whole batch in int64: the
    controller builds each data-parallel rank's share with it (tens of millions of tokens
    per step at cluster scale). An empty list gives empty arrays (a rank with no sequence).
    `masked[i]`: no token of trajectory i is trained on (loss mask all False)."""
    lengths = np.fromiter((t.num_tokens for t in trajectories), np.int32, len(trajectories))

    def cat(name: str, dtype: type) -> np.ndarray:
        parts = [getattr(t, name) for t in trajectories]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    return {
        "token_ids": cat("token_ids", np.int32), "logprobs": cat("logprobs", np.float32),
        "versions": cat("versions", np.int32),
        "loss_mask": np.concatenate([np.zeros(t.num_tokens, bool) if masked is not None
                                     and masked[i] else t.loss_mask
                                     for i, t in enumerate(trajectories)])
        if trajectories else np.zeros(0, bool),
        "cu_seqlens": np.concatenate([np.zeros(1, np.int32), np.cumsum(lengths, dtype=np.int32)]),
        "rewards": np.array([t.reward for t in trajectories], dtype=np.float32),
        "group_ids": np.array([t.group_id for t in trajectories], dtype=np.int64),
    }
