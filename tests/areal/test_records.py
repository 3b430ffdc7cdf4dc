"""A run's history from metrics.jsonl: what a resume superseded is set aside (areal.records)."""

from __future__ import annotations

import json

import pytest

from areal.records import read_records


def _write(run_dir, records, torn: str = "") -> None:
    run_dir.mkdir(exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + torn
    (run_dir / "metrics.jsonl").write_text(text)


def _step(step):
    return {"kind": "step", "step": step}


def _eval(version):
    return {"kind": "eval", "step": version}


def _resumed(step):
    return {"kind": "event", "event": "resumed", "step": step, "version": step}


def test_records_a_resume_replaces_are_set_aside_and_marked(tmp_path):
    lost = {"kind": "event", "event": "worker_lost", "version": 5}
    _write(
        tmp_path,
        [
            _eval(0),
            _step(1),
            _step(2),
            _eval(2),
            _step(3),
            lost,
            _step(4),
            {"kind": "summary"},
            _resumed(2),
            _eval(2),
            _step(3),
            _step(4),
        ],
        torn='{"kind": "st',
    )
    kept = read_records(tmp_path)
    assert [(r["kind"], r.get("step")) for r in kept] == [
        ("eval", 0),
        ("step", 1),
        ("step", 2),
        ("event", None),
        ("event", 2),
        ("eval", 2),
        ("step", 3),
        ("step", 4),
    ]
    assert lost in kept  # events are history
    everything = read_records(tmp_path, superseded=True)
    assert len(everything) == 12
    marked = [(r["kind"], r.get("step")) for r in everything if r.get("superseded")]
    assert marked == [("eval", 2), ("step", 3), ("step", 4), ("summary", None)]


def test_a_second_resume_supersedes_the_first_ones_records_too(tmp_path):
    _write(
        tmp_path,
        [
            _step(1),
            _step(2),
            _step(3),
            _resumed(2),
            _step(3),
            _step(4),
            _resumed(3),
            _step(4),
            _step(5),
        ],
    )
    assert [r["step"] for r in read_records(tmp_path) if r["kind"] == "step"] == [1, 2, 3, 4, 5]


def test_a_bad_line_inside_the_file_is_an_error_naming_it(tmp_path):
    _write(tmp_path, [_step(1)], torn="not json\n" + json.dumps(_step(2)) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        read_records(tmp_path)
    with pytest.raises(FileNotFoundError, match="give a run directory"):
        read_records(tmp_path / "nowhere")
