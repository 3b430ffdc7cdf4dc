"""`python bench/chaos.py --quick`: a real run survives kill -9 of the reward worker, the
trainer and the controller (resumed) and a frozen rollout worker, and its own records
show every prompt group trained exactly once (the bench checks them and exits 1 if not)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
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


def test_a_zombie_counts_as_exited_and_a_live_process_does_not():
    """A killed controller's workers become zombies until an init reaps them (some reap
    every second or two): they run nothing, so the bench does not wait for their reaping."""
    sys.path.insert(0, str(REPO / "bench"))
    from chaos_faults import wait_exited

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie = psutil.Process(dead.pid)
        while zombie.status() != psutil.STATUS_ZOMBIE:  # exited, not reaped: no wait() yet
            time.sleep(0.01)
        assert wait_exited([zombie], timeout_s=5)[1] == []
        waited, running = wait_exited([zombie, psutil.Process(live.pid)], timeout_s=0.2)
        assert [p.pid for p in running] == [live.pid] and waited >= 0.2
    finally:
        live.kill()
        live.wait()
        dead.wait()
