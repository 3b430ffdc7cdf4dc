"""bench/soak.py: which processes it samples (the controller, the fork server, every worker,
each with the processes it started), and its verdict on a series of samples: start / end /
max, and the slope of the second half (what grows once warm-up is over), per hour and
relative to the process's size."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from soak import FORK_SERVER, Series, sample, slope_per_hour, summarize, table

STAND_INS = {
    "run.py": "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, 'worker.py', '--worker-id', 'reward-0'])\n"
    "subprocess.Popen([sys.executable, 'server.py', 'areal.controller.fork_server'])\n"
    "time.sleep(600)\n",
    "worker.py": "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, 'sleep.py'])\n"
    "time.sleep(600)\n",
    "server.py": "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, 'forked.py'])\n"
    "time.sleep(600)\n",
    "forked.py": "import setproctitle, time\n"
    "setproctitle.setproctitle('python -m areal.workers.rollout --worker-id rollout-0')\n"
    "time.sleep(600)\n",
    "sleep.py": "import time\ntime.sleep(600)\n",
}
"""A controller that started a reward worker (which started a sandbox) and a fork server
(which forked a rollout worker, titled as one string), as real processes."""


def test_every_worker_is_sampled_also_those_the_fork_server_started(tmp_path):
    """Local workers are the fork server's children, titled as one string: all are found,
    and a worker's own child (a sandbox) counts with it."""
    for name, code in STAND_INS.items():
        (tmp_path / name).write_text(code)
    run = subprocess.Popen([sys.executable, "run.py"], cwd=tmp_path)
    controller = psutil.Process(run.pid)
    try:
        stop = time.monotonic() + 60
        while set(sample(controller)) != {"controller", FORK_SERVER, "reward-0", "rollout-0"}:
            assert time.monotonic() < stop, sample(controller)
            time.sleep(0.05)
        reward = next(p for p in controller.children(recursive=True) if "reward-0" in p.cmdline())
        (sandbox,) = reward.children()
        assert sample(controller)["reward-0"][1] == reward.num_fds() + sandbox.num_fds()
    finally:
        for process in controller.children(recursive=True):
            process.kill()
        run.kill()
        run.wait()


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
