"""bench/paired.py: the comparisons' statistics on saved results (fast), and `--quick` run as
a user runs it (a subprocess; real training runs, one seed, a few steps, numbers
meaningless)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import paired  # noqa: E402


def _result(seed: int, accuracy: float) -> dict:
    per_step = [
        {
            "step": s,
            "reward": 0.4 + 0.01 * s,
            "train/clip_frac": 0.01 * seed,
            "train/kl_prox_new": 0.002,
            "train/behav_w_frac/0.95-1.05": 0.9,
            "train/behav_w_frac/>=2": 0.1,
        }
        for s in range(1, 4)
    ]
    return {
        "seed": seed,
        "pass@1": accuracy,
        "pass@1_before": 0.45,
        "train_time_s": 10.0,
        "steps": 3,
        "staleness": {"0": 8, "1": 8},
        "per_step": per_step,
    }


def test_the_comparisons_pair_by_seed_and_say_what_the_seeds_can_detect(tmp_path):
    sync = [0.60, 0.62, 0.58, 0.65, 0.61, 0.63]
    cells = {
        "sync": [_result(s + 1, a) for s, a in enumerate(sync)],
        "decoupled": [_result(s + 1, a + 0.005 * (-1) ** s) for s, a in enumerate(sync)],
        "naive": [_result(s + 1, a - 0.1) for s, a in enumerate(sync[:5])],
    }
    difference, equivalence = paired.comparisons(cells, margin=0.03, delta=0.05)
    assert difference["seeds"] == 5 and difference["mean"] == pytest.approx(0.1, abs=0.01)
    assert difference["verdict"].startswith("a > b") and difference["level"] == "95%"
    assert equivalence["seeds"] == 6 and equivalence["verdict"].startswith("equivalent")
    for test in (difference, equivalence):
        assert test["seeds_needed"] >= 2 and test["detectable"] > 0
    args = paired.parse_args(["--out", str(tmp_path)])
    text = paired.table(cells, [difference, equivalence], args)
    assert "(a) decoupled - naive: +0.1" in text and "(b) decoupled - sync" in text
    assert "seeds to detect a 0.05 difference" in text and "within +-0.03" in text
    assert "clipped" in text and "0.95-1.05" in text  # the mechanism table
    paired.plot(cells, [difference, equivalence], tmp_path / "paired.png")
    assert (tmp_path / "paired.png").stat().st_size > 10_000
    assert not args.publish and paired.parse_args([]).publish  # only the default place


@pytest.mark.slow
def test_quick_run_trains_both_arms_and_records_the_mechanism(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/paired.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cells = json.loads((tmp_path / "cells.json").read_text())
    assert set(cells) == {"decoupled", "naive"}
    for (result,) in cells.values():
        assert result["seed"] == 1 and result["steps"] == 3 and len(result["per_step"]) == 3
        for step in result["per_step"]:
            assert step["train/kl_prox_new"] >= 0 and "train/kl_behav_prox" in step, step
            assert sum(v for k, v in step.items() if "behav_w_frac/" in k) == pytest.approx(1.0)
    table = (tmp_path / "table.txt").read_text()
    assert table in done.stdout and "too few" in table
    assert (tmp_path / "paired.png").stat().st_size > 10_000
