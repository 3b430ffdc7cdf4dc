"""The vLLM worker extension of the vLLM engine: in-place weight loading inside vLLM's workers.

vLLM mixes this class into its worker class in every worker process
(`worker_extension_cls`); `VllmEngine` calls its methods by name through
`AsyncLLM.collective_rpc`, which runs them on every tensor-parallel rank. Method names
start with `areal_` so they cannot shadow vLLM's own (vLLM refuses a clash).

Loading is vLLM's own mechanism: `model.load_weights(iterator of (HF name, tensor))`,
whose per-parameter weight loaders handle fused layers (qkv, gate/up), tensor-parallel
sharding, tied heads and dtype conversion. On GPU nothing else is needed (the engine resets
vLLM's prefix cache afterwards). On the CPU backend the layers' prepacked GEMM copies are
rebuilt from the new weights (`vllm_plugin.refresh_prepacked`), which the plugin makes
possible.

Not here: choosing or validating what to load (vllm_engine.py / vllm_transfer.py check
names and shapes before calling), caches of the scheduler (EngineCore, reset by the engine).
"""

from __future__ import annotations

import torch

from areal.models.weight_slots import SlotReader
from areal.models.weights import load_tensors
from areal.workers.rollout import vllm_plugin
from areal.workers.rollout.vllm_transfer import read_shared

__all__ = ["WeightUpdateExtension"]

_SLOTS = SlotReader()
"""This vLLM worker process's mappings of shared-memory slots (weight_sync.mode=shm)."""


class WeightUpdateExtension:
    """Methods run in vLLM's worker processes (`self` is vLLM's worker)."""

    def areal_check_updatable(self) -> str:
        """Raise if this worker's model cannot be updated in place; returns the device type."""
        model_config = self.model_runner.model_config
        device_type = self.model_runner.device.type
        if device_type == "cpu":
            if model_config.quantization is not None:
                raise NotImplementedError(
                    f"in-place weight updates of a {model_config.quantization!r}-quantised model "
                    "on vLLM's CPU backend are not supported (its kernels repack weights the "
                    "areal plugin does not refresh); serve an unquantised model"
                )
            from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

            if any(
                isinstance(getattr(m, "quant_method", None), FusedMoEMethodBase)
                for m in self.model_runner.model.modules()
            ):
                raise NotImplementedError(
                    "in-place weight updates of MoE models on vLLM's CPU backend are not "
                    "supported (the CPU MoE kernels prepack expert weights); use a GPU"
                )
            vllm_plugin.require_active()
        return device_type

    def areal_load_weights(self, source: dict, repack: bool = True) -> int:
        """Load a full weight set; returns the number of tensors read.

        source: {"disk": directory} or {"shared": SharedWeights.rpc_args()}.
        repack=False skips the CPU refresh; it exists only so that a test can show that the
        CPU backend then serves stale weights (new embeddings and norms, old linear layers).
        """
        if "disk" in source:
            tensors = list(load_tensors(source["disk"]).items())
        elif "shared" in source:
            tensors = read_shared(source["shared"])
        elif "slot" in source:  # the rollout worker holds the slot's lock meanwhile
            tensors = _SLOTS.check(source["slot"], source["version"])
        else:
            raise ValueError(f"weight source {sorted(source)} is none of 'disk', 'shared', 'slot'")
        model = self.model_runner.model
        with torch.no_grad():
            loaded = model.load_weights(tensors)
        params = {name for name, _ in model.named_parameters()}
        if loaded is not None and params - set(loaded):
            missing = sorted(params - set(loaded))
            raise RuntimeError(
                f"vLLM loaded no tensor into {missing[0]!r} ({len(missing)} "
                "parameters not updated); the weight names do not match the "
                "model's checkpoint names"
            )
        if repack and self.model_runner.device.type == "cpu":
            vllm_plugin.refresh_prepacked(model)
        return len(tensors)
