"""The LoRA adapters a vLLM engine serves: one registered adapter per published version.

vLLM serves the frozen base model with LoRA enabled (`enable_lora`); each policy version's
adapter is registered under its own name and id (`LoRARequest("v<version>", id, path)`,
`AsyncLLM.add_lora`), never loaded over another one in place. A request is submitted with
the adapter that is current at its submission and keeps it until it finishes or is aborted
(an interruption: the resubmitted rest then gets the adapter current by then, see
interruptible.py). So an adapter stays registered while any request still runs on it, and
is removed (`remove_lora`, and its files) at the first update after its last request
ended: the pitfall of swapping an adapter under running requests cannot occur.

vLLM loads an adapter from a PEFT directory. `AdapterWeights(path=...)` (disk mode) is
loaded from where it is; tensors (stream, collective and shm modes) are first written as a
PEFT directory in /dev/shm (an adapter is megabytes), owned by this registry and removed
with the adapter. Names and shapes are checked against what the served base model's
adapters must look like (areal.models.lora.adapter_shapes) before vLLM sees anything, so a
bad update leaves the served adapter as it was.

Version 0 is the base model without an adapter: the trainer's version-0 adapters have
B = 0 and compute the base exactly.

Not here: pausing, caches (vllm_engine.py), versions of tokens (interruptible.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal.config import LoraConfig
from areal.models.lora import adapter_shapes, save_adapter_dir
from areal.workers.rollout.engine import AdapterWeights
from areal.workers.rollout.vllm_transfer import CheckpointLayout, safetensors_shapes

log = logging.getLogger(__name__)

_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks)."""
_SHM_DIR = Path("/dev/shm")


def engine_args(lora: LoraConfig) -> dict[str, Any]:
    """vLLM engine arguments that serve adapters of `lora`'s shape. Two adapters may be
    active in one batch (the current one and one whose requests finish after an update),
    a few more stay loaded in host memory."""
    rank = next((r for r in _VLLM_RANKS if r >= lora.rank), None)
    if rank is None:
        raise ValueError(
            f"trainer.lora.rank={lora.rank} is above {_VLLM_RANKS[-1]}, the "
            "largest rank vLLM serves"
        )
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 2, "max_cpu_loras": 4}


@dataclass
class _Adapter:
    request: Any
    """vLLM's LoRARequest."""
    owned_dir: Path | None
    """A directory this registry wrote (removed with the adapter)."""
    num_running: int = 0


class VllmAdapters:
    """The adapters registered in one vLLM engine, and which one new requests get."""

    def __init__(
        self, lora: LoraConfig, base_shapes: dict[str, tuple[int, ...]], base_model: str
    ) -> None:
        self._lora = lora
        self._base_model = base_model
        self._layout = CheckpointLayout(adapter_shapes(base_shapes, lora))
        if not self._layout.shapes:
            raise ValueError(
                f"trainer.lora.target_modules={lora.target_modules} matches no "
                f"linear layer of the model in {base_model!r}"
            )
        self._current: _Adapter | None = None
        self._registered: dict[int, _Adapter] = {}
        self._num_added = 0

    @property
    def current_name(self) -> str | None:
        """The name of the adapter new requests get (None: the base model, version 0)."""
        return self._current.request.lora_name if self._current else None

    @property
    def registered_names(self) -> list[str]:
        return [a.request.lora_name for a in self._registered.values()]

    def acquire(self) -> Any:
        """The LoRARequest for a request submitted now (None: the base model); pair every
        call with `release` once the request has ended."""
        adapter = self._current
        if adapter is None:
            return None
        adapter.num_running += 1
        return adapter.request

    def release(self, request: Any) -> None:
        if request is not None:
            self._registered[request.lora_int_id].num_running -= 1

    async def add(self, llm: Any, source: AdapterWeights) -> None:
        """Register `source` as a new adapter and make it current; then drop adapters that
        no request uses any more."""
        from vllm.lora.request import LoRARequest

        directory, owned = await self._directory(source)
        try:
            self._num_added += 1
            request = LoRARequest(
                lora_name=f"v{source.version}",
                lora_int_id=self._num_added,
                lora_path=str(directory),
                base_model_name=self._base_model,
            )
            if not await llm.add_lora(request):
                raise RuntimeError(
                    f"vLLM did not register adapter {request.lora_name!r} "
                    f"(id {request.lora_int_id})"
                )
        except BaseException:
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        self._current = self._registered[request.lora_int_id] = _Adapter(request, owned)
        await self.remove_idle(llm)

    async def remove_idle(self, llm: Any) -> None:
        """Remove every adapter but the current one that no running request uses."""
        for lora_id, adapter in list(self._registered.items()):
            if adapter is self._current or adapter.num_running:
                continue
            del self._registered[lora_id]
            try:
                await llm.remove_lora(lora_id)
            finally:
                if adapter.owned_dir is not None:
                    shutil.rmtree(adapter.owned_dir, ignore_errors=True)
            log.debug("adapter %s removed", adapter.request.lora_name)

    def close(self) -> None:
        """Remove the directories this registry wrote (vLLM is shut down by then)."""
        for adapter in self._registered.values():
            if adapter.owned_dir is not None:
                shutil.rmtree(adapter.owned_dir, ignore_errors=True)
        self._registered.clear()
        self._current = None

    async def _directory(self, source: AdapterWeights) -> tuple[Path, Path | None]:
        """(directory vLLM loads, the same if this registry wrote it) after the checks."""
        import asyncio

        if source.path is not None:
            shapes = await asyncio.to_thread(safetensors_shapes, source.path)
            self._layout.check(shapes, f"adapter v{source.version} in {str(source.path)!r}")
            return Path(source.path), None
        assert source.tensors is not None
        self._layout.check(
            {n: tuple(t.shape) for n, t in source.tensors.items()}, f"adapter v{source.version}"
        )
        root = _SHM_DIR if os.access(_SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())
        owned = Path(tempfile.mkdtemp(dir=root, prefix=f"areal-adapter-v{source.version}-"))
        try:
            await asyncio.to_thread(
                save_adapter_dir,
                owned,
                list(source.tensors.items()),
                self._lora,
                base_model=self._base_model,
            )
        except BaseException:
            shutil.rmtree(owned, ignore_errors=True)
            raise
        return owned, owned
