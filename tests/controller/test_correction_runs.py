"""Short real runs with every off-policy correction option (docs/concepts/decoupled-ppo.md):
real processes and sockets, the tiny model, the letter task, 2 steps of 4 samples. Each run
must complete, record its options in config.yaml, train on finite losses, and show the
options at work in its metrics or saved batches.

Cheap on purpose: a run is mostly worker start-up. What each option computes is tested
against independent formulas in tests/areal/algorithms/test_corrections.py and
test_shaping.py; here the option travels from the command line to the trainer or the
controller and a run with it completes.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from areal.config import load_config
from areal.controller import Controller

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
STEPS, BATCH, GROUP = 2, 4, 2

# Options that do not exclude each other share a run (a run is mostly worker start-up).
RUNS = {
    "token_mask": [
        "trainer.ppo.behav_imp_floor=0.5",
        "trainer.ppo.eps_clip_high=0.28",
        "trainer.ppo.loss_agg_mode=seq-mean-token-mean",
        "trainer.advantage.overlong_buffer=4",
        "trainer.advantage.overlong_penalty=0.5",
    ],
    "sequence_clamp": [
        "trainer.ppo.behav_imp_level=sequence",
        "trainer.ppo.behav_cap_mode=clamp",
        "trainer.ppo.behav_imp_cap=2.0",
        "trainer.ppo.loss_agg_mode=seq-mean-token-sum-norm",
        "trainer.ppo.loss_agg_norm=16",
    ],
    "gspo_dynamic_sampling": [
        "trainer.ppo.policy_loss=gspo",
        "trainer.ppo.eps_clip=3e-4",
        "trainer.ppo.eps_clip_high=4e-4",
        "trainer.advantage.dynamic_sampling=true",
    ],
    # mask_truncated can leave a step without loss tokens (no correction metrics): alone
    "cispo_mask_truncated": [
        "trainer.ppo.policy_loss=cispo",
        "trainer.ppo.eps_clip=1.0",
        "trainer.ppo.eps_clip_high=0.28",
        "trainer.advantage.mask_truncated=true",
    ],
}


def _config(run_dir: Path, model_dir: str, options: list[str]):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "task.name=letter_task:LetterTask",
            f"trainer.total_steps={STEPS}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            "rollout.max_new_tokens=8",
            "eval.every_steps=0",
            "eval.max_prompts=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.save_batches=true",
            "trainer.checkpoint_every=0",
            "controller.heartbeat_interval_s=0.5",
            "trainer.lr=1e-3",
            *options,
        ]
    )


@pytest.fixture(scope="module")
def letter_task_importable():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        yield


def _run(cfg) -> tuple[Controller, dict, list[dict], list[dict]]:
    """(controller, summary, step records, saved batches) of a run."""
    ctl = Controller(cfg)
    summary = asyncio.run(ctl.run())
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    batches = [dict(np.load(path)) for path in sorted((run_dir / "batches").glob("*.npz"))]
    return ctl, summary, [r for r in records if r["kind"] == "step"], batches


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_with_the_option_completes(name, tmp_path, tiny_model_dir, letter_task_importable):
    options = RUNS[name]
    ctl, summary, steps, batches = _run(_config(tmp_path / "run", tiny_model_dir, options))
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    resolved = (tmp_path / "run" / "config.yaml").read_text()
    for option in options:
        key, value = option.split("=")
        key = key.rsplit(".", 1)[1]
        assert f"{key}: {value}" in resolved or f"{key}: {float(value)}" in resolved, option
    assert len(steps) == STEPS and len(batches) == STEPS
    assert all(math.isfinite(r["train/loss"]) for r in steps)
    trained = [r for r in steps if r["train/num_loss_tokens"] > 0]
    assert all(_split_keys(r, "logprob_diff") and _split_keys(r, "behav_kl") for r in trained)
    _CHECKS.get(name, lambda ctl, steps, batches: None)(ctl, steps, batches)


def _split_keys(record: dict, metric: str) -> list[str]:
    """The drift metric's keys in `record`, for whichever of fresh / stale tokens it saw."""
    return [f"train/{metric}_{s}" for s in ("fresh", "stale") if f"train/{metric}_{s}" in record]


def _two_sided(ctl, steps, batches):
    assert all(_split_keys(r, "behav_masked_frac") for r in steps)


def _truncated_is(ctl, steps, batches):
    assert all(_split_keys(r, "behav_clamped_frac") for r in steps)
    assert not any("behav_masked" in k for r in steps for k in r)


def _dynamic_sampling(ctl, steps, batches):
    assert sum(r.get("rollout/dropped_groups/zero_advantage", 0) for r in steps) > 0, steps
    # The staleness window freed every dropped sample's slot; every trained batch was full.
    dropped = ctl.ledger.dropped_group_ids
    assert (
        ctl.core.admission.staleness.num_aborted + ctl.core.admission.staleness.num_rejected
        == len(dropped) * GROUP
    )
    assert ctl.core.admission.staleness.num_consumed == STEPS * BATCH
    assert not set(dropped) & set(ctl.ledger.trained_group_ids)
    for batch in batches:  # every trained group has a reward spread
        for group in np.unique(batch["group_ids"]):
            assert len(set(batch["rewards"][batch["group_ids"] == group].tolist())) > 1


def _overlong_penalty(ctl, steps, batches):
    # With 8 new tokens and a buffer of 4, a completion of 8 tokens loses 0.5.
    assert all(-0.5 <= r["rollout/overlong_penalty_mean"] < 0 for r in steps), steps


def _mask_truncated(ctl, steps, batches):
    for record, batch in zip(steps, batches, strict=True):
        cu, mask = batch["cu_seqlens"], batch["loss_mask"]
        untrained = sum(not mask[cu[i] : cu[i + 1]].any() for i in range(len(cu) - 1))
        assert untrained == record["rollout/truncated_masked"] > 0
        assert record["train/num_loss_tokens"] == int(mask.sum())


_CHECKS = {
    "token_mask": lambda *run: (_two_sided(*run), _overlong_penalty(*run)),
    "sequence_clamp": _truncated_is,
    "cispo_mask_truncated": _mask_truncated,
    "gspo_dynamic_sampling": _dynamic_sampling,
}
