"""bench/soak.py's verdict on a series of samples: start / end / max, and the slope of the
second half (what grows once warm-up is over), per hour and relative to the process's size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from soak import Series, slope_per_hour, summarize, table


def test_a_warm_up_followed_by_a_plateau_has_no_second_half_slope():
    minutes = [float(m) for m in range(60)]
    rss = [400 + min(m, 10) * 20 for m in range(60)]  # grows 200 MB, then flat
    assert slope_per_hour(minutes, rss) == pytest.approx(0.0, abs=1e-9)


def test_steady_growth_is_reported_per_hour_and_relative_to_the_size():
    minutes = [float(m) for m in range(60)]
    series = {
        "controller": Series(
            minutes=minutes, rss_mb=[500 + 0.5 * m for m in range(60)], fds=[23.0] * 60
        )
    }
    (row,) = summarize(series)
    assert row["rss_mb_slope_h"] == pytest.approx(30.0)
    assert row["rss_mb_start"] == 500 and row["rss_mb_max"] == pytest.approx(529.5)
    assert row["rss_mb_slope_pct_h"] == pytest.approx(100 * 30 / (500 + 0.5 * 44.5))
    assert row["fds_slope_h"] == pytest.approx(0.0, abs=1e-9)
    assert "controller" in table([row], 60.0)
