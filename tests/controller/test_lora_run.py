"""LoRA and shared-memory publication in real runs (controller, trainer, rollout and reward
processes; the letter task, which a random tiny model learns in a few steps).

- LoRA, collective mode: a first run trains 4 steps with a checkpoint every 2, a second
  resumes it (what `--resume RUN_DIR` builds) up to 6. Every published version is the
  adapter alone (bytes per version), and it reaches the rollout workers: the tokens they
  sample under the newest version have the log-probs the trainer computes (fresh-token
  drift ~1e-6, where one version of difference moves them by orders of magnitude more).
  Checkpoints hold the adapters; the resumed rollout workers start from the checkpoint's
  adapter (the resumed run's first evaluation equals the first run's last one, exactly).
  The final model is the merged model (plain transformers) plus the adapter.
- Full weights, shm mode: versions go through shared-memory slots, with the same parity,
  and the slots are freed when the run ends.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from areal.config import load_config
from areal.models.hf import load_model
from areal.models.lora import add_adapters, copy_adapters, is_adapter_dir, load_adapter_dir
from areal.models.weight_slots import slot_directory
from letter_runs import letter_config, letter_task_importable, recorded_run

pytestmark = pytest.mark.slow

FIRST, TOTAL, RANK = 4, 6, 4


LORA = [f"trainer.lora.rank={RANK}", "trainer.lora.alpha=8", "weight_sync.mode=collective"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("lora-run")
    with letter_task_importable():
        first = asyncio.run(
            recorded_run(letter_config(root / "lora", tiny_model_dir, FIRST, *LORA))
        )
        second = asyncio.run(
            recorded_run(letter_config(root / "lora", tiny_model_dir, TOTAL, *LORA), resume=True)
        )
        shm = asyncio.run(
            recorded_run(letter_config(root / "shm", tiny_model_dir, 3, "weight_sync.mode=shm"))
        )
    return {"first": first, "second": second, "shm": shm, "root": root}


def _steps(run: dict) -> list[dict]:
    return [r for r in run["records"] if r["kind"] == "step"]


def _evals(run: dict) -> list[dict]:
    return [r for r in run["records"] if r["kind"] == "eval"]


def test_every_version_is_the_adapter_and_reaches_the_rollout_workers(runs, tiny_model_dir):
    model = load_model(tiny_model_dir)
    adapter_bytes = sum(
        4 * RANK * (p.shape[0] + p.shape[1])
        for n, p in model.named_parameters()
        if p.dim() == 2
        and n.rpartition(".")[0].rpartition(".")[2]
        in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    steps = _steps(runs["first"]) + _steps(runs["second"])
    assert [r["step"] for r in steps] == list(range(1, TOTAL + 1))
    assert {r["train/publish_bytes"] for r in steps} == {adapter_bytes}
    assert adapter_bytes < sum(4 * p.numel() for p in model.parameters()) / 5
    fresh = [r for r in steps if r.get("train/fresh_token_frac", 0) > 0]
    stale = [
        r["train/logprob_diff_stale"] for r in steps if r.get("train/logprob_diff_stale", 0) > 0
    ]
    assert fresh, "no step trained tokens of its own version"
    assert max(r["train/logprob_diff_fresh_max"] for r in fresh) < 1e-3 < max(stale, default=1)


def test_checkpoints_hold_adapters_and_the_resumed_workers_start_from_them(runs):
    run_dir = runs["root"] / "lora"
    checkpoint = run_dir / "checkpoints" / "step_000004"
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    assert all(".lora_" in k for k in saved if k.startswith("model."))
    assert is_adapter_dir(checkpoint / "weights")
    last_of_first, first_of_second = _evals(runs["first"])[-1], _evals(runs["second"])[0]
    assert last_of_first["version"] == first_of_second["version"] == FIRST
    assert first_of_second["eval/reward_mean"] == last_of_first["eval/reward_mean"]
    resumed = _steps(runs["second"])[0]
    assert resumed["train/fresh_token_frac"] > 0
    assert resumed["train/logprob_diff_fresh_max"] < 1e-3


def test_the_final_model_is_merged_and_carries_its_adapter(runs, tiny_model_dir):
    final = runs["root"] / "lora" / "final_model"
    adapter = load_adapter_dir(final / "adapter")
    assert not (final / "adapter_model.safetensors").exists()
    merged = load_model(final)  # plain transformers, no PEFT
    reference = add_adapters(
        load_model(tiny_model_dir),
        load_config(overrides=[f"trainer.lora.rank={RANK}", "trainer.lora.alpha=8"]).trainer.lora,
        seed=0,
    )
    copy_adapters(reference, adapter)
    ids = torch.tensor([[5, 9, 17, 33, 2, 60, 7]])
    with torch.no_grad():
        diff = (merged(ids).logits - reference.eval()(ids).logits).abs().max()
        moved = (merged(ids).logits - load_model(tiny_model_dir)(ids).logits).abs().max()
    assert diff < 1e-4 < moved, (diff, moved)


def test_shm_mode_serves_every_version_and_frees_its_slots(runs):
    steps = _steps(runs["shm"])
    assert [r["step"] for r in steps] == [1, 2, 3]
    fresh = [r for r in steps if r.get("train/fresh_token_frac", 0) > 0]
    assert fresh and max(r["train/logprob_diff_fresh_max"] for r in fresh) < 1e-3
    assert runs["shm"]["summary"]["final_version"] == 3
    assert not slot_directory("/dev/shm", runs["root"] / "shm").exists()
