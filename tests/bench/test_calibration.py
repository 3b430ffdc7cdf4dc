"""`python bench/cluster.py --calibrate --quick`: the simulator's prediction of
bench/speedup.py's sync and async runs next to the real runs (short ones), from a cost
entry fitted to timings of this machine and to a short probe run of another seed. Checks
that every number is there and sane, not how close the prediction is (that depends on the
machine's load)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"([-+]?[0-9.]+)"  # the error column is signed: +6.1%, -2.1%


@pytest.mark.slow
def test_calibrate_quick_prints_prediction_and_measurement(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "cluster.py"),
            "--calibrate",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for mode in ("sync", "async"):
        match = re.search(rf"{mode} wall s\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%", out)
        assert match, out
        measured, predicted, error = map(float, match.groups())
        assert measured > 0.05 and predicted > 0
        # the error is of the unrounded times, each printed to 0.1 s (so within 0.05 of the
        # printed one), and is itself printed to 0.1 point
        lowest = ((predicted - 0.05) / (measured + 0.05) - 1) * 100 - 0.05
        highest = ((predicted + 0.05) / (measured - 0.05) - 1) * 100 + 0.05
        assert lowest <= error <= highest, (mode, measured, predicted, error)
        tokens = re.search(rf"{mode} trained tokens\s+{NUMBER}\s+{NUMBER}", out)
        assert tokens and float(tokens.group(1)) > 0 and float(tokens.group(2)) > 0, out
    ratio = re.search(rf"sync / async time\s+{NUMBER}x\s+{NUMBER}x", out)
    assert ratio and float(ratio.group(1)) > 0 and float(ratio.group(2)) > 0, out
    # the fitted entry is a cost-file entry like the shipped ones: every number sourced
    costs = yaml.safe_load((tmp_path / "costs-cpu.yaml").read_text())
    efficiency = costs["accelerators"]["cpu-2core"]["efficiency"]
    assert efficiency["mfu"]["value"] > 0 and efficiency["contention"]["value"] > 0
    assert all("source" in item for item in efficiency.values())
    # training is priced from the probe, a short async run of another seed (2, 2 steps)
    probe = re.search(
        rf"training price x {NUMBER} in a run: seed-2 async probe, median of 1 "
        rf"step over the fit's price",
        out,
    )
    assert probe and float(probe.group(1)) > 0, out
    assert efficiency["train_contention"]["value"] == 1.0
    assert "real async run of seed 2" in efficiency["train_mfu"]["source"]
    assert (tmp_path / "probe-async" / "batches" / "step_000002.npz").is_file()
    assert "measured by python bench/cluster.py --calibrate" in efficiency["mfu"]["source"]
    assert (tmp_path / "calibration-quick.txt").read_text().strip() in out


def test_the_prediction_evaluates_as_many_prompts_as_the_real_run_did(tmp_path):
    """The real run's first training groups are generated beside its opening evaluation;
    the simulated run is given the same number of held-out prompts (bench/calibration.py)."""
    sys.path.insert(0, str(REPO / "bench"))
    from calibration import first_eval_problems

    records = [
        {"kind": "event", "event": "data_loaded"},
        {"kind": "eval", "step": 0, "eval/num_problems": 256.0},
        {"kind": "step", "step": 1},
        {"kind": "eval", "step": 40, "eval/num_problems": 8.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert first_eval_problems(tmp_path) == 256
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(ValueError, match="no evaluation record"):
        first_eval_problems(tmp_path)
