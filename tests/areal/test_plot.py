"""`python -m areal.plot`: PNGs from metrics.jsonl, one run or several overlaid, panels
without data left out, torn last lines and standalone eval records tolerated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from areal.plot import PANELS, main, plot_runs, read_run, series


EPISODE_KEYS = {
    "episode/tool_use_fraction": 0.5,
    "episode/tool_error_rate": 0.1,
    "episode/turns_mean": 1.5,
    "episode/tool_calls_mean": 0.5,
    "episode/model_tokens_mean": 12.0,
    "episode/observation_tokens_mean": 6.0,
    "episode/tool_s_mean": 0.01,
    "episode/calls_mean": 2.0,
    "episode/segments_mean": 1.0,
    "episode/retries_coalesced": 0,
    "episode/endpoint_queue_s_mean": 0.001,
    "episode/endpoint_decode_s_mean": 0.1,
}


def _write_run(
    run_dir: Path,
    num_steps: int = 6,
    *,
    with_loss: bool = True,
    torn: bool = False,
    episodes: bool = True,
) -> Path:
    run_dir.mkdir(parents=True)
    lines = [{"kind": "eval", "step": 0, "eval/pass@1": 0.1, "eval/reward_mean": 0.1}]
    for step in range(1, num_steps + 1):
        record = {
            "kind": "step",
            "step": step,
            "rollout/reward_mean": step / 10,
            "rollout/accuracy": step / 12,
            "staleness/mean": 0.5,
            "staleness/max": 1,
            "staleness/hist": {"0": 4, "1": 4},
            "perf/gen_tokens_per_s": 900.0 + step,
            "perf/train_tokens_per_s": 400.0,
            "perf/trained_tokens_per_s": 300.0,
            "rollout/interruptions": step % 3,
            "perf/elapsed_s": 2.0 * step,
            "rollout/completion_len_mean": 20.0,
            "train/logprob_diff_fresh": 1e-6,
            "train/logprob_diff_stale": 0.01 * step,
            "train/logprob_diff_fresh_max": 1e-5,
            "train/logprob_diff_stale_max": 0.1,
            "train/behav_kl_fresh": 1e-12,
            "train/behav_kl_stale": 1e-4,
            "train/behav_masked_frac_stale": 0.01,
            "train/clipped_frac_fresh": 0.0,
            "train/clipped_frac_stale": 0.02,
        }
        if with_loss:
            record["train/loss"] = math.nan if step == 2 else 0.1 * step
        if episodes:
            record.update(EPISODE_KEYS)
        lines.append(record)
    lines += [
        {"kind": "eval", "step": num_steps, "eval/pass@1": 0.4},
        {"kind": "eval", "source": "areal.eval", "eval/pass@1": 0.9},  # no step
        {"kind": "event", "event": "worker_ready"},
        {"kind": "summary", "steps": num_steps},
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (run_dir / "metrics.jsonl").write_text(text + ('{"kind": "st' if torn else ""))
    return run_dir


def _not_blank(path: Path) -> None:
    rgb = matplotlib.image.imread(path)[..., :3]
    assert rgb.shape[0] > 100 and float(np.std(rgb)) > 0.01, path


def test_series_skips_non_finite_values_and_evals_without_step(tmp_path):
    run = read_run(_write_run(tmp_path / "r", torn=True))
    xs, ys = series(run, "step", "train/loss", "step")
    assert xs == [1, 3, 4, 5, 6] and ys == pytest.approx([0.1, 0.3, 0.4, 0.5, 0.6])
    assert series(run, "eval", "eval/pass@1", "step") == ([0.0, 6.0], [0.1, 0.4])
    assert series(run, "eval", "eval/pass@1", "time") == ([0.0, 12.0], [0.1, 0.4])


@pytest.mark.slow
def test_one_run_gives_an_overview_and_a_png_per_panel(tmp_path):
    run_dir = _write_run(tmp_path / "r", with_loss=False)
    assert main([str(run_dir)]) == 0
    written = sorted(p.stem for p in (run_dir / "plots").glob("*.png"))
    assert written == sorted({"overview", *PANELS} - {"loss"})  # no train/loss: no panel
    for path in (run_dir / "plots").glob("*.png"):
        _not_blank(path)


@pytest.mark.slow
def test_single_completion_runs_draw_no_episode_panels(tmp_path):
    run_dir = _write_run(tmp_path / "r", episodes=False)
    paths = plot_runs([run_dir], tmp_path / "out")
    assert {p.stem for p in paths} == {"overview", *PANELS} - {
        "tool_use",
        "turns",
        "episode_tokens",
        "tool_time",
        "agent",
        "endpoint",
    }


@pytest.mark.slow
def test_several_runs_are_overlaid_against_time(tmp_path):
    runs = [_write_run(tmp_path / "sync", 4, episodes=False), _write_run(tmp_path / "async", 8)]
    paths = plot_runs(runs, tmp_path / "cmp", x_axis="time")
    assert paths[0].name == "overview.png" and len(paths) == 1 + len(PANELS)
    _not_blank(paths[0])


def test_missing_or_empty_metrics_are_reported(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"kind": "event"}\n')
    assert main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "no step or eval records" in err
