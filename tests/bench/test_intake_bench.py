"""`python bench/intake.py`: the event loop's CPU per Completions, with and without the
intake thread."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from intake import COMPLETIONS, _frames, measure  # noqa: E402

from areal.codec import decode  # noqa: E402
from areal.controller import checks  # noqa: E402


def test_its_messages_are_the_frames_of_well_formed_completions_of_the_size_asked():
    body = _frames(4096, np.random.default_rng(0))
    assert not checks.worth_the_intake(body)  # below the threshold: the loop would read it
    assert checks.worth_the_intake(_frames(checks.INTAKE_MIN_BYTES // 8, np.random.default_rng(0)))
    msg = decode(body)
    msg.check()
    assert len(msg.request_ids) == COMPLETIONS and msg.output_ids.size == 4096
    assert checks.completions_fit(msg, max_new_tokens=4096, version=1, vocab_size=151_936)


def test_each_way_is_measured_and_the_intake_did_the_reading(monkeypatch):
    import intake as bench

    monkeypatch.setattr(bench, "COLD_BYTES", 1 << 20)
    r = measure(4096, repeats=1, rng=np.random.default_rng(0))
    assert set(r) == {"loop", "waited", "ahead", "thread"}
    assert all(value > 0 for value in r.values())


def test_the_quick_run_prints_its_table_and_publishes_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "intake.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "tokens",
        "loop",
        "us",
        "waited",
        "ahead",
        "w/loop",
        "a/loop",
        "thread",
        "us",
    ]
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["4,096", "65,536"]
    assert all(float(value) > 0 for row in rows for value in row[1:])
