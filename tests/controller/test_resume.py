"""Resuming a finished (or stopped) run from its newest checkpoint, as real processes.

A first run trains 4 steps with a checkpoint every 2; a second one resumes it
(`Controller(cfg, resume=True)`, what `--resume RUN_DIR` builds) up to 6 steps. The task
(letter_task.py) is one a random tiny model learns in a few steps. The rollout workers start
from the checkpoint's weights: the resumed run's first evaluation equals the first run's last
one exactly (both on version 4), and the log-probs they sample with are the ones the trainer,
restored from the same checkpoint, computes. The prompt stream continues where it stopped: prompt groups admitted
but not trained at the checkpoint are generated again first, and no prompt is trained twice.
Both with checkpoints written in the trainer's step and in the background
(trainer.checkpoint_async, where a checkpoint is reported by a later step's Trained, and the
run's last one before the run ends).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from areal.controller import Controller, RunFailed
from letter_runs import BATCH, GROUP, letter_config, letter_task_importable, recorded_run

pytestmark = pytest.mark.slow

FIRST, TOTAL = 4, 6


def _trained_positions(run: dict) -> list[int]:
    ctl = run["ctl"]
    by_group = {e["group_id"]: e["position"] for e in ctl.core.admission.log}
    return [by_group[g] for g in ctl.ledger.trained_group_ids]


@pytest.fixture(scope="module", params=["sync", "async"])
def runs(request, tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    background = request.param == "async"
    mode = f"trainer.checkpoint_async={background}"
    with letter_task_importable():
        first = asyncio.run(recorded_run(letter_config(run_dir, tiny_model_dir, FIRST, mode)))
        state = json.loads(
            (run_dir / "checkpoints" / "step_000004" / "controller.json").read_text()
        )
        second = asyncio.run(
            recorded_run(letter_config(run_dir, tiny_model_dir, TOTAL, mode), resume=True)
        )
    return {
        "first": first,
        "second": second,
        "state": state,
        "run_dir": run_dir,
        "background": background,
    }


def _evals(run: dict) -> list[dict]:
    return [r for r in run["records"] if r["kind"] == "eval"]


def test_the_resumed_run_continues_from_the_checkpoint(runs):
    first, second = runs["first"], runs["second"]
    assert [r["step"] for r in second["records"] if r["kind"] == "step"] == [5, 6]
    assert second["summary"]["final_version"] == TOTAL
    assert second["summary"]["resumed_after_step"] == FIRST
    # The summary's "before" is the first run's evaluation before any training.
    assert second["summary"]["eval_pass@1_before"] == first["summary"]["eval_pass@1_before"]
    lines = (runs["run_dir"] / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"kind": "step"' in line]
    assert steps == list(range(1, TOTAL + 1))


def test_a_checkpoints_resume_state_is_written_after_its_steps_record(runs):
    # A run killed between the two must not resume after a step that has no record: the
    # controller's part of the checkpoint (with its "checkpoint" event) follows the record.
    records = runs["first"]["records"]
    order = [
        (r["kind"], r.get("step"))
        for r in records
        if r["kind"] == "step" or r.get("event") == "checkpoint"
    ]
    checkpoints = [step for kind, step in order if kind == "event"]
    if runs["background"]:  # step 2's is reported by step 3's Trained if written
        assert checkpoints in ([2, 4], [4])  # by then, else superseded by step 4's at the end
    else:
        assert checkpoints == [2, 4]
    for step in checkpoints:
        assert order.index(("step", step)) < order.index(("event", step))


def test_rollout_workers_start_from_the_checkpoint_weights(runs):
    last_of_first = _evals(runs["first"])[-1]
    first_of_second = _evals(runs["second"])[0]
    assert last_of_first["version"] == first_of_second["version"] == FIRST
    assert first_of_second["eval/reward_mean"] == last_of_first["eval/reward_mean"]
    # Directly: tokens the resumed rollout workers sampled as version 4 have the log-probs
    # the trainer, restored from the same checkpoint, computes for them (engine vs trainer
    # numerics, ~1e-6); weights of another version differ by orders of magnitude more, as
    # the first run's stale tokens (one version behind their trainer) show.
    resumed = next(r for r in runs["second"]["records"] if r["kind"] == "step")
    stale = [
        r["train/logprob_diff_stale"]
        for r in runs["first"]["records"]
        if r["kind"] == "step" and r.get("train/logprob_diff_stale", 0) > 0
    ]
    assert resumed["train/fresh_token_frac"] > 0
    assert resumed["train/logprob_diff_fresh_max"] < 1e-3 < max(stale, default=1.0)


def test_the_prompt_stream_continues_and_no_prompt_is_trained_twice(runs):
    state, second = runs["state"], runs["second"]
    first_trained = _trained_positions(runs["first"])
    second_trained = _trained_positions(second)
    assert len(first_trained) == FIRST * BATCH // GROUP
    assert len(second_trained) == (TOTAL - FIRST) * BATCH // GROUP
    assert not set(first_trained) & set(second_trained)
    assert state["untrained"] and not set(state["untrained"]) & set(first_trained)
    # The groups left untrained at the checkpoint are admitted again first, then new ones.
    admitted = [e["position"] for e in second["ctl"].core.admission.log]
    assert admitted[: len(state["untrained"])] == state["untrained"]
    assert admitted[len(state["untrained"])] == state["drawn"]


def test_resuming_a_run_without_checkpoints_says_so(tmp_path, tiny_model_dir):
    cfg = letter_config(tmp_path / "empty", tiny_model_dir, TOTAL)
    with pytest.raises(RunFailed, match="cannot resume: .* holds no complete checkpoint"):
        asyncio.run(Controller(cfg, resume=True).run())


def test_a_new_run_in_a_previous_runs_directory_is_refused_and_that_run_kept(runs, tiny_model_dir):
    # Mixed in, the previous run's newer checkpoints and weight versions would be kept by the
    # new run's pruning and its own removed (a checkpoint's resume state then has no folder).
    run_dir = runs["run_dir"]
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    config = (run_dir / "config.yaml").read_text()
    cfg = letter_config(run_dir, tiny_model_dir, FIRST)
    with pytest.raises(RunFailed, match=r"holds a previous run \(metrics.jsonl, weights/, check"):
        asyncio.run(Controller(cfg).run())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert (run_dir / "config.yaml").read_text() == config
