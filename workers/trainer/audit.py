"""An audit of the objective's inputs: for the steps in `trainer.audit_steps`, what the loss
was given, saved where an independent check can recompute it.

    <run_dir>/audit/step_<n>/weights/model.safetensors   the trainer's weights at the start
                                                         of step n (rank 0; full weights)
    <run_dir>/audit/step_<n>/rank_<r>.npz                rank r's batch as it trained it:
        token_ids, cu_seqlens, versions, loss_mask  [N], [S+1], [N], [N]
        behav_logprobs   the behaviour log-probs the loss used (as received)
        prox_logprobs    the proximal log-probs the loss used (PPOTrainer.last_prox)
        version          the policy version the step started from (its result is version + 1)

tests/controller/test_pipeline_check.py recomputes the proximal log-probs from the saved
weights and the behaviour log-probs from the published weights of each token's version,
with a plain per-sequence forward (not the trainer's packed one). Costs a copy of the
weights and of one batch per audited step; off by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal.models.weights import save_tensors
from areal.types import PackedBatch

NamedTensors = list[tuple[str, torch.Tensor]]


def audit_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "audit" / f"step_{step:06d}"


def save_start_weights(run_dir: str | Path, step: int, tensors: NamedTensors) -> None:
    """The weights the step starts from (before any update)."""
    save_tensors(audit_dir(run_dir, step) / "weights", tensors, metadata={"step": str(step)})


def save_batch(
    run_dir: str | Path,
    step: int,
    rank: int,
    batch: PackedBatch,
    prox_logprobs: torch.Tensor,
    version: int,
) -> Path:
    """Rank `rank`'s batch of step `step` with the log-probs its loss used."""
    path = audit_dir(run_dir, step) / f"rank_{rank}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        token_ids=batch.token_ids.numpy(),
        cu_seqlens=batch.cu_seqlens.numpy(),
        versions=batch.versions.numpy(),
        loss_mask=batch.loss_mask.numpy(),
        behav_logprobs=batch.logprobs.numpy(),
        prox_logprobs=prox_logprobs.numpy(),
        version=np.int64(version),
    )
    return path


def load_batch(run_dir: str | Path, step: int, rank: int = 0) -> dict[str, Any]:
    """What `save_batch` wrote, as numpy arrays (version as an int)."""
    with np.load(audit_dir(run_dir, step) / f"rank_{rank}.npz") as data:
        out = {name: data[name] for name in data.files}
    out["version"] = int(out["version"])
    return out
