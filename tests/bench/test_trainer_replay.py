"""`python bench/trainer_replay.py RUN_DIR`: a run's saved batches trained again alone,
next to the run's own step times and the cost model's price. The run here is written by
hand (three steps of small packed batches) so that the in-run column is known."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from calibration import QUICK_WARMSTART  # noqa: E402
from machine_timings import packed_batch  # noqa: E402
from speedup import LONG_TAIL_TASK  # noqa: E402

from areal.config import config_to_yaml, load_config  # noqa: E402
from areal.models.warmstart import ensure_warm_model  # noqa: E402

NUMBER = r"([0-9.]+)"


def _fake_run(run_dir: Path) -> list[tuple[float, float]]:
    """A run directory as a real run with logging.save_batches leaves it: config, step
    records, one saved batch per step. Returns each step's (train/step_s, train/publish_s).
    The model only gives the batches their shape: the calibration smoke test's warm start
    (the same cached model) does."""
    cfg = load_config(overrides=[*LONG_TAIL_TASK, "seed=1", *QUICK_WARMSTART])
    cfg = load_config(
        overrides=[
            *LONG_TAIL_TASK,
            "seed=1",
            *QUICK_WARMSTART,
            f"model.path={ensure_warm_model(cfg)}",
            f"run_dir={run_dir}",
        ]
    )
    (run_dir / "batches").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    times = [(0.5, 0.01), (0.25, 0.02), (0.75, 0.03)]
    records = []
    for step, (seqs, length) in enumerate([(8, 24), (16, 32), (8, 40)], start=1):
        batch = packed_batch(seqs, length)
        np.savez(
            run_dir / "batches" / f"step_{step:06d}.npz",
            version=step - 1,
            **{
                name: getattr(batch, name).numpy()
                for name in (
                    "token_ids",
                    "logprobs",
                    "versions",
                    "loss_mask",
                    "cu_seqlens",
                    "rewards",
                    "group_ids",
                )
            },
        )
        step_s, publish_s = times[step - 1]
        records.append(
            {"kind": "step", "step": step, "train/step_s": step_s, "train/publish_s": publish_s}
        )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [{"kind": "event"}, *records])
    )
    return times


@pytest.mark.slow
def test_replay_prints_each_step_in_run_alone_and_priced(tmp_path):
    times = _fake_run(tmp_path / "run")
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "trainer_replay.py"), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(
        rf"^\s+(\d+)\s+(\d+)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", done.stdout, re.MULTILINE
    )
    assert [int(r[0]) for r in rows] == [2, 3]  # the first step is left out
    assert [int(r[1]) for r in rows] == [16 * 32, 8 * 40]
    for row, (step_s, publish_s) in zip(rows, times[1:], strict=True):
        assert float(row[2]) == pytest.approx(step_s + publish_s, abs=1e-3)
        assert float(row[3]) > 0 and float(row[4]) > 0
    total = re.search(
        rf"steps 2-3: in run {NUMBER} s, alone {NUMBER} s, model {NUMBER} s; "
        rf"in run / alone {NUMBER}, alone / model {NUMBER}",
        done.stdout,
    )
    assert total, done.stdout
    in_run, alone, model, ratio, priced = map(float, total.groups())
    assert in_run == pytest.approx(sum(s + p for s, p in times[1:]), abs=1e-3)
    # the totals are printed to the millisecond, the ratios of the unrounded ones
    assert ratio == pytest.approx(in_run / alone, rel=0.02)
    assert priced == pytest.approx(alone / model, rel=0.02)
