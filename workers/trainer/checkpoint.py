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

With trainer.checkpoint_async (`BackgroundCheckpoints`) the step only copies the state
(weights, optimiser, the published weights: a copy of the checkpoint in CPU memory while it
is written); a thread of its own writes the copy while the next steps train, through a
gloo group of its own when there are several ranks (collectives of two threads must not
share a group). At most one is written at a time: the next checkpoint step waits for it.
It is complete, and reported to the controller, only when its `areal.json` is written.
It is reported a step or more after that, so it keeps one more checkpoint than a save in
the step (`BACKGROUND_EXTRA_KEPT`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import warnings
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from areal.models.lora import has_adapters

META = "areal.json"
WriteWeights = Callable[[Path, list[tuple[str, torch.Tensor]]], Any]
"""Writes the published form of (name, tensor) pairs into a checkpoint's directory."""
BACKGROUND_EXTRA_KEPT = 1
"""Checkpoints a background write keeps beyond trainer.keep_checkpoints. A save in the step
is reported with that step, before the controller sends the next, so when the newest is
written the one before it holds the controller's part (its resume state) and keep=2 leaves
it. A background checkpoint is reported with the first step that ends after it is written,
up to the next checkpoint step: when the newest completes, the controller may not yet have
heard of the one before, and its newest resumable checkpoint is the third newest. Pruning
that would leave a controller killed then nothing to resume from."""
_SINGLE_PROCESS = ".*in a single process"
"""DCP's warning when it saves without a process group."""


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
    weights: list[tuple[str, torch.Tensor]] | None = None,
    write_weights: WriteWeights | None = None,
) -> Path:
    """Save on every rank of the default group (a collective when there are several);
    rank 0 also calls `write_weights(<checkpoint>/weights, weights)` (the published form of
    its weights, workers/trainer/publish.save_weights_dir), then marks the checkpoint
    complete and removes all but the `keep` newest."""
    target = checkpoint_dir(run_dir, step).resolve()  # workers elsewhere may have another cwd
    model_state, optim_state = _state(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=target)
    _complete(target, step, version, keep, weights, write_weights)
    return target


def _complete(
    target: Path,
    step: int,
    version: int,
    keep: int,
    weights: list[tuple[str, torch.Tensor]] | None,
    write_weights: WriteWeights | None,
) -> None:
    """After every rank's DCP files (when rank 0's save returns, every rank's part and the
    metadata are written): rank 0 writes the weights directory, then `areal.json` last, and
    prunes."""
    if _rank() == 0:
        if weights is not None and write_weights is not None:
            write_weights(target / "weights", weights)
        write_json(target / META, {"step": step, "version": version})
        _prune(target.parent, keep)


@dataclass(frozen=True)
class Written:
    """A checkpoint the background thread finished: where, of which step, and how long the
    thread took to write it."""

    path: Path
    step: int
    write_s: float


class BackgroundCheckpoints:
    """trainer.checkpoint_async: `start` copies the state on the caller's thread and hands
    the copy to a thread that writes it; `finished` (at each step's end) and `wait` (before
    the next checkpoint and at shutdown) return the checkpoint it completed, or raise its
    error on the caller's thread."""

    def __init__(self) -> None:
        self._writing: Future[Written] | None = None
        # DCP's own thread says it assumes one process when no group exists (intended);
        # a filter scoped by catch_warnings would not reach that thread.
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        self._group: dist.ProcessGroup | None = None

    @property
    def writing(self) -> bool:
        return self._writing is not None

    def start(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        run_dir: str | Path,
        step: int,
        version: int,
        keep: int,
        weights: list[tuple[str, torch.Tensor]] | None = None,
        write_weights: WriteWeights | None = None,
    ) -> None:
        """`save_checkpoint` begun: the state of every rank copied (a collective where there
        are several: call it on each rank at the same step), `weights` too, then written in
        the background."""
        if self._writing is not None:
            raise RuntimeError("a checkpoint is still being written: wait() for it first")
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")  # every rank, the same step
        target = checkpoint_dir(run_dir, step).resolve()
        model_state, optim_state = _state(model, optimizer)
        # DCP copies the state to CPU memory before it returns, then writes in its thread.
        saving = dcp.async_save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=target,
            process_group=self._group,
            no_dist=not dist.is_initialized(),
        )
        files = saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving
        if weights is not None:  # the model trains on in place while they are written
            weights = [(name, t.detach().to("cpu", copy=True)) for name, t in weights]
        writing: Future[Written] = Future()
        start = time.perf_counter()

        def finish() -> None:  # a daemon thread: a write stuck on a dead peer ends with us
            try:  # DCP's files, then the weights and areal.json
                files.result()
                keep_all = keep + BACKGROUND_EXTRA_KEPT
                _complete(target, step, version, keep_all, weights, write_weights)
                writing.set_result(Written(target, step, time.perf_counter() - start))
            except BaseException as err:  # raised again on the trainer's thread by wait()
                writing.set_exception(err)

        threading.Thread(target=finish, name="areal-checkpoint", daemon=True).start()
        self._writing = writing

    def finished(self) -> Written | None:
        """The checkpoint written since the last call, if the thread has finished it."""
        if self._writing is None or not self._writing.done():
            return None
        return self.wait()

    def wait(self) -> Written | None:
        """The checkpoint being written, once written (None: none was)."""
        writing, self._writing = self._writing, None
        return None if writing is None else writing.result()


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
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        yield
