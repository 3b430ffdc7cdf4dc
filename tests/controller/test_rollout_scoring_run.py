"""A real run with no reward workers (reward.num_workers=0): every rollout worker checks its
own completions with the task's reward function, and its Completions carry the rewards.
Checked on what the trainer was sent (logging.save_batches): each trained completion's
reward is the task's reward of its own decoded text; no reward worker process was started;
a flaky verifier's failures are retried on the rollout worker, and no trained sample carries
an infrastructure verdict."""

from __future__ import annotations

import asyncio

import pytest

from areal.config import load_config
from areal.controller.setup import load_saved_batch
from areal.messages import WorkerKind
from areal.models.tokenizer import load_tokenizer
from cli_runs import letter_overrides
from letter_runs import letter_task_importable, recorded_run
from letter_task import LetterTask

pytestmark = pytest.mark.slow

STEPS = 4


def test_rollout_workers_score_their_own_completions(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = load_config(
        overrides=letter_overrides(
            run_dir,
            tiny_model_dir,
            f"trainer.total_steps={STEPS}",
            "trainer.checkpoint_every=0",
            "reward.num_workers=0",
            "task.params.flaky=0.2",
            "reward.retries=3",
            "logging.save_batches=true",
        )
    )
    with letter_task_importable():
        run = asyncio.run(recorded_run(cfg))
    ctl = run["ctl"]
    assert run["summary"]["steps"] == STEPS
    pool = ctl.core.pool
    known = [*pool.expected.values(), *pool.by_identity.values()]
    assert known and not [h for h in known if h.kind is WorkerKind.REWARD]
    assert not list((run_dir / "logs").glob("reward-*"))
    tokenizer, task = load_tokenizer(tiny_model_dir), LetterTask()
    checked = 0
    for step in range(1, STEPS + 1):
        batch = load_saved_batch(run_dir, step)
        cu = batch.cu_seqlens.tolist()
        for s in range(len(cu) - 1):
            mask = batch.loss_mask[cu[s] : cu[s + 1]]
            output = batch.token_ids[cu[s] : cu[s + 1]][mask]
            text = tokenizer.decode(output.tolist(), skip_special_tokens=True)
            assert float(batch.rewards[s]) == pytest.approx(task.reward(text, "a").reward, abs=1e-6)
            checked += 1
    assert checked == STEPS * cfg.trainer.batch_size
    retried = (run_dir / "logs" / "rollout-0.log").read_text().count("running it again")
    steps = [r for r in run["records"] if r["kind"] == "step"]
    assert retried > 0  # flaky checks were retried where they ran, and counted
    assert 0 < sum(r["reward/retries"] for r in steps) <= retried
    trained = ctl.ledger.trained_group_ids
    assert trained and all(not v.is_error() for g in trained for v in run["completed"][g])
