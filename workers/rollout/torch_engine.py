"""The built-in rollout engine: transformers' continuous batching over a Hugging Face causal LM.

Batching, the paged KV cache, sampling and behaviour log-probs are transformers'
(`generation/continuous_batching`, 5.19): a `ContinuousBatchingManager` runs the model on
its own generation thread; this module only feeds it requests from the asyncio event loop
and gets the results back through `register_result_handler`, whose callbacks transformers
schedules on the loop with `call_soon_threadsafe`. No model work runs on the event loop.

Sessions. One manager run (generation thread + a freshly allocated paged KV cache) is a
*session*. `pause()` ends the session with a hard stop: transformers then fails every
queued and running request with an output holding its tokens and log-probs so far, which
is delivered as ABORT. `update_weights()` copies the new tensors into the model in place
while no session exists, and `resume()` starts a new session, i.e. a new cache: KV or
prefix-cache blocks computed with old weights cannot be reused, by construction.

LoRA (`lora`, from trainer.lora). The model gets the same PEFT adapter layers as the
trainer's (areal.models.lora) and an update copies the new adapter tensors into them, in
place, while no session exists. The adapter is *applied*, not merged: every adapted layer
computes base(x) + (alpha / rank) * B(A(x)), exactly the trainer's forward, so behaviour
log-probs match the trainer's recomputation as closely as without LoRA; merging would
round W + (alpha / rank) B A into the base weights (not the trainer's arithmetic), and
merging and unmerging version after version drifts. The cost is two thin matmuls per
adapted layer and token. At version 0 (B = 0) the output is the base model's exactly.

Sampling through transformers' per-request logits processors, in this order: temperature,
top-k, top-p; the log-prob is `log(softmax(processed scores)[token])` in float32, which is
`processed_logprobs` of engine.py (checked in tests). The processors exist only if the
manager's GenerationConfig has non-neutral values, so it is built with placeholders and
every request passes its own values. Greedy (temperature 0) is top-k = 1 (log-prob 0.0);
`do_sample` is per manager in transformers, so it stays True.

Pitfalls of transformers 5.19 handled here (evidence in the tests and the report):
- requests drained from the input queue in the loop step that sees a hard stop are dropped
  without an output: after the thread is joined, unresolved requests are ABORT, no tokens;
- stopping a manager runs `gc.collect()` twice (~0.4 s with torch imported): the
  long-lived objects are frozen after the model is loaded (`gc.freeze()`, process-wide);
- an idle generation loop only notices a stop after its 0.1 s wait: it is woken up;
- the processor seeds the process-global torch RNG when a session starts; each session
  gets its own seed so that sessions do not replay the same random stream. That stream
  serves only requests without a seed: a request with `SamplingParams.seed` draws its
  tokens from its own stream (seeded_sampling.py), whatever shares its batch;
- a bad per-request value (e.g. top_k above the vocabulary, a token id out of range) fails
  the whole loop: every request is validated here first;
- without `num_blocks` the cache is sized from free *host* memory on CPU (80 % of RAM).

Not here: resubmission and versions (interruptible.py), processes and transport (worker.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, RequestStatus
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopKLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)
from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

from areal.config import LoraConfig, RunConfig
from areal.models.hf import load_model
from areal.models.lora import add_adapters, copy_adapters, load_adapter_dir
from areal.models.weight_slots import SlotReader
from areal.models.weights import copy_into_model, load_tensors
from areal.workers.rollout import seeded_sampling
from areal.workers.rollout.engine import (
    AdapterWeights,
    DiskWeights,
    EngineDeadError,
    EngineOutput,
    EngineState,
    EngineStateError,
    FinishReason,
    SamplingParams,
    SerialControlEngine,
    SlotWeights,
    TensorWeights,
    WeightSource,
    check_request,
)

log = logging.getLogger(__name__)

_PROCESSORS = (
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopKLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)


@dataclass
class _Request:
    future: asyncio.Future
    stop_token_ids: frozenset[int]


@dataclass
class _Session:
    """One run of a manager: its generation thread and its own paged KV cache."""

    manager: ContinuousBatchingManager
    requests: dict[str, _Request] = field(default_factory=dict)
    retired: bool = False
    """Set before the hard stop: from then on, failed outputs are aborts, not errors."""


class TorchEngine(SerialControlEngine):
    """Continuous batching on CPU or one GPU (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        threads: int = 1,
        max_concurrent: int = 128,
        seed: int = 0,
        max_cached_tokens: int | None = None,
        page_size: int = 64,
        max_batch_tokens: int = 512,
        trust_remote_code: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        """lora: serve LoRA adapters of this shape (updates are then AdapterWeights).
        max_concurrent: sequences decoded in one forward (more wait in the scheduler).
        max_cached_tokens: KV-cache capacity in tokens; None: max_concurrent sequences of
        min(model max length, 512) tokens. page_size: tokens per cache page.
        max_batch_tokens: tokens per forward (prefill is chunked to fit).
        threads: torch intra-op threads of the generation thread (process-wide setting)."""
        for name, value in (
            ("threads", threads),
            ("max_concurrent", max_concurrent),
            ("page_size", page_size),
            ("max_batch_tokens", max_batch_tokens),
        ):
            if value < 1:
                raise ValueError(f"TorchEngine {name}={value!r} must be >= 1")
        self._model_path = model_path
        self._dtype, self._device, self._threads = dtype, device, threads
        self._max_concurrent, self._seed = max_concurrent, seed
        self._max_cached_tokens, self._page_size = max_cached_tokens, page_size
        self._max_batch_tokens, self._trust_remote_code = max_batch_tokens, trust_remote_code
        self._lora = lora if lora is not None and lora.enabled else None
        self._slots = SlotReader()
        super().__init__()
        self._session: _Session | None = None
        self._num_sessions = 0
        self._num_requests = 0
        self._running_ids: set[str] = set()
        self._model: Any = None

    @classmethod
    def from_config(cls, cfg: RunConfig, index: int = 0) -> TorchEngine:
        """The engine of rollout worker `index` (model.path must be resolved by then)."""
        if cfg.model.path is None:
            raise ValueError(
                "model.path is null: the controller resolves the embedded model to "
                "a directory before starting workers; give TorchEngine a directory"
            )
        if cfg.rollout.devices:
            device = cfg.rollout.devices[index]
        elif torch.cuda.is_available():
            device = f"cuda:{index % torch.cuda.device_count()}"
        else:
            device = "cpu"
        return cls(
            cfg.model.path,
            dtype=cfg.model.dtype,
            device=device,
            threads=cfg.rollout.threads,
            max_concurrent=cfg.rollout.max_concurrent,
            seed=cfg.seed * 1000 + index,
            trust_remote_code=cfg.model.trust_remote_code,
            lora=cfg.trainer.lora,
        )

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + completion a request may ask for."""
        return min(self._max_positions, self._num_blocks * self._page_size)

    # ---------------------------------------------------------------- life cycle

    # Control calls are atomic (SerialControlEngine): e.g. a hard stop cancelled before its
    # thread ran cannot orphan a generation loop.

    async def _start(self) -> None:
        async with self._control:
            self._require(EngineState.CREATED, "start", "an engine starts once")
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="torch-engine")
            await self._run_blocking(self._load_model)
            self._session = await self._run_blocking(self._open_session)
            self._state = EngineState.RUNNING

    async def _pause(self) -> None:
        async with self._control:
            self._require(EngineState.RUNNING, "pause", "call resume() before pausing again")
            self._state = EngineState.PAUSED
            session, self._session = self._session, None
            assert session is not None
            await self._retire(session)

    async def _update_weights(self, source: WeightSource) -> None:
        async with self._control:
            self._require(EngineState.PAUSED, "update_weights", "call pause() first")
            await self._run_blocking(self._load_weights, source)

    async def _resume(self) -> None:
        async with self._control:
            self._require(EngineState.PAUSED, "resume", "resume() follows pause()")
            self._session = await self._run_blocking(self._open_session)
            self._state = EngineState.RUNNING

    async def _close(self) -> None:
        async with self._control:
            if self._state is EngineState.CLOSED:
                return
            self._state = EngineState.CLOSED
            session, self._session = self._session, None
            if session is not None:
                await self._retire(session)
            if self._executor is not None:
                self._executor.shutdown(wait=True)  # idle: control calls are serialised
            self._model = None
            self._slots.close()
            gc.unfreeze()  # frozen objects are never freed, not even at interpreter exit

    # ---------------------------------------------------------------- requests

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> EngineOutput:
        if self._state in (EngineState.CREATED, EngineState.CLOSED):
            raise EngineStateError(
                f"generate() on a {self._state.value} engine; call start() "
                "first (a closed engine cannot be restarted)"
            )
        prompt = self._check_request(request_id, prompt_ids, params)
        session = self._session
        if session is None:  # paused
            return EngineOutput(token_ids=[], logprobs=[], finish_reason=FinishReason.ABORT)
        if request_id in self._running_ids:
            raise ValueError(f"request_id {request_id!r} is already running in this engine")
        # transformers cancels by id, asynchronously: a new request reusing the id of one
        # just cancelled would be cancelled with it. Ids inside the manager are never reused.
        self._num_requests += 1
        internal_id = f"{request_id}@{self._num_requests}"
        future = asyncio.get_running_loop().create_future()
        session.requests[internal_id] = _Request(future, frozenset(params.stop_token_ids))
        self._running_ids.add(request_id)
        manager = session.manager
        try:
            manager.register_result_handler(internal_id, self._result_handler(session))
            submitted = manager.add_request(
                prompt,
                request_id=internal_id,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=list(params.stop_token_ids),
                streaming=False,
                **self._sampling_kwargs(params),
            )
            if submitted is None:
                raise EngineDeadError(
                    "the continuous-batching loop refused a request: it died with "
                    f"{manager.background_thread_status.fatal_error!r}"
                )
            return await future
        except asyncio.CancelledError:
            if not session.retired:
                manager.cancel_request(internal_id)  # frees its cache blocks; no output follows
            raise
        finally:
            self._running_ids.discard(request_id)
            session.requests.pop(internal_id, None)
            manager.output_router.result_handlers.pop(internal_id, None)

    def _result_handler(self, session: _Session):
        """The callback transformers runs on the event loop with a request's final output."""

        def on_output(output: Any) -> None:
            request = session.requests.get(output.request_id)
            if request is None or request.future.done():
                return  # cancelled meanwhile
            tokens, logprobs = list(output.generated_tokens), list(output.logprobs)
            if output.status == RequestStatus.FINISHED:
                stopped = bool(tokens) and tokens[-1] in request.stop_token_ids
                reason = FinishReason.STOP if stopped else FinishReason.LENGTH
            elif session.retired:
                reason = FinishReason.ABORT  # failed by the hard stop of pause() or close()
            else:
                request.future.set_exception(
                    EngineDeadError(
                        f"request {output.request_id!r} failed in the generation loop: "
                        f"{output.error}"
                    )
                )
                return
            request.future.set_result(
                EngineOutput(token_ids=tokens, logprobs=logprobs, finish_reason=reason)
            )

        return on_output

    def _check_request(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> list[int]:
        return check_request(
            request_id,
            prompt_ids,
            params,
            vocab_size=self._vocab_size,
            max_seq_len=self.max_seq_len,
            fix=" (model positions and KV-cache capacity); shorten it or raise max_cached_tokens",
        )

    def _sampling_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        # Python float/int exactly: transformers type-checks these with isinstance.
        seed = {} if params.seed is None else {"seed": int(params.seed)}
        if params.greedy:
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0, **seed}
        return {
            "temperature": float(params.temperature),
            "top_k": int(self._vocab_size),
            "top_p": float(params.top_p),
            **seed,
        }

    # ---------------------------------------------------------------- blocking parts

    def _load_model(self) -> None:
        torch.set_num_threads(self._threads)
        model = load_model(
            self._model_path,
            dtype=self._dtype,
            device=self._device,
            trust_remote_code=self._trust_remote_code,
        )
        if self._lora is not None:
            add_adapters(model, self._lora, seed=0).eval()  # eval: no adapter dropout
        text = model.config.get_text_config()
        self._vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._max_positions = int(getattr(text, "max_position_embeddings", 1 << 20))
        max_cached = self._max_cached_tokens or self._max_concurrent * min(self._max_positions, 512)
        self._num_blocks = max(1, math.ceil(max_cached / self._page_size))
        self._generation_config = GenerationConfig(
            do_sample=True,
            temperature=0.5,
            top_k=self._vocab_size,
            top_p=0.5,
            max_new_tokens=1,
            eos_token_id=-1,
        )  # placeholders: every request sets its own
        self._model = model
        # Every later gc.collect() (two per pause in transformers) skips these objects.
        gc.collect()
        gc.freeze()

    def _open_session(self) -> _Session:
        torch.set_num_threads(self._threads)  # the generation thread inherits the setting
        self._num_sessions += 1
        cb_config = ContinuousBatchingConfig(
            return_logprobs=True,
            per_request_processors=True,
            num_blocks=self._num_blocks,
            page_size=self._page_size,
            max_batch_tokens=self._max_batch_tokens,
            max_requests_per_batch=self._max_concurrent,
            seed=(self._seed * 1_000_003 + self._num_sessions) % (1 << 62),
            # Seeded sampling counts each request's tokens when its batch is prepared: the
            # previous batch's tokens must be in (no double-buffering, no graphs).
            use_async_batching=False,
            use_cuda_graph=False,
        )
        manager = self._model.init_continuous_batching(
            generation_config=self._generation_config, continuous_batching_config=cb_config
        )
        found = tuple(type(p) for p in manager.logit_processor.logits_processor)
        if found != _PROCESSORS:
            raise RuntimeError(
                f"transformers built logits processors {found}, expected "
                f"{_PROCESSORS}: behaviour log-probs would be wrong"
            )
        draws = seeded_sampling.install(manager)
        manager.warmup()  # allocates the cache here, so that a failure raises in start/resume
        seeded_sampling.install_sampler(manager, draws)
        manager.start()
        return _Session(manager)

    def _stop_session(self, manager: ContinuousBatchingManager) -> None:
        manager.background_thread_status.request_stop(
            BackgroundThreadStatus.HARD_STOP, manager.distributed_helper.global_rank
        )
        wake_up = getattr(manager, "_wake_up_loop", None)
        if wake_up is not None:
            wake_up.set()  # an idle loop would otherwise notice the stop after 0.1 s
        manager.stop(block=True, hard_stop=True)
        manager.destroy()

    def _load_weights(self, source: WeightSource) -> None:
        if self._lora is not None or isinstance(source, AdapterWeights):
            self._load_adapter(source)
        elif isinstance(source, SlotWeights):
            with self._slots.read(source.path, source.version) as views:
                copy_into_model(self._model, views, strict=True)
        elif isinstance(source, DiskWeights):
            copy_into_model(self._model, load_tensors(source.path), strict=True)
        elif isinstance(source, TensorWeights):
            copy_into_model(self._model, source.tensors, strict=True)
        else:
            raise TypeError(
                f"weight source {type(source).__name__} is not one of DiskWeights, "
                "TensorWeights, SlotWeights, AdapterWeights"
            )

    def _load_adapter(self, source: WeightSource) -> None:
        if not isinstance(source, AdapterWeights):
            raise TypeError(
                f"this engine serves LoRA adapters on a frozen base; it cannot "
                f"load full weights ({type(source).__name__})"
            )
        if self._lora is None:
            raise TypeError(
                "an adapter update for an engine built without LoRA; build it "
                "with lora=trainer.lora"
            )
        if source.tensors is not None:
            tensors = source.tensors
        else:
            assert source.path is not None  # a source holds its tensors or a path to them
            tensors = load_adapter_dir(source.path)
        copy_adapters(self._model, tensors)

    # ---------------------------------------------------------------- helpers

    async def _retire(self, session: _Session) -> None:
        """Hard-stop a session; every request in it returns ABORT with its tokens so far."""
        session.retired = True
        await self._run_blocking(self._stop_session, session.manager)
        # The loop's last outputs were queued with call_soon_threadsafe before its thread
        # ended, hence before the executor's completion: their callbacks have run. What is
        # still unresolved was dropped by transformers before it ran: no tokens.
        for request in session.requests.values():
            if not request.future.done():
                request.future.set_result(
                    EngineOutput(token_ids=[], logprobs=[], finish_reason=FinishReason.ABORT)
                )
