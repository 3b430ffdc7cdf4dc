"""examples/launch/slurm.sh run for real: submitted with sbatch to a one-node Slurm of this
machine (.ci/slurm_localhost.sh sets it up: Debian's slurmctld + slurmd with munge), as a
CPU job (GPUS_PER_NODE=0): the controller, one trainer rank and one rollout worker are
Slurm steps joining over CurveZMQ with the keys the script makes, and the run finishes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTROLLER_TESTS = REPO / "tests" / "controller"

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def _slurm_answers() -> bool:
    if shutil.which("sbatch") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def slurm():
    if not _slurm_answers():
        if os.environ.get("AREAL_REQUIRE_SLURM") == "1":
            pytest.fail("no Slurm answers here; run .ci/slurm_localhost.sh as root first")
        pytest.skip("no Slurm here (as root: bash .ci/slurm_localhost.sh)")


def test_the_slurm_script_runs_a_job_to_the_end(slurm, tmp_path, tiny_model_dir):
    sys.path.insert(0, str(CONTROLLER_TESTS))
    from cli_runs import letter_overrides

    run_dir, keys, config = tmp_path / "run", tmp_path / "keys", tmp_path / "job.yaml"
    config.write_text("logging:\n  progress: false\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(
        os.environ,
        CONFIG=str(config),
        KEYS_DIR=str(keys),
        PORT=str(port),
        GPUS_PER_NODE="0",
        NUM_RANKS="1",
        NUM_ROLLOUT="1",
        PYTHONPATH=os.pathsep.join([str(CONTROLLER_TESTS), os.environ.get("PYTHONPATH", "")]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    )
    overrides = [
        o
        for o in letter_overrides(run_dir, tiny_model_dir, "trainer.total_steps=3")
        if not o.startswith("controller.heartbeat")
    ]
    out = tmp_path / "slurm-%j.out"
    done = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            "--nodes=1",
            "--ntasks-per-node=3",
            "--gpus-per-node=0",
            f"--output={out}",
            f"--chdir={REPO}",
            "--export=ALL",
            str(REPO / "examples" / "launch" / "slurm.sh"),
            *overrides,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    (log,) = tmp_path.glob("slurm-*.out") or [None]
    text = log.read_text(errors="replace") if log else ""
    assert done.returncode == 0, (done.stdout, done.stderr, text[-4000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == 3
    assert (run_dir / "final_model" / "config.json").is_file()
    assert "waiting for remote workers (rollout, trainer)" in text
    assert (keys / "server.key").is_file()  # the script made the CurveZMQ keys
