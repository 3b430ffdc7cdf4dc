"""A trainer resumed from a checkpoint and given the same batches again ends where the
original did: same weights, same AdamW state, bitwise (one process, same thread count);
also from a checkpoint written in the background (trainer.checkpoint_async) while the
original trained on, which must hold the state of its own step.

This is what makes a lost trainer replaceable: the controller replays the steps trained
since the newest checkpoint (controller/recovery.py, tests/controller/test_trainer_recovery.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal.config import load_config
from areal.models.hf import load_model
from areal.types import PackedBatch
from areal.models.weights import load_tensors, save_tensors
from areal.workers.trainer.checkpoint import (
    META,
    BackgroundCheckpoints,
    checkpoint_dir,
    load_checkpoint,
    read_info,
    save_checkpoint,
)
from areal.workers.trainer.ppo import PPOTrainer

LENGTHS = [9, 17, 6, 23, 12, 14, 8, 20]


def _batch(seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    cu = torch.tensor([0, *LENGTHS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    mask = torch.ones(total, dtype=torch.bool)
    for start in cu[:-1].tolist():
        mask[start : start + 3] = False
    return PackedBatch(
        token_ids=torch.randint(3, 90, (total,), generator=gen),
        logprobs=torch.where(mask, -2.0 - torch.rand(total, generator=gen), 0.0),
        versions=torch.where(mask, 0, -1),
        loss_mask=mask,
        cu_seqlens=cu,
        rewards=torch.randint(0, 2, (len(LENGTHS),), generator=gen).float(),
        group_ids=torch.arange(len(LENGTHS)) // 4,
    )


def _trainer(model_dir: str, run_dir) -> PPOTrainer:
    cfg = load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "trainer.lr=1e-2",
            "trainer.num_minibatches=2",
        ]
    )
    return PPOTrainer(load_model(model_dir), cfg)


def _optimizer_tensors(trainer: PPOTrainer) -> list[torch.Tensor]:
    return [t for state in trainer.optimizer.state.values() for t in state.values()]


def save_then_train(
    trainer: PPOTrainer, run_dir, batches: list[PackedBatch], background: bool
) -> Path:
    """A checkpoint of step 2 (version 2) with the published weights, then `batches`
    trained (versions 2, 3, ...): saved in the step, or written in the background while
    they train (trainer.checkpoint_async), changing the weights and AdamW state in place.
    The published weights it holds are checked to be those of step 2."""
    named = list(trainer.model.named_parameters())
    published = {name: t.detach().clone() for name, t in named}
    args = (trainer.model, trainer.optimizer, run_dir, 2, 2, 2, named, save_tensors)
    writer = BackgroundCheckpoints()
    if background:
        writer.start(*args)
        assert writer.writing
    else:
        path = save_checkpoint(*args)
    for version, batch in enumerate(batches, start=2):
        trainer.step(batch, version)
    if background:
        written = writer.wait()
        assert written is not None and written.step == 2 and not writer.writing
        path = written.path
    saved = load_tensors(path / "weights")
    assert saved.keys() == published.keys()
    assert all(torch.equal(saved[name], t) for name, t in published.items())
    return path


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_resume_and_replay_reaches_the_same_weights_and_optimiser_state(
    tmp_path, tiny_model_dir, background
):
    torch.set_num_threads(1)
    batches = [_batch(seed) for seed in range(4)]
    original = _trainer(tiny_model_dir, tmp_path)
    for version, batch in enumerate(batches[:2]):
        original.step(batch, version)
    path = save_then_train(original, tmp_path, batches[2:], background)

    resumed = _trainer(tiny_model_dir, tmp_path)  # fresh weights, no optimiser state
    info = load_checkpoint(resumed.model, resumed.optimizer, path)
    assert (info.step, info.version) == (2, 2)
    for version, batch in enumerate(batches[2:], start=2):  # the replay
        resumed.step(batch, version)

    for (name, a), b in zip(
        original.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    theirs, ours = _optimizer_tensors(original), _optimizer_tensors(resumed)
    assert len(theirs) == len(ours) > 0
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path, tiny_model_dir):
    trainer = _trainer(tiny_model_dir, tmp_path)
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)  # a dead trainer's partial one
    for step in (2, 4, 6):
        save_checkpoint(trainer.model, trainer.optimizer, tmp_path, step, step, keep=2)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000006"]
    assert json.loads((checkpoint_dir(tmp_path, 6) / META).read_text()) == {"step": 6, "version": 6}


def test_background_writes_keep_one_checkpoint_more(tmp_path, tiny_model_dir):
    """When a background checkpoint is written, the controller may have heard only of the
    third newest (it hears of each with a later step): that one stays."""
    trainer = _trainer(tiny_model_dir, tmp_path)
    writer = BackgroundCheckpoints()
    for step in (2, 4, 6, 8):
        writer.start(trainer.model, trainer.optimizer, tmp_path, step, step, keep=2)
        assert writer.wait().step == step
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000006", "step_000008"]


def test_an_incomplete_checkpoint_is_refused_by_name(tmp_path, tiny_model_dir):
    trainer = _trainer(tiny_model_dir, tmp_path)
    path = save_checkpoint(trainer.model, trainer.optimizer, tmp_path, 3, 3, keep=2)
    (path / META).unlink()  # as if the trainer died before marking it complete
    with pytest.raises(ValueError, match=f"{path} is not a complete trainer checkpoint"):
        read_info(path)
    with pytest.raises(ValueError, match="not a complete trainer checkpoint"):
        load_checkpoint(trainer.model, trainer.optimizer, tmp_path / "nowhere")


def test_a_background_write_that_fails_raises_on_the_trainers_thread(tmp_path, tiny_model_dir):
    trainer = _trainer(tiny_model_dir, tmp_path)
    writer = BackgroundCheckpoints()
    assert writer.wait() is None and writer.finished() is None  # nothing being written

    def refuse(directory, weights):
        raise OSError(28, "No space left on device")

    writer.start(trainer.model, trainer.optimizer, tmp_path, 4, 4, 2, [], refuse)
    with pytest.raises(RuntimeError, match="still being written"):
        writer.start(trainer.model, trainer.optimizer, tmp_path, 6, 6, 2, None, refuse)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    assert not (checkpoint_dir(tmp_path, 4) / META).exists()  # never marked complete
    assert not writer.writing  # the next one may start
