"""The trainer with LoRA (trainer.lora.rank > 0): only the adapters train and sit in the
optimiser; the step's result does not depend on how the batch is packed into micro-batches;
under both proximal modes the adapters move and the base does not; what rank 0 publishes
is the adapter alone (PEFT names); a checkpoint holds the adapters and their AdamW state
only, and a trainer resumed from it and given the same batches ends bitwise where the
original did (the frozen base is not in it: it comes from the model directory). Two
data-parallel ranks with LoRA are in test_data_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from test_checkpoint import _batch, save_then_train
from trainer_batches import record_gradients

from areal.config import load_config
from areal.models.hf import load_model
from areal.models.lora import is_adapter_dir, load_adapter_dir
from areal.workers.trainer.checkpoint import load_checkpoint
from areal.workers.trainer.distributed import DataParallel
from areal.workers.trainer.ppo import PPOTrainer
from areal.workers.trainer.publish import save_weights_dir

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.lr=1e-2"]


def _config(model_dir: str, run_dir, *overrides: str):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            *LORA,
            "trainer.num_minibatches=2",
            *overrides,
        ]
    )


def _trainer(model_dir: str, run_dir, *overrides: str) -> PPOTrainer:
    return PPOTrainer(load_model(model_dir), _config(model_dir, run_dir, *overrides))


def _adapters(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in DataParallel.single().full_weights(trainer.model)}


@pytest.mark.parametrize("prox", ["recompute", "loglinear"])
def test_only_adapters_train_and_are_published(tmp_path, tiny_model_dir, prox):
    torch.set_num_threads(1)
    trainer = _trainer(tiny_model_dir, tmp_path, f"trainer.ppo.prox_logp={prox}")
    frozen = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad
    }
    adapters = [p for p in trainer.model.parameters() if p.requires_grad]
    optimised = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert len(optimised) == len(adapters) == 28 and all(p.requires_grad for p in optimised)
    before = _adapters(trainer)
    trainer.step(_batch(0), 0)
    trainer.step(_batch(1), 1)
    assert all(
        torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen
    ), "a frozen base weight changed"
    assert len(trainer.optimizer.state) == len(adapters)  # AdamW state for adapters only
    after = _adapters(trainer)
    assert set(after) == set(before) and all(n.startswith("base_model.model.") for n in after)
    assert all(not torch.equal(after[n], before[n]) for n in after if "lora_B" in n)
    published = save_weights_dir(
        tmp_path / "v2", list(after.items()), _config(tiny_model_dir, tmp_path), 2
    )
    assert is_adapter_dir(published) and not (published / "model.safetensors").exists()
    assert all(torch.equal(t, after[n]) for n, t in load_adapter_dir(published).items())


def test_the_step_does_not_depend_on_the_packing(tmp_path, tiny_model_dir):
    """Gradients agree to fp32 rounding (summation order); AdamW's first step moves a weight
    by about lr * g / (|g| + eps) whatever |g| is, so where g is near zero that rounding is
    amplified: the few such elements are allowed up to 2% of lr, and almost all others must
    agree to 1e-7 (the tolerance of test_data_parallel.py, whose docstring derives it)."""
    torch.set_num_threads(1)
    grads, results = [], []
    for budget in (24, 4096):  # many small micro-batches vs one pack per minibatch
        trainer = _trainer(tiny_model_dir, tmp_path, f"trainer.micro_batch_tokens={budget}")
        grads.append(record_gradients(trainer))
        trainer.step(_batch(2), 0)
        results.append(_adapters(trainer))
    for small, big in zip(*grads, strict=True):
        assert set(small) == set(big) and len(small) == 28  # adapters only
        for name, grad in big.items():
            diff, scale = (small[name] - grad).abs().max(), grad.abs().max()
            assert diff <= 1e-5 * scale + 1e-9, f"{name}: grad diff {diff:.2e} at {scale:.2e}"
    lr = _config(tiny_model_dir, tmp_path).trainer.lr
    diffs = torch.cat([(results[0][n] - results[1][n]).abs().flatten() for n in results[0]])
    summary = f"adapters differ between packings: max {diffs.max():.2e}, mean {diffs.mean():.2e}"
    assert diffs.max() < 0.02 * lr and (diffs > 1e-7).float().mean() < 1e-2, summary


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_checkpoint_holds_adapters_only_and_resumes_bitwise(tmp_path, tiny_model_dir, background):
    torch.set_num_threads(1)
    batches = [_batch(seed) for seed in range(4)]
    original = _trainer(tiny_model_dir, tmp_path)
    for version, batch in enumerate(batches[:2]):
        original.step(batch, version)
    path = save_then_train(original, tmp_path, batches[2:], background)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 28 and all(".lora_" in k for k in model_keys), model_keys[:3]
    assert not any("base_layer" in k or "embed_tokens" in k for k in saved)

    resumed = _trainer(tiny_model_dir, tmp_path)
    load_checkpoint(resumed.model, resumed.optimizer, path)
    for version, batch in enumerate(batches[2:], start=2):
        resumed.step(batch, version)
    for (name, a), b in zip(
        original.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    theirs = [t for s in original.optimizer.state.values() for t in s.values()]
    ours = [t for s in resumed.optimizer.state.values() for t in s.values()]
    assert len(theirs) == len(ours) > 0 and all(
        torch.equal(a, b) for a, b in zip(theirs, ours, strict=True)
    )
