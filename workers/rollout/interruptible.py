"""Interruptible generation with per-token policy versions, shared by every engine.

`InterruptibleGenerator` wraps an `Engine` (built-in torch or vLLM, unchanged) and owns
the policy version of the weights it serves. `generate` runs one sequence as a series of
engine calls ("segments"): each segment is submitted as prompt + tokens so far with the
remaining budget; if the engine aborts it because new weights are being loaded, the
sequence waits for the new weights and is resubmitted (the new weights recompute the
prefix; nothing of the old KV cache is reused). Every token is tagged with the version of
the weights that sampled it, captured when its segment was submitted; earlier tokens keep
their version and behaviour log-prob (docs/design.md section 4).

State machine. The generator is the only one that pauses and resumes the engine.

    OPEN ------ hold_new_requests() / update_weights() -----> HELD   (gate closed: no new
     ^                                                          |     segment is submitted)
     |                                     interrupt=True       |      interrupt=False
     |                                  PAUSING: engine.pause() v  DRAINING: wait until no
     |                                  aborts running segments    segment is in the engine
     |                                          \\                 /
     |                                  LOADING: engine.update_weights(source); version = v
     |                                               |
     +---- last hold released, gate opens <---- engine.resume()

- The gate is open iff no update is running and no hold is pending. A segment is
  submitted only after its sequence saw the gate open, in the same event-loop step that
  registers it as in flight and reads the version, so no segment starts once an update has
  closed the gate, and an update (which runs after the gate closed) sees every running
  segment in the in-flight count.
- An engine call that was running when the engine was paused returns ABORT (engine
  contract), so all tokens of one segment come from the version read at its submission.
- A segment ending with ABORT while no update happened since its submission (the
  `epoch` did not move) is an engine fault and raises, instead of resubmitting in a loop.
- Updates are serialised by a lock, in call order; versions must increase.

Not here: the engine itself, transport, admission/staleness control (controller).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np

from areal.seeds import continuation_seed
from areal.workers.rollout.engine import (
    Engine,
    EngineState,
    EngineStateError,
    FinishReason,
    SamplingParams,
    WeightSource,
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class GenerationResult:
    """A finished completion. Lists have length T (completion tokens)."""

    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each token under the weights (and sampling) that drew it."""
    versions: list[int]
    """Policy version of the weights that sampled each token (non-decreasing)."""
    finish_reason: FinishReason
    """STOP or LENGTH; never ABORT (interrupted sequences are continued)."""
    num_interruptions: int
    """How many times the sequence was aborted by a weight update and resubmitted."""
    wait_s: float = 0.0
    """Seconds it waited for weight updates to end before its segments were submitted."""

    def token_ids_array(self) -> np.ndarray:
        return np.asarray(self.token_ids, dtype=np.int32)

    def logprobs_array(self) -> np.ndarray:
        return np.asarray(self.logprobs, dtype=np.float32)

    def versions_array(self) -> np.ndarray:
        return np.asarray(self.versions, dtype=np.int32)


