"""The researcher's loop end to end on the shipped GSM8K-style files: a real training run
(controller + rollout, reward and trainer processes) from examples/gsm8k.yaml with the tiny
random model, its TensorBoard events, the standalone eval CLI on the saved checkpoint, and
the plot. Learning is not expected at this size; that the pieces connect is."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from areal.config import load_config
from areal.controller import Controller

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
STEPS, BATCH, GROUP, EVAL_PROMPTS = 3, 4, 2, 4


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory, tiny_model_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("gsm8k") / "run"
    cfg = load_config(
        REPO / "examples" / "gsm8k.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"run_dir={run_dir}",
            f"task.params.path={REPO / 'examples/data/gsm8k_train.jsonl'}",
            f"task.params.eval_path={REPO / 'examples/data/gsm8k_test.jsonl'}",
            f"trainer.total_steps={STEPS}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            f"eval.max_prompts={EVAL_PROMPTS}",
            "eval.every_steps=2",
            "rollout.max_new_tokens=16",
            "logging.progress=false",
            "logging.tensorboard=true",
            "trainer.lr=1e-3",
        ],
    )
    summary = asyncio.run(Controller(cfg).run())
    assert summary["steps"] == STEPS
    return run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_on_the_shipped_gsm8k_file_runs_end_to_end(gsm8k_run):
    records = _records(gsm8k_run)
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval" and "source" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in steps)
    assert sum(r["reward/verdicts"].get("error", 0) for r in steps) == 0  # math-verify judged
    # before and after training, and the periodic one at step 2: it runs beside training,
    # and the controller waits for it before the final evaluation
    eval_steps = sorted(r["step"] for r in evals)
    assert eval_steps == [0, 2, STEPS], eval_steps  # before, periodic (every 2), final
    assert all(r["eval/num_problems"] == EVAL_PROMPTS for r in evals)
    resolved = (gsm8k_run / "config.yaml").read_text()
    assert "gsm8k_train.jsonl" in resolved and "${model.path}" not in resolved


def test_tensorboard_event_file_holds_the_step_scalars(gsm8k_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = list((gsm8k_run / "tensorboard").glob("events.out.tfevents.*"))
    assert event_files, "no TensorBoard event file"
    events = EventAccumulator(str(gsm8k_run / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"rollout/reward_mean", "staleness/mean", "eval/pass@1"} <= set(scalars)
    rewards = events.Scalars("rollout/reward_mean")
    assert [e.step for e in rewards] == list(range(1, STEPS + 1))
    steps = {r["step"]: r for r in _records(gsm8k_run) if r["kind"] == "step"}
    assert [e.value for e in rewards] == pytest.approx(
        [steps[s]["rollout/reward_mean"] for s in range(1, STEPS + 1)]
    )


def test_eval_cli_scores_the_saved_checkpoint_into_metrics_jsonl(gsm8k_run, capsys):
    from areal.eval import main

    rc = main(
        [
            "--model",
            str(gsm8k_run / "final_model"),
            "--config",
            str(gsm8k_run / "config.yaml"),
            "--run-dir",
            str(gsm8k_run),
            "--num-samples",
            "3",
            "--temperature",
            "1.0",
            "--k",
            "3",
            "--max-prompts",
            "2",
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "pass@1" in table and "pass@3" in table and "appended to" in table
    record = _records(gsm8k_run)[-1]
    assert record["kind"] == "eval" and record["source"] == "areal.eval"
    assert record["step"] == STEPS  # the run's final version, from summary.json
    assert record["eval/num_problems"] == 2 and record["eval/num_samples"] == 3
    assert sum(record["eval/verdicts"].values()) == 6
    assert 0.0 <= record["eval/pass@1"] <= record["eval/pass@2"] <= record["eval/pass@3"] <= 1.0


def test_plot_writes_non_empty_pngs_of_the_run(gsm8k_run):
    import matplotlib.image

    from areal.plot import main

    assert main([str(gsm8k_run)]) == 0
    plots = gsm8k_run / "plots"
    for name in ("overview", "reward", "accuracy", "staleness", "throughput", "interruptions"):
        image = matplotlib.image.imread(plots / f"{name}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100, name
        rgb = image[..., :3]
        assert float(np.std(rgb)) > 0.01, f"{name}.png is blank"
        # something besides white background and black text/axes was drawn: the curves
        coloured = np.abs(rgb - rgb.mean(axis=-1, keepdims=True)).max(axis=-1) > 0.2
        assert coloured.sum() > 50, f"{name}.png has no coloured curve"
