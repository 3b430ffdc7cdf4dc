"""Reading a run's `metrics.jsonl` as its history: what a resume superseded is set aside.

`metrics.jsonl` is append-only, so a crashed run keeps every line it wrote. A run continued
with `--resume` restarts from its newest checkpoint (after step s, version v) and trains the
steps after s again; it first appends an event record `{"event": "resumed", "step": s,
"version": v}`. Every record before that marker which the resumed run replaces is
*superseded*:

- step records of steps > s (they are trained again);
- eval records of versions >= v (the resumed run evaluates version v first, then the new
  versions; the stopped run's versions past v were never checkpointed);
- the summary of an earlier part (a finished run continued with more steps).

Events (workers lost, checkpoints, ...) are history and are never superseded. Readers of a
run's curves (areal.plot, bench scripts, the chaos check) call `read_records`; with
`superseded=True` they also get the superseded ones, each marked `"superseded": true`.
A torn last line (a process killed mid-write) is ignored; any other bad line is an error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESUMED = "resumed"


def load_lines(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file, in order (a torn last line is skipped)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give a run directory")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # a run killed mid-write
                continue
            raise ValueError(f"{path} line {number} is not JSON") from None
    return records


def _supersedes(marker: dict[str, Any], record: dict[str, Any]) -> bool:
    kind = record.get("kind")
    if kind == "step":
        return record.get("step", -1) > marker["step"]
    if kind == "eval":
        return "step" in record and record["step"] >= marker["version"]
    return kind == "summary"


def mark_superseded(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same records, each superseded one a copy with `"superseded": True`."""
    out = [dict(r) for r in records]
    for index, record in enumerate(out):
        if record.get("kind") == "event" and record.get("event") == RESUMED:
            for earlier in out[:index]:
                if not earlier.get("superseded") and _supersedes(record, earlier):
                    earlier["superseded"] = True
    return out


def read_records(run_dir: str | Path, *, superseded: bool = False) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` that make up the run's history (see above);
    `superseded=True`: all of them, the replaced ones marked."""
    records = mark_superseded(load_lines(Path(run_dir) / "metrics.jsonl"))
    return records if superseded else [r for r in records if not r.get("superseded")]
