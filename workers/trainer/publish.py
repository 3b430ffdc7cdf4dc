"""Publishing a new weight version from trainer rank 0, one strategy object per
`weight_sync.mode` (`make_publisher`): to disk, as a stream of buckets, as a snapshot for the
collective broadcast, or into shared-memory slots.

- disk: `<run_dir>/weights/v<version>/`, written atomically (a reader sees a complete file
  or none); older versions beyond `weight_sync.keep_versions` are removed. Full weights:
  `model.safetensors`; LoRA (`trainer.lora.rank > 0`): a PEFT adapter directory
  (`adapter_config.json` + `adapter_model.safetensors`, areal.models.lora).
- stream: the weights cut into buckets of at most `weight_sync.bucket_mb`, as WeightsChunk
  messages the controller relays to every rollout worker (no shared file system needed).
- collective: the weights flattened into CPU buckets of `weight_sync.bucket_mb`
  (areal.workers.collective.snapshot_weights); rank 0 broadcasts them to the rollout
  workers when the controller says which group generation to use.
- shm: one copy into a slot of `weight_sync.shm_dir` that rollout workers on this host map
  (areal.models.weight_slots: never read half-written, a crash mid-write leaves the
  previous version loadable); the slot's path goes out as the weights path.

With LoRA every mode carries the adapters alone, under PEFT's names; the rollout workers
know from the run's config that an update is an adapter. Every publisher takes (name,
tensor) pairs (`DataParallel.full_weights`) and copies what leaves, so the model may train
on once it returns. `write_directory` puts a whole directory (the final model) in place at
once.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import torch

from areal.config import RunConfig
from areal.messages import Tensor, WeightsChunk
from areal.models.lora import save_adapter_dir
from areal.models.weight_slots import SlotWriter, slot_directory
from areal.models.weights import bucket_tensors, save_tensors
from areal.workers.collective import WeightSnapshot, snapshot_weights

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(kw_only=True)
class Publication:
    """What a published version tells the controller (Trained) and what follows it."""

    version: int
    weights_path: str | None = None
    """disk: the version directory; shm: the slot file."""
    chunks: list[WeightsChunk] = field(default_factory=list)
    """stream: sent right after Trained."""
    snapshot: WeightSnapshot | None = None
    """collective: broadcast when the controller asks (its manifest goes in Trained)."""


class DiskPublisher:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def publish(self, tensors: NamedTensors, version: int) -> Publication:
        return Publication(
            version=version, weights_path=publish_to_disk(tensors, self.cfg, version)
        )

    def close(self, finished: bool) -> None:
        pass


class StreamPublisher:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def publish(self, tensors: NamedTensors, version: int) -> Publication:
        return Publication(version=version, chunks=stream_chunks(tensors, self.cfg, version))

    def close(self, finished: bool) -> None:
        pass


class CollectivePublisher:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def publish(self, tensors: NamedTensors, version: int) -> Publication:
        return Publication(
            version=version, snapshot=collective_snapshot(tensors, self.cfg, version)
        )

    def close(self, finished: bool) -> None:
        pass


class ShmPublisher:
    """Slots mapped once by this process: the first publication allocates them, every later
    one is a single copy (areal.models.weight_slots)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.writer = SlotWriter(
            slot_directory(cfg.weight_sync.shm_dir, cfg.run_path()),
            cfg.weight_sync.keep_versions,
            lock_timeout_s=cfg.weight_sync.timeout_s,
        )

    def publish(self, tensors: NamedTensors, version: int) -> Publication:
        return Publication(version=version, weights_path=self.writer.publish(tensors, version))

    def close(self, finished: bool) -> None:
        """Unmap; a finished run also frees the slots' memory (a stopped one keeps them for
        --resume and for workers still loading)."""
        self.writer.close(remove=finished)


Publisher = DiskPublisher | StreamPublisher | CollectivePublisher | ShmPublisher
_PUBLISHERS: dict[str, type] = {
    "disk": DiskPublisher,
    "stream": StreamPublisher,
    "collective": CollectivePublisher,
    "shm": ShmPublisher,
}


def make_publisher(cfg: RunConfig) -> Publisher:
    """The publisher of `weight_sync.mode`."""
    try:
        return _PUBLISHERS[cfg.weight_sync.mode](cfg)
    except KeyError:
        raise ValueError(
            f"weight_sync.mode={cfg.weight_sync.mode!r} is not one of {', '.join(_PUBLISHERS)}"
        ) from None


def version_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"v{version:06d}"


def publish_to_disk(tensors: NamedTensors, cfg: RunConfig, version: int) -> str:
    """Save `tensors` as weight version `version` (full weights, or with LoRA the adapter
    directory); returns the directory."""
    directory = version_dir(cfg.run_path(), version)
    save_weights_dir(directory, tensors, cfg, version)
    _prune(cfg.run_path() / "weights", cfg.weight_sync.keep_versions, directory)
    return str(directory)


def save_weights_dir(directory: Path, tensors: NamedTensors, cfg: RunConfig, version: int) -> Path:
    """The directory rollout workers load `version` from: model.safetensors, or with LoRA
    a PEFT adapter directory (also what a checkpoint keeps for workers to resume from)."""
    metadata = {"version": str(version)}
    if cfg.trainer.lora.enabled:
        return save_adapter_dir(
            directory, tensors, cfg.trainer.lora, base_model=cfg.model.path, metadata=metadata
        )
    save_tensors(directory, tensors, metadata=metadata)
    return directory


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Keep the `keep` newest versions up to `newest` (just published). Newer ones are not
    this trainer's to judge (a resumed run removes those of the run it continues first)."""
    versions = sorted(
        p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and p.name <= newest.name
    )
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def stream_chunks(tensors: NamedTensors, cfg: RunConfig, version: int) -> list[WeightsChunk]:
    """`tensors` as WeightsChunk messages (CPU copies, buckets of bucket_mb)."""
    buckets = list(
        bucket_tensors(
            ((n, t.detach().to("cpu", copy=True)) for n, t in tensors),
            cfg.weight_sync.bucket_mb << 20,
        )
    )
    return [
        WeightsChunk(
            version=version,
            index=i,
            num_chunks=len(buckets),
            names=[name for name, _ in bucket],
            tensors=[Tensor(t) for _, t in bucket],
        )
        for i, bucket in enumerate(buckets)
    ]


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
