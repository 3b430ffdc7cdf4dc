"""bench/speedup.py's plot: each mode's mean over seeds with a band, never one raw curve per
seed, and with --eval-every 0 an accuracy panel of before/after bars instead of a single
point at x = 0 (issue 32)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import speedup


def _runs(mode_shift: float, evaluate_versions: bool) -> list[tuple[dict, list[dict]]]:
    runs = []
    for seed in range(3):
        records = [{"kind": "eval", "version": 0, "eval/pass@1": 0.3, "perf/train_elapsed_s": 0.0}]
        for step in range(1, 11):
            records.append(
                {
                    "kind": "step",
                    "version": step,
                    "perf/train_elapsed_s": 10.0 * step,
                    "rollout/reward_mean": 0.3 + 0.04 * step + 0.01 * seed,
                }
            )
            if evaluate_versions and step % 5 == 0:
                records.append(
                    {
                        "kind": "eval",
                        "version": step,
                        "perf/train_elapsed_s": 10.0 * step,
                        "eval/pass@1": 0.3 + 0.05 * step + mode_shift,
                    }
                )
        summary = {"eval_pass@1_before": 0.3, "eval_pass@1_after": 0.7 + mode_shift + 0.02 * seed}
        runs.append((summary, sorted(records, key=lambda r: r["perf/train_elapsed_s"])))
    return runs


@pytest.mark.parametrize("evaluate_versions", [False, True])
def test_the_plot_shows_each_modes_mean_with_a_band(tmp_path, evaluate_versions):
    results = {"sync": _runs(0.0, evaluate_versions), "async": _runs(0.05, evaluate_versions)}
    fig = speedup._plot(results, tmp_path / "speedup.png")
    acc, rew = fig.axes
    assert len(rew.lines) == 2 and len(rew.collections) == 2  # one mean and one band per mode
    low, high = acc.get_ylim()
    assert high - low > 0.5  # the accuracy range, not a degenerate +-0.04 around one point
    if evaluate_versions:
        assert [len(line.get_xdata()) for line in acc.lines] == [3, 3]  # versions 0, 5, 10
    else:
        assert [t.get_text() for t in acc.get_xticklabels()] == [
            "before training",
            "after training",
        ]
        assert len(acc.patches) == 4  # before and after, per mode
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
