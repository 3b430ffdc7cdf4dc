"""The inference-engine interface every rollout engine implements (built-in torch, vLLM).

An engine samples completions for token prompts and reports, per sampled token, its
behaviour log-prob. It can be paused (every running request returns the tokens it has so
far, marked ABORT), have its weights replaced in place while paused (every KV/prefix cache
built with the old weights is dropped), and resumed. Resubmitting interrupted requests and
tagging tokens with policy versions is not the engine's job: `interruptible.py` does that
once for all engines.

Life cycle (one asyncio event loop; every method must be called from it):

    created --start()--> running --pause()--> paused --resume()--> running
                                                 |  update_weights(source) (paused only)
    any state --close()--> closed

A method called in the wrong state raises `EngineStateError` naming the state and the fix.
`generate` while paused returns at once with no tokens and finish reason ABORT. Control
calls (start, pause, update_weights, resume, close) are atomic: cancelling the caller does
not cancel the operation, which completes in the background; the next one waits for it.

Behaviour log-probs (docs/design.md section 4). `logprobs[i]` is the natural log of the
probability with which `token_ids[i]` was drawn, under the distribution actually sampled
from, computed in float32:

    z = logits.float() / temperature          (temperature > 0)
    z = top_p_filter(z, top_p)                (top_p < 1 only; see `processed_logprobs`)
    logprob = log_softmax(z)[token]

At top_p = 1 this is exactly `log_softmax(logits / temperature)`, which is what the
trainer recomputes (`areal.models.logprobs.packed_logprobs(..., temperature=T)`). With
top_p < 1 it is the log-prob under the renormalised nucleus, which a trainer recomputation
without the same filter does not reproduce. Temperature 0 means greedy decoding (argmax);
the distribution sampled from is then a point mass and every reported log-prob is 0.0.
`processed_logprobs` below is the executable definition the engines are tested against.

Not here: processes, transport, policy versions, resubmission, tokenisation.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping, Sequence

import torch

from areal.messages import FinishReason

__all__ = [
    "AdapterWeights",
    "DiskWeights",
    "Engine",
    "EngineDeadError",
    "EngineOutput",
    "EngineState",
    "EngineStateError",
    "FinishReason",
    "SamplingParams",
    "SerialControlEngine",
    "SlotWeights",
    "TensorWeights",
    "WeightSource",
    "check_request",
    "processed_logprobs",
]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one completion."""

    max_new_tokens: int
    """Completion token budget (>= 1); generation ends with LENGTH when it is used up."""
    temperature: float = 1.0
    """Softmax temperature (> 0), or 0 for greedy decoding (log-probs are then 0.0)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables the filter."""
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    """Sampling one of these ends generation with STOP; the stop token is the last output
    token. The engine adds nothing itself: pass the tokenizer's EOS here."""
    seed: int | None = None
    """The request's own random stream (0 <= seed < 2**63, areal.seeds): its tokens then
    depend only on the seed, the prompt and the weights, not on the requests sharing its
    batches. None: the engine's own stream."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an int >= 1"
            )
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature!r} must be >= 0 (0: greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} must be in (0, 1]")
        stop = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise ValueError(f"SamplingParams.stop_token_ids={list(stop)} holds a negative id")
        object.__setattr__(self, "stop_token_ids", stop)
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 1 << 63
        ):
            raise ValueError(
                f"SamplingParams.seed={self.seed!r} must be an int in [0, 2**63) or None"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(kw_only=True)
class EngineOutput:
    """What one `Engine.generate` call produced. Lists have length T (completion tokens)."""

    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each token (see the module docstring)."""
    finish_reason: FinishReason
    """STOP (last token is a stop token), LENGTH (budget used up) or ABORT (paused while
    running: the tokens so far, possibly none)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"EngineOutput: {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs"
            )


@dataclass(frozen=True)
class DiskWeights:
    """A directory of safetensors files (a full checkpoint under Hugging Face names)."""

    path: str | Path


@dataclass(frozen=True)
class TensorWeights:
    """A full set of named tensors already in memory (e.g. received from a stream)."""

    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class SlotWeights:
    """A full weight set in a shared-memory slot (weight_sync.mode=shm), read in place
    under the slot's lock (areal.models.weight_slots)."""

    path: str
    version: int


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter for the engine's base model, under PEFT's names (areal.models.lora):
    a PEFT directory (`path`) or tensors in memory. `version` names it: an engine that
    keeps several adapters registered (vLLM) serves each version under its own name."""

    version: int
    path: str | Path | None = None
    tensors: Mapping[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.tensors is None):
            raise ValueError("AdapterWeights takes a directory or tensors, exactly one")


WeightSource = DiskWeights | TensorWeights | SlotWeights | AdapterWeights


class EngineState(str, enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    CLOSED = "closed"


class EngineStateError(RuntimeError):
    """A method was called in a state that does not allow it (e.g. update while running)."""


class EngineDeadError(RuntimeError):
    """The engine's generation loop died; the engine cannot serve requests any more."""


