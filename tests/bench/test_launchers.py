"""`python bench/launchers.py --quick`: one local and one Ray trial of a real run, each
timed to its workers' start and to the replacement of its killed rollout worker."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.ray
def test_launchers_quick_times_both_launchers_and_their_ratio(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "launchers.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {
        label: re.search(rf"{re.escape(label)}\D*?([\d.]+)\s+([\d.]+)\s+([\d.]+)x", done.stdout)
        for label in ("start-up", "first step", "replace a lost rollout worker")
    }
    assert all(rows.values()), done.stdout
    for match in rows.values():
        local, ray, ratio = map(float, match.groups())
        assert local > 0 and ray > 0
        # the ratio is of the unrounded times, each printed to 0.1 s (so within 0.05 of the
        # printed one), and is itself printed to 0.01: a forked local worker starts in under
        # a second, where that rounding is several percent
        lowest = (ray - 0.05) / (local + 0.05) - 0.005
        highest = (ray + 0.05) / (local - 0.05) + 0.005
        assert lowest <= ratio <= highest, (local, ray, ratio)
