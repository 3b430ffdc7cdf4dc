"""`python bench/chaos.py --quick`: a real run survives kill -9 of the reward worker, the
trainer and the controller (resumed) and a frozen rollout worker, and its own records
show every prompt group trained exactly once (the bench checks them and exits 1 if not)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from chaos import KINDS, QUICK_KINDS, fault_kinds
from chaos_faults import Fault, Hang, RunUnderTest, wait_exited, wait_stopped

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


def test_a_run_without_reward_workers_is_not_given_their_faults():
    assert fault_kinds(False, {}) == KINDS and fault_kinds(True, {}) == QUICK_KINDS
    assert fault_kinds(False, {"reward.num_workers": "2"}) == KINDS
    kinds = fault_kinds(False, {"reward.num_workers": "0"})
    assert kinds == tuple(kind for kind in KINDS if kind not in ("kill_reward", "stop_reward"))
    assert "kill_reward" not in fault_kinds(True, {"reward.num_workers": "0"})


def test_a_frozen_process_is_waited_for_until_it_is_seen_stopped():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        process = psutil.Process(sleeper.pid)
        assert wait_stopped([process], 0.1) == [process]  # running: still so at the timeout
        process.send_signal(signal.SIGSTOP)
        assert wait_stopped([process], 10.0) == []
        assert process.status() == psutil.STATUS_STOPPED
    finally:
        sleeper.kill()
        sleeper.wait()
    assert wait_stopped([process], 0.1) == []  # gone counts as no longer running


def test_a_zombie_counts_as_exited_and_a_live_process_does_not():
    """A killed controller's workers become zombies until an init reaps them (some reap
    every second or two): they run nothing, so the bench does not wait for their reaping."""
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


FAKE_RUN = """
import subprocess, sys, time
sleeper = "import time; time.sleep(600)"
children = [
    subprocess.Popen([sys.executable, "-c", sleeper, "--worker-id", name])
    for name in ("rollout-0", "trainer-0")
]
time.sleep(600)
"""


@pytest.fixture
def frozen_weight_run(tmp_path):
    """bench/chaos_faults.RunUnderTest around a stand-in controller whose children carry a
    rollout worker's and a trainer rank's --worker-id (real processes, real signals), a
    weights folder at v000001 and a record of a full batch buffered."""
    run_dir = tmp_path / "run"
    (run_dir / "weights" / "v000001").mkdir(parents=True)
    (run_dir / "weights" / "v000001" / "model.safetensors").write_bytes(b"1")
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text('{"kind": "step", "buffer/trajectories": 8}\n')
    run = RunUnderTest(
        run_dir=run_dir,
        overrides=[],
        log=tmp_path / "log",
        deadline_s=20.0,
        heartbeat_timeout_s=2.0,
        batch_size=8,
        proc=subprocess.Popen([sys.executable, "-c", FAKE_RUN]),
    )
    while len(run.workers()) < 2:
        time.sleep(0.05)
    workers = run.workers()
    yield run, workers["rollout-0"], workers["trainer-0"], metrics
    for process in [*workers.values(), psutil.Process(run.proc.pid)]:
        process.kill()
    run.proc.wait()


def _publish_when_frozen(run_dir: Path, rollout: psutil.Process, seen: dict) -> None:
    """The trainer's part: a version published while the rollout worker is frozen; then
    what held when the worker was thawed."""
    while rollout.status() != psutil.STATUS_STOPPED:
        time.sleep(0.01)
    version = run_dir / "weights" / "v000002"
    version.mkdir()
    (version / "model.safetensors").write_bytes(b"2")
    while rollout.status() == psutil.STATUS_STOPPED:
        time.sleep(0.01)
    seen["trainer at thaw"] = seen["trainer"].status()
    seen["file at thaw"] = (version / "model.safetensors").exists()


def test_a_failed_weight_load_keeps_the_trainer_frozen_until_the_worker_failed(
    frozen_weight_run,
):
    """A version published after the deletion would be loaded instead of the deleted one
    (a thawed worker skips to the newest update it holds), and the fault would wait for a
    failure that never comes: the trainer ranks stay frozen from the deletion until the
    worker's failure is recorded, and are thawed then."""
    run, rollout, trainer, metrics = frozen_weight_run
    seen: dict = {"trainer": trainer}
    publisher = threading.Thread(
        target=_publish_when_frozen, args=(run.run_dir, rollout, seen), daemon=True
    )
    publisher.start()

    def fail_once_thawed() -> None:
        publisher.join()
        with open(metrics, "a") as f:
            f.write('{"kind": "event", "event": "weights_load_failed"}\n')

    threading.Thread(target=fail_once_thawed, daemon=True).start()
    fault = Fault(kind="weight_load")
    failed = run._weight(fault, 0)
    assert run.records[failed]["event"] == "weights_load_failed"
    assert seen["trainer at thaw"] == psutil.STATUS_STOPPED
    assert seen["file at thaw"] is False
    assert fault.injected and fault.detail == "deleted v000002"
    assert trainer.status() != psutil.STATUS_STOPPED
    assert rollout.status() != psutil.STATUS_STOPPED


def test_a_weight_load_that_never_fails_is_a_hang_and_thaws_the_trainer(frozen_weight_run):
    run, rollout, trainer, _ = frozen_weight_run
    seen: dict = {"trainer": trainer}
    threading.Thread(
        target=_publish_when_frozen, args=(run.run_dir, rollout, seen), daemon=True
    ).start()
    with pytest.raises(Hang, match="weights_load_failed"):
        run._weight(Fault(kind="weight_load"), 0)
    assert seen["trainer at thaw"] == psutil.STATUS_STOPPED
    assert trainer.status() != psutil.STATUS_STOPPED
    assert rollout.status() != psutil.STATUS_STOPPED
