"""Publishing a new weight version from the trainer: to disk, or as a stream of buckets.

- disk: `<run_dir>/weights/v<version>/model.safetensors`, written atomically (a reader sees
  a complete file or none); older versions beyond `weight_sync.keep_versions` are removed.
- stream: the weights cut into buckets of at most `weight_sync.bucket_mb`, as WeightsChunk
  messages the controller relays to every rollout worker (no shared file system needed).

Tensors are copied to CPU before they leave, so the model may train on while they travel.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from areal.config import RunConfig
from areal.messages import WeightsChunk
from areal.models.weights import bucket_tensors, named_tensors, save_tensors


def version_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"v{version:06d}"


def publish_to_disk(model: torch.nn.Module, cfg: RunConfig, version: int) -> str:
    """Save `model` as weight version `version`; returns the directory."""
    directory = version_dir(cfg.run_dir, version)
    save_tensors(directory, named_tensors(model), metadata={"version": str(version)})
    _prune(Path(cfg.run_dir) / "weights", cfg.weight_sync.keep_versions)
    return str(directory)


def _prune(root: Path, keep: int) -> None:
    versions = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def stream_chunks(model: torch.nn.Module, cfg: RunConfig, version: int) -> list[WeightsChunk]:
    """The weights of `model` as WeightsChunk messages (CPU copies, buckets of bucket_mb)."""
    buckets = list(bucket_tensors(((n, t.detach().to("cpu", copy=True))
                                   for n, t in named_tensors(model)),
                                  cfg.weight_sync.bucket_mb << 20))
    return [WeightsChunk(version=version, index=i, num_chunks=len(buckets),
                         names=[name for name, _ in bucket], tensors=[t for _, t in bucket])
            for i, bucket in enumerate(buckets)]
