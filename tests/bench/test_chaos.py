"""`python bench/chaos.py --quick`: a real run survives kill -9 of the reward worker, the
trainer and the controller (resumed) and a frozen rollout worker, and its own records
show every prompt group trained exactly once (the bench checks them and exits 1 if not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_chaos_quick_loses_nothing_and_trains_nothing_twice(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lost 0, duplicated 0; hangs 0" in done.stdout
    assert "all                           4        4" in done.stdout
    assert "chaos check: PASSED" in done.stdout
