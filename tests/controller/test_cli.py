"""`python -m areal.controller`: bad configuration and a run that cannot be set up end with
one clear line on stderr and a non-zero exit code, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _controller(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal.controller", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_wrong_option_is_named(tmp_path):
    done = _controller("trainer.batch_size=60", cwd=tmp_path)
    assert done.returncode == 2
    assert "trainer.batch_size=60 is not a multiple of task.group_size=8" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_task_the_embedded_model_cannot_warm_start_on_is_refused(tmp_path):
    done = _controller(
        "task.name=gsm8k",
        f"task.params.path={REPO}/examples/data/gsm8k_train.jsonl",
        f"run_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert "cannot set up the run: task.name='gsm8k' has no sft_examples" in done.stderr
    assert "model.warmstart.steps=0" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_resume_needs_a_run_directory_with_a_checkpoint(tmp_path):
    done = _controller("--resume", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert done.returncode == 2
    assert f"cannot read config file '{tmp_path / 'nowhere'}/config.yaml'" in done.stderr
    both = _controller("--resume", str(tmp_path), "--config", "x.yaml", cwd=tmp_path)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
