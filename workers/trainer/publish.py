"""Publishing a new weight version from the trainer: to disk, as a stream of buckets, or as a
snapshot for the collective broadcast.

- disk: `<run_dir>/weights/v<version>/model.safetensors`, written atomically (a reader sees
  a complete file or none); older versions beyond `weight_sync.keep_versions` are removed.
- stream: the weights cut into buckets of at most `weight_sync.bucket_mb`, as WeightsChunk
  messages the controller relays to every rollout worker (no shared file system needed).
- collective: the weights flattened into CPU buckets of `weight_sync.bucket_mb`
  (areal.workers.collective.snapshot_weights); rank 0 broadcasts them to the rollout
  workers when the controller says which group generation to use.

Every function takes (checkpoint name, tensor) pairs (`DataParallel.full_weights`) and
copies what leaves, so the model may train on once it returns. `write_directory` puts a
whole directory (the final model) in place at once.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from collections.abc import Callable

import torch

from areal.config import RunConfig
from areal.messages import WeightsChunk
from areal.models.weights import bucket_tensors, save_tensors
from areal.workers.collective import WeightSnapshot, snapshot_weights

NamedTensors = list[tuple[str, torch.Tensor]]


def version_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"v{version:06d}"


def publish_to_disk(tensors: NamedTensors, cfg: RunConfig, version: int) -> str:
    """Save `tensors` as weight version `version`; returns the directory."""
    directory = version_dir(cfg.run_dir, version)
    save_tensors(directory, tensors, metadata={"version": str(version)})
    _prune(Path(cfg.run_dir) / "weights", cfg.weight_sync.keep_versions, directory)
    return str(directory)


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Keep the `keep` newest versions up to `newest` (just published). Newer ones are not
    this trainer's to judge (a resumed run removes those of the run it continues first)."""
    versions = sorted(p for p in root.iterdir()
                      if p.is_dir() and p.name.startswith("v") and p.name <= newest.name)
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def stream_chunks(tensors: NamedTensors, cfg: RunConfig, version: int) -> list[WeightsChunk]:
    """`tensors` as WeightsChunk messages (CPU copies, buckets of bucket_mb)."""
    buckets = list(bucket_tensors(((n, t.detach().to("cpu", copy=True)) for n, t in tensors),
                                  cfg.weight_sync.bucket_mb << 20))
    return [WeightsChunk(version=version, index=i, num_chunks=len(buckets),
                         names=[name for name, _ in bucket], tensors=[t for _, t in bucket])
            for i, bucket in enumerate(buckets)]


def collective_snapshot(tensors: NamedTensors, cfg: RunConfig, version: int) -> WeightSnapshot:
    """`tensors` flattened into CPU buckets for the broadcast, with their manifest."""
    return snapshot_weights(tensors, version, cfg.weight_sync.bucket_mb << 20)


def write_directory(target: Path, write: Callable[[Path], None]) -> None:
    """`write(partial)` fills a fresh directory beside `target`, which then takes its place:
    readers see the previous complete directory, none, or the new complete one, never a
    half-written one (a full disk fails the write and leaves `target` as it was)."""
    partial = target.with_name(f".{target.name}.partial")
    previous = target.with_name(f".{target.name}.previous")
    for leftover in (partial, previous):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if target.exists():
        target.rename(previous)
    partial.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
