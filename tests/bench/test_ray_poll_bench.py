"""`python bench/ray_poll.py --quick`: one liveness round's polling of Ray actors' exits,
each actor's own `ray.wait` against one over all, on a real local Ray instance."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_the_quick_run_prints_both_ways_and_their_ratio_and_publishes_nothing():
    before = sorted((REPO / "docs" / "results").glob("ray_poll.*"))
    stamps = [p.stat().st_mtime for p in before]
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ray_poll.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(r"^\s*([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", done.stdout, re.M)
    assert [int(count.replace(",", "")) for count, *_ in rows] == [64, 256]
    for _, each, one, ratio in rows:
        assert float(each) > 0 and float(one) > 0
        assert abs(float(ratio) - float(one) / float(each)) < 0.01 + 0.01 * float(ratio)
    assert [p.stat().st_mtime for p in before] == stamps  # a quick run publishes nothing
