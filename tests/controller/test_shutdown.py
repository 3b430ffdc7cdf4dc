"""How a run ends when it is told to, or cannot start, as real processes.

SIGTERM (and SIGINT) to `python -m areal.controller` stop the run as `Controller.stop()`
does: the current step finishes, the final evaluation runs, summary.json and final_model are
written, every worker exits; the exit code says which signal (128 + its number). Before,
SIGTERM ended the controller at once (exit 143) with no summary and orphaned workers that
went on writing into the run directory. A run directory that cannot be written ends the CLI
with one line, and a final model that cannot be written leaves the previous one whole.
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from areal.workers.trainer.publish import write_directory
from cli_runs import (
    all_gone,
    last_step,
    letter_overrides,
    log_tail,
    process_tree,
    start,
    wait_for,
    workers_of,
)


@pytest.mark.slow
def test_sigterm_finishes_the_step_writes_the_summary_and_stops_every_worker(
    tmp_path, tiny_model_dir
):
    run_dir, log = tmp_path / "run", tmp_path / "controller.log"
    proc = start(
        letter_overrides(
            run_dir, tiny_model_dir, "trainer.total_steps=1000", "trainer.checkpoint_every=0"
        ),
        log,
    )
    try:
        wait_for(lambda: last_step(run_dir) >= 2, 240, "step 2", proc)
        workers, tree = workers_of(proc), process_tree(proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGTERM, log_tail(log)
    assert "SIGTERM: stopping after the current step" in log.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 2 <= summary["steps"] < 1000 and summary["final_version"] == summary["steps"]
    assert summary["steps"] == last_step(run_dir)
    assert (run_dir / "final_model" / "config.json").is_file()
    assert len(workers) == 3 and all_gone(tree, timeout_s=1)


def _immutable(path: Path) -> bool:
    """Make `path` unwritable even for root (chattr +i); False where that is not possible."""
    path.mkdir()
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.slow
def test_a_run_directory_that_cannot_be_written_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    if _immutable(locked):
        target, reason = locked / "run", "Operation not permitted"
    else:  # no chattr: a path under a regular file cannot be created either
        (tmp_path / "file").write_text("")
        target, reason = tmp_path / "file" / "run", "Not a directory"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "areal.controller", f"run_dir={target}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"cannot set up the run: run_dir='{target}' cannot be written ({reason})" in done.stderr


def test_a_final_model_that_cannot_be_written_leaves_the_previous_one_whole(tmp_path):
    target = tmp_path / "final_model"
    write_directory(target, lambda d: (d.mkdir(), (d / "model.safetensors").write_text("v1")))

    def disk_full(partial: Path) -> None:
        partial.mkdir()
        (partial / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_directory(target, disk_full)
    assert [p.name for p in target.iterdir()] == ["model.safetensors"]
    assert (target / "model.safetensors").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final_model"]
    write_directory(target, lambda d: (d.mkdir(), (d / "model.safetensors").write_text("v2")))
    assert (target / "model.safetensors").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final_model"]
