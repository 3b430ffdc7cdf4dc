"""Resuming a run from its newest checkpoint: what the controller saves beside the trainer's.

    <run_dir>/checkpoints/step_<s>/   the trainer's state (areal.workers.trainer.checkpoint),
                                      weights/ (safetensors: what rollout workers load)
        controller.json               written by the controller when it hears of the
                                      checkpoint: step, version, how many training prompts
                                      were drawn, the draw positions of prompt groups not
                                      trained by then, the evaluation before training

`python -m areal.controller --resume RUN_DIR` reads the newest step directory that has both,
restarts the trainer from it and the rollout workers from its weights, draws the same
prompts again (the untrained groups first, then where the data stopped) and continues at
step s + 1. Groups in flight or buffered at the checkpoint are generated again; steps
trained after the checkpoint are trained again.

The resumed run owns the run directory before any worker starts (`clear_after`): weight
versions and checkpoints the stopped run wrote after the checkpoint are removed (a trainer
publishing version v + 1 again must not find, and prune in favour of, the old v + 3), and the
metrics records it supersedes are set aside by readers (areal.records) behind the `resumed`
event the controller records.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from areal.records import read_records
from areal.workers.trainer.checkpoint import META, write_json

STATE = "controller.json"


@dataclass(kw_only=True)
class ResumeState:
    step: int
    version: int
    drawn: int
    """Training prompts drawn from the task so far (the data cursor)."""
    untrained: list[int] = field(default_factory=list)
    """Draw positions of prompt groups admitted but not trained by this step."""
    eval_before: dict[str, Any] | None = None
    """The run's evaluation before any training (for the final summary)."""
    path: str = ""

    @property
    def weights(self) -> Path:
        return Path(self.path) / "weights"


def write_state(state: ResumeState) -> None:
    write_json(Path(state.path) / STATE, asdict(state))


def find_state(run_dir: str | Path) -> ResumeState:
    """The newest checkpoint of `run_dir` that can be resumed; ValueError saying why not."""
    root = Path(run_dir) / "checkpoints"
    candidates = sorted(root.iterdir(), reverse=True) if root.is_dir() else []
    for path in candidates:
        if (path / META).is_file() and (path / STATE).is_file() and (path / "weights").is_dir():
            data = json.loads((path / STATE).read_text())
            return ResumeState(**{**data, "path": str(path.resolve())})
    raise ValueError(
        f"{root} holds no complete checkpoint to resume from (the trainer saves "
        "one every trainer.checkpoint_every steps)"
    )


def previous_run(run_dir: str | Path) -> list[str]:
    """What a run wrote in `run_dir` that a new run there would mix with: its records, weight
    versions and checkpoints (a new run's pruning keeps the newest names, which would be the
    old run's). Empty when `run_dir` holds none of them (a run that failed at set-up wrote
    only its config.yaml)."""
    root = Path(run_dir)
    found = ["metrics.jsonl"] if (root / "metrics.jsonl").exists() else []
    for folder in ("weights", "checkpoints"):
        if (root / folder).is_dir() and any((root / folder).iterdir()):
            found.append(f"{folder}/")
    return found


def _number(name: str, prefix: str) -> int | None:
    digits = name.removeprefix(prefix)
    return int(digits) if name.startswith(prefix) and digits.isdigit() else None


def clear_after(run_dir: str | Path, state: ResumeState) -> list[str]:
    """Remove what the stopped run wrote after `state`'s checkpoint: weight versions newer
    than its version, checkpoint directories of later steps. Returns what was removed."""
    removed = []
    for folder, prefix, limit in (
        ("weights", "v", state.version),
        ("checkpoints", "step_", state.step),
    ):
        root = Path(run_dir) / folder
        for path in sorted(root.iterdir()) if root.is_dir() else []:
            number = _number(path.name, prefix)
            if number is not None and number > limit:
                shutil.rmtree(path)
                removed.append(str(path))
    return removed


def kept_dropped_groups(run_dir: str | Path, state: ResumeState) -> dict[str, int]:
    """Groups dropped up to `state`'s step, by reason, from the records the resume keeps."""
    counts: dict[str, int] = {}
    try:
        records = read_records(run_dir)
    except FileNotFoundError:
        return counts
    for record in records:
        if record.get("kind") != "step" or record.get("step", 0) > state.step:
            continue
        for key, value in record.items():
            if key.startswith("rollout/dropped_groups/"):
                reason = key.removeprefix("rollout/dropped_groups/")
                counts[reason] = counts.get(reason, 0) + int(value)
    return counts
