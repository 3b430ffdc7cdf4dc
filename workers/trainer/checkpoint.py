"""Trainer checkpoints: the weights and optimiser state a restarted trainer resumes from.

    <run_dir>/checkpoints/step_<step>/   torch.distributed.checkpoint (DCP) files
                                         (every rank writes its part: replicated tensors
                                         once, FSDP2 shards each by its owner)
                                         + weights/ (rank 0: what rollout workers load
                                         on resume, as published in disk mode: the full
                                         weights, or with LoRA the adapter directory)
                                         + areal.json {"step", "version"}, written last by
                                         rank 0: a directory without it is incomplete

Why DCP: one format for a single process, the CPU all-reduce replicas and FSDP2 shards,
loadable at another world size; `get_state_dict` also creates AdamW's state before a load.
With LoRA (a model carrying adapters, areal.models.lora) only the adapters and their
optimiser state are saved (`ignore_frozen_params`): the frozen base is the config's model
directory, loaded again at restart, so a checkpoint is megabytes instead of the model.
A checkpoint is what makes a trainer rank replaceable (docs/design.md section 3): the controller
keeps the batches trained since the newest one and replays them, so the restarted trainer
reaches the weights and optimiser state of the lost one (see controller.py, "trainer lost").
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from areal.models.lora import has_adapters

META = "areal.json"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    version: int
    """Policy version of the saved weights (training steps done)."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    run_dir: str | Path,
    step: int,
    version: int,
    keep: int,
    write_weights: Callable[[Path], Any] | None = None,
) -> Path:
    """Save on every rank of the default group (a collective when there are several);
    rank 0 also calls `write_weights(<checkpoint>/weights)` (the published form of its
    weights, workers/trainer/publish.save_weights_dir), then marks the checkpoint complete
    and removes all but the `keep` newest."""
    target = checkpoint_dir(run_dir, step).resolve()  # workers elsewhere may have another cwd
    model_state, optim_state = _state(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=target)
    if _rank() == 0:
        if write_weights is not None:
            write_weights(target / "weights")
        write_json(target / META, {"step": step, "version": version})
        _prune(target.parent, keep)
    return target


def write_json(path: Path, data: dict) -> None:
    """Write `path` atomically: a reader finds the whole file or none (what marks a
    checkpoint's parts complete)."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)


def read_info(path: str | Path) -> CheckpointInfo:
    """Step and version of a complete checkpoint; ValueError naming the path otherwise."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
        return CheckpointInfo(path=path, step=int(meta["step"]), version=int(meta["version"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a complete trainer checkpoint ({META}: {err})") from err


def load_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path
) -> CheckpointInfo:
    """Load weights and optimiser state in place (every rank of the default group)."""
    info = read_info(path)
    model_state, optim_state = _state(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=info.path)
    # LoRA: strict=False, since the frozen base is absent on purpose; every trainable key
    # was asked of dcp.load above, which fails on any the checkpoint lacks.
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(model, strict=not has_adapters(model)),
    )
    return info


def _options(model: torch.nn.Module, strict: bool = True) -> StateDictOptions:
    """LoRA: the adapters (trainable) only; the frozen base comes from the model directory."""
    return StateDictOptions(ignore_frozen_params=has_adapters(model), strict=strict)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimiser state) as saved and loaded. With LoRA the model state is
    the trainable parameters alone: `ignore_frozen_params` still lets a tied head through
    (it is no named parameter of its own), which would save the embedding every time."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    if has_adapters(model):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trainable}
    return model_state, optim_state


def _prune(root: Path, keep: int) -> None:
    """Remove every directory older than the `keep` newest complete ones (incomplete ones
    that a dead trainer left behind included)."""
    complete = sorted(p.name for p in root.iterdir() if (p / META).exists())
    if len(complete) <= keep:
        return
    for old in root.iterdir():
        if old.name < complete[-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*in a single process")
        yield