class Engine(ABC):
    """Asynchronous generation with abort-on-pause and in-place weight updates."""

    @property
    @abstractmethod
    def state(self) -> EngineState:
        """Where the engine is in its life cycle (see the module docstring)."""

    @abstractmethod
    async def start(self) -> None:
        """Load the model and start serving (created -> running)."""

    @abstractmethod
    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> EngineOutput:
        """Sample a completion of `prompt_ids` ([P] token ids, P >= 1).

        `request_id` must be unique among this engine's running requests. Returns early with
        ABORT and the tokens so far if the engine is paused (or closed) meanwhile, and at
        once with ABORT and no tokens if it is paused already. A call running when `pause()`
        is called always returns ABORT: it never continues under weights loaded later, so
        every token of one call comes from one set of weights. Cancelling the awaiting task
        cancels the request in the engine.
        """

    @abstractmethod
    async def pause(self) -> None:
        """Abort everything in flight (running -> paused).

        When this returns, every running `generate` has returned (or will, without further
        model work) its tokens so far with ABORT, and the model is not in use.
        """

    @abstractmethod
    async def update_weights(self, source: WeightSource) -> None:
        """Load a full weight set in place, or (an engine built with LoRA) serve a new
        adapter, and drop every cache (paused only).

        Names and shapes are checked before anything is copied: on error the old weights
        stay. An engine built with LoRA takes `AdapterWeights` only (its base is frozen),
        one without takes full weights only.
        """

    @abstractmethod
    async def resume(self) -> None:
        """Serve again (paused -> running), with empty caches."""

    @abstractmethod
    async def close(self) -> None:
        """Abort everything in flight and release the model; idempotent."""


class SerialControlEngine(Engine):
    """The life-cycle machinery both engines share: a state, one lock over control calls,
    and one worker thread for blocking model work.

    Control calls are atomic: each runs as its own task, shielded, so a cancelled caller
    cannot leave a half-stopped or half-loaded engine behind; the next control call waits
    for it (subclasses take `self._control` in `_start`, `_pause`, ...).
    """

    def __init__(self) -> None:
        self._state = EngineState.CREATED
        self._control = asyncio.Lock()
        self._executor: ThreadPoolExecutor | None = None
        """Created by the subclass's `_start`, shut down by its `_close`."""

    @property
    def state(self) -> EngineState:
        return self._state

    async def start(self) -> None:
        await asyncio.shield(self._start())

    async def pause(self) -> None:
        await asyncio.shield(self._pause())

    async def update_weights(self, source: WeightSource) -> None:
        await asyncio.shield(self._update_weights(source))

    async def resume(self) -> None:
        await asyncio.shield(self._resume())

    async def close(self) -> None:
        await asyncio.shield(self._close())

    @abstractmethod
    async def _start(self) -> None: ...

    @abstractmethod
    async def _pause(self) -> None: ...

    @abstractmethod
    async def _update_weights(self, source: WeightSource) -> None: ...

    @abstractmethod
    async def _resume(self) -> None: ...

    @abstractmethod
    async def _close(self) -> None: ...

    async def _run_blocking(self, fn, *args):
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _require(self, state: EngineState, method: str, fix: str) -> None:
        if self._state is not state:
            raise EngineStateError(
                f"{method}() needs a {state.value} engine, but it is {self._state.value}; {fix}"
            )


def check_request(
    request_id: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    fix: str,
) -> list[int]:
    """The prompt as a list of ints, after the checks every engine makes before submitting:
    not empty, token ids inside the vocabulary, prompt + budget within `max_seq_len`
    (`fix`: how to raise that limit on this engine)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    bad = [t for t in (*prompt, *params.stop_token_ids) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"request {request_id!r}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    if len(prompt) + params.max_new_tokens > max_seq_len:
        raise ValueError(
            f"request {request_id!r}: prompt ({len(prompt)}) + max_new_tokens "
            f"({params.max_new_tokens}) exceeds the engine's max_seq_len={max_seq_len}{fix}"
        )
    return prompt


def processed_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, *, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """[N] behaviour log-probs of `token_ids` [N] under `logits` [N, V] (the definition).

    temperature 0: greedy, a point mass, so 0.0 for the argmax token (and -inf otherwise).
    top_p < 1: the nucleus filter of transformers' (and vLLM's) samplers: sort ascending,
    drop the tokens whose cumulative probability is <= 1 - top_p, always keep the most
    likely token, renormalise.
    """
    z = logits.float()
    if temperature == 0:
        hit = z.argmax(-1) == token_ids
        return torch.where(hit, 0.0, float("-inf"))
    z = z / temperature
    if top_p < 1:
        sorted_z, order = torch.sort(z, dim=-1, descending=False)
        # The threshold in float32, as the samplers compute it.
        threshold = 1 - torch.tensor(top_p, dtype=torch.float32)
        remove = sorted_z.softmax(-1).cumsum(-1) <= threshold
        remove[..., -1] = False
        z = z.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return torch.log_softmax(z, dim=-1).gather(-1, token_ids[:, None].long()).squeeze(-1)
