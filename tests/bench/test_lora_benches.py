"""`python bench/lora.py --quick` and `python bench/lora_learning.py --quick`, run as a user
runs them (subprocesses; real publications, a real trainer step, one real LoRA training run
of a few steps; numbers meaningless)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_quick_lora_bench_measures_both_tables(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/lora.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "table.txt").read_text()
    assert table in done.stdout
    rows = [line.split() for line in table.splitlines() if line.strip().startswith("10M")]
    assert len(rows) == 2  # one row per table
    publication, trainer = rows
    assert 0 < float(publication[4]) < 0.2  # adapters / full weights, bytes
    assert 0 < float(trainer[4]) < 1  # LoRA trainer memory / full


def test_quick_lora_learning_trains_and_tabulates(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/lora_learning.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cells = json.loads((tmp_path / "cells.json").read_text())
    assert set(cells) == {"lora-torch"}
    (result,) = cells["lora-torch"]
    assert result["steps"] == 3 and 0 <= result["pass@1"] <= 1
    assert 0 < result["publish_bytes"] < 1 << 20  # the adapters of the embedded model
    assert "lora-torch" in (tmp_path / "table.txt").read_text()
    assert (
        not (ROOT / "docs" / "results" / "lora_learning.json").exists()
        or "quick" not in (ROOT / "docs" / "results" / "lora_learning.json").read_text()
    )