class InterruptibleGenerator:
    """Resubmits interrupted sequences and tags tokens with policy versions (see module doc)."""

    def __init__(self, engine: Engine, *, version: int = 0) -> None:
        self._engine = engine
        self._version = version
        self._epoch = 0
        """Counts updates; a segment aborted within one epoch was not aborted by an update."""
        self._num_holds = 0
        self._updating = False
        self._open = asyncio.Event()
        self._open.set()
        self._num_in_engine = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._update_lock = asyncio.Lock()

    @property
    def version(self) -> int:
        """Policy version of the weights the engine serves (or will, once an update ends)."""
        return self._version

    @property
    def num_in_engine(self) -> int:
        """Segments submitted to the engine and not returned yet."""
        return self._num_in_engine

    def hold_new_requests(self) -> None:
        """Close the gate now, until the next `update_weights` call has finished.

        For a caller that learns of new weights before it can start loading them: sequences
        submitted from now on wait and get the new version. Each hold is released by one
        `update_weights` call (successful or not).
        """
        self._num_holds += 1
        self._refresh_gate()

    def release_hold(self) -> None:
        """Release one `hold_new_requests` whose update will never be applied (superseded)."""
        self._num_holds = max(0, self._num_holds - 1)
        self._refresh_gate()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> GenerationResult:
        """Sample a full completion of `prompt_ids`, across weight updates."""
        prompt = [int(t) for t in prompt_ids]
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        num_interruptions = 0
        wait_s = 0.0
        while True:
            if not self._open.is_set():
                waited_from = time.monotonic()
                while not self._open.is_set():
                    await self._open.wait()
                wait_s += time.monotonic() - waited_from
            # No await between the gate check and the submission (see the module doc).
            version, epoch = self._version, self._epoch
            segment = dataclasses.replace(
                params,
                max_new_tokens=params.max_new_tokens - len(tokens),
                seed=None if params.seed is None else continuation_seed(params.seed, len(tokens)),
            )
            self._enter_engine()
            try:
                out = await self._engine.generate(
                    f"{request_id}#{num_interruptions}", prompt + tokens, segment
                )
            finally:
                self._exit_engine()
            tokens += out.token_ids
            logprobs += out.logprobs
            versions += [version] * len(out.token_ids)
            reason = self._final_reason(out.finish_reason, tokens, params)
            if reason is not FinishReason.ABORT:
                return GenerationResult(
                    token_ids=tokens,
                    logprobs=logprobs,
                    versions=versions,
                    finish_reason=reason,
                    num_interruptions=num_interruptions,
                    wait_s=wait_s,
                )
            if epoch == self._epoch:
                if self._engine.state is EngineState.CLOSED:
                    raise EngineStateError(f"request {request_id!r}: the engine was closed")
                raise RuntimeError(
                    f"request {request_id!r}: the engine aborted a segment although no weight "
                    f"update ran (engine state {self._engine.state.value}); only "
                    "InterruptibleGenerator.update_weights may pause the engine it wraps"
                )
            num_interruptions += 1

    async def update_weights(
        self, source: WeightSource, version: int, *, interrupt: bool = True
    ) -> int:
        """Serve `source` as policy `version` from now on; returns the segments interrupted.

        interrupt=True: running segments are aborted at once and continue under the new
        weights. interrupt=False: no new segment starts; running ones finish under the old
        weights first (0 interrupted). On error the old weights and version stay, the
        engine is resumed and the error propagates. Cancelled, it resumes the engine too; a
        load already started still completes and takes effect with its version.
        """
        async with self._update_lock:
            stopping, load = False, None
            try:
                if version <= self._version:
                    raise ValueError(
                        f"weights version {version} is not newer than the served "
                        f"version {self._version}"
                    )
                self._updating = True
                self._epoch += 1
                self._refresh_gate()
                stopping = True
                num_interrupted = await self._stop_engine(interrupt)
                # Shielded: a load that started must end with its version, even if this call
                # is cancelled (the copy itself runs on in the engine's thread regardless).
                load = asyncio.ensure_future(self._load(source, version))
                await asyncio.shield(load)
                log.debug("serving version %d (%d segments interrupted)", version, num_interrupted)
                return num_interrupted
            finally:
                try:
                    if load is not None:
                        await asyncio.wait({load})  # cancelled: the version is set before serving
                    # Also after an error or a cancellation: never leave the engine paused.
                    if stopping and self._engine.state is EngineState.PAUSED:
                        await self._engine.resume()
                finally:
                    self._num_holds = max(0, self._num_holds - 1)
                    self._updating = False
                    self._refresh_gate()

    async def _load(self, source: WeightSource, version: int) -> None:
        await self._engine.update_weights(source)
        self._version = version  # before the gate reopens: update_weights waits for this

    async def _stop_engine(self, interrupt: bool) -> int:
        """Pause the engine, aborting running segments or (interrupt=False) after them."""
        if interrupt:
            num_interrupted = self._num_in_engine
        else:
            num_interrupted = 0
            await self._drained.wait()
        await self._engine.pause()
        return num_interrupted

    @staticmethod
    def _final_reason(
        reason: FinishReason, tokens: list[int], params: SamplingParams
    ) -> FinishReason:
        # A segment aborted right after its stop token or last budgeted token is complete.
        if reason is FinishReason.ABORT and tokens:
            if tokens[-1] in params.stop_token_ids:
                return FinishReason.STOP
            if len(tokens) >= params.max_new_tokens:
                return FinishReason.LENGTH
        return reason

    def _refresh_gate(self) -> None:
        if self._updating or self._num_holds:
            self._open.clear()
        else:
            self._open.set()

    def _enter_engine(self) -> None:
        self._num_in_engine += 1
        self._drained.clear()

    def _exit_engine(self) -> None:
        self._num_in_engine -= 1
        if self._num_in_engine == 0:
            self._drained.set()
