"""`python bench/ablation.py --quick`: the staleness ablation's smoke test, run as a user
runs it (a subprocess; real training runs, one seed, a few steps, numbers meaningless)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_quick_ablation_trains_every_cell_and_writes_table_cells_and_plot(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/ablation.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cells = json.loads((tmp_path / "cells.json").read_text())
    assert {eta: set(row) for eta, row in cells.items()} == {"0": {"naive"}, "2": {"recompute"}}
    for eta, row in cells.items():
        for column, (result,) in row.items():
            assert result["seed"] == 1 and result["steps"] == 3, result
            assert 0.0 <= result["pass@1"] <= 1.0 and result["train_time_s"] > 0
            assert sum(result["staleness"].values()) == 3 * 16  # every trained trajectory
            assert max(int(k) for k in result["staleness"]) <= 3 - 1  # trained version <= 2
            if eta == "0":  # eta 0 in async mode is synchronous-equivalent: all fresh
                assert result["staleness"] == {"0": 3 * 16}, (column, result["staleness"])
    table = (tmp_path / "table.txt").read_text()
    assert table in done.stdout
    assert "naive PPO" in table and "decoupled, recomputed prox" in table
    assert "mean [95% t-interval] over [1] seeds" in table
    assert "eta=2" in table and (tmp_path / "ablation.png").stat().st_size > 10_000
    # The mechanism of every cell, from its step records (trainer.measure_movement).
    assert "KL(prox || new)" in table and "eta=2 recompute" in table and "0.95-1.05" in table
    for row in cells.values():
        for (result,) in row.values():
            assert all("train/kl_prox_new" in step for step in result["per_step"])
