"""What a weight update that reached a rollout worker becomes for its engine.

    weight_sync.mode   arrives as                 full weights        LoRA (trainer.lora)
    disk               a version directory        DiskWeights         AdapterWeights(path)
    stream/collective  tensors                    TensorWeights       AdapterWeights(tensors)
    shm                a slot file                SlotWeights         PendingSlot -> tensors
    (Welcome after --resume: the checkpoint's weights directory, as in disk mode)

The run's config says whether updates are adapters: the trainer publishes adapters in every
mode when trainer.lora.rank > 0, and every worker gets the same config. A path is a slot
when it is not a directory (shm mode publishes slot files; a resumed run first serves the
checkpoint's directory).

Not here: loading (the engines), which version to load (the worker's update loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

import torch

from areal.config import RunConfig
from areal.models.weight_slots import SlotReader
from areal.workers.rollout.engine import (
    AdapterWeights,
    DiskWeights,
    SlotWeights,
    TensorWeights,
    WeightSource,
)

_SLOTS = SlotReader()
"""This process's mappings of shared-memory slots (LoRA adapters in shm mode)."""


@dataclass(frozen=True)
class PendingSlot:
    """An adapter in a shared-memory slot, copied out (megabytes) when its update runs:
    the engines take adapters as tensors or directories, and the slot may be overwritten
    once its lock is released."""

    path: str
    version: int

    def read(self) -> AdapterWeights:
        with _SLOTS.read(self.path, self.version) as views:
            tensors = {name: tensor.clone() for name, tensor in views}
        return AdapterWeights(self.version, tensors=tensors)


def path_source(cfg: RunConfig, path: str, version: int) -> WeightSource | PendingSlot:
    """The source of a version published at `path` (disk and shm modes, Welcome)."""
    lora = cfg.trainer.lora.enabled
    if Path(path).is_dir():
        return AdapterWeights(version, path=path) if lora else DiskWeights(path)
    return PendingSlot(path, version) if lora else SlotWeights(path, version)


def tensor_source(
    cfg: RunConfig, tensors: Mapping[str, torch.Tensor], version: int
) -> WeightSource:
    """The source of a version that arrived as tensors (stream and collective modes)."""
    if cfg.trainer.lora.enabled:
        return AdapterWeights(version, tensors=tensors)
    return TensorWeights(tensors)
