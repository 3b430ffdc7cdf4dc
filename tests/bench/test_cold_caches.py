"""`python bench/cold_caches.py`: the controller's hot calls timed hot and with cold caches."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from cold_caches import COMPLETIONS, Inputs, _calls, measure, table  # noqa: E402

from areal.codec import decode  # noqa: E402
from areal.messages import Heartbeat  # noqa: E402


def test_the_inputs_are_what_the_controller_receives_and_records():
    inputs = Inputs(3)
    for msg, frames, score in zip(inputs.messages, inputs.frames, inputs.scores, strict=True):
        msg.check()
        decoded = decode(frames)
        assert decoded.request_ids == msg.request_ids == score.request_ids
        assert (decoded.output_ids == msg.output_ids).all()
        assert len(msg.request_ids) == COMPLETIONS
    calls = _calls(inputs)
    assert calls["completions_fit"](0)  # well-formed: the one-pass check accepts it
    assert calls["decode Heartbeat"](2) == Heartbeat()
    recorded = calls["Ledger.finish_completions"](1).samples
    assert [s.request_id for s in recorded] == inputs.messages[1].request_ids
    assert calls["Ledger.finish_completions"](1).samples == []  # recorded once: now stale


def test_a_small_run_times_every_call_hot_and_cold():
    rows = measure(count=4, repeats=1, sweep_mb=1)
    assert [r["call"] for r in rows] == list(_calls(Inputs(1)))
    assert all(r["hot_us"] > 0 and r["cold_us"] > 0 for r in rows)
    printed = table(rows).splitlines()
    assert printed[0].split() == ["call", "hot", "us", "cold", "us", "cold/hot"]
    assert len(printed) == 1 + len(rows) and all(line.endswith("x") for line in printed[1:])
