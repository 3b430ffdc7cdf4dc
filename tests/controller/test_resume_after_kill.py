"""`kill -9` of the controller, then `--resume`, in the stream and collective weight-sync modes
(disk: bench/chaos.py --quick), as real processes.

The killed run has published versions past its newest checkpoint (checkpoint at step 4,
killed after step 7 or later). Its workers must die with it at once and write nothing more
(no new weight version, no final_model). The resumed run must own the run directory (the
newer versions are removed before its trainer publishes version 5 again: before, the
trainer's pruning deleted the version it had just published and the rollout worker hung on
the missing directory), finish, and, read from metrics.jsonl alone, have trained every
prompt group exactly once: the step records the resume superseded are set aside
(areal.records), the rest account for every drawn prompt group exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal.records import read_records
from cli_runs import (
    all_gone,
    kill_hard,
    last_step,
    letter_overrides,
    log_tail,
    run_to_end,
    start,
    wait_for,
)

pytestmark = pytest.mark.slow

TOTAL, KILL_AFTER = 10, 7


def _state(run_dir: Path) -> list[str]:
    weights = run_dir / "weights"
    return sorted(p.name for p in weights.iterdir()) if weights.is_dir() else []


def accounting(run_dir: Path) -> dict[str, list[int]]:
    """Draw positions trained, dropped and left untrained, from the run's records."""
    kept = read_records(run_dir)
    steps = [r for r in kept if r["kind"] == "step"]
    (summary,) = [r for r in kept if r["kind"] == "summary"]
    trained = [p for r in steps for p in r["rollout/trained_positions"]]
    dropped = [p for r in steps for p in r["rollout/dropped_positions"]]
    dropped += summary["rollout/dropped_positions"]
    return {
        "steps": [r["step"] for r in steps],
        "trained": trained,
        "dropped": dropped,
        "untrained": summary["untrained_positions"],
        "drawn": summary["num_drawn"],
    }


# Disk mode (the default) is killed and resumed the same way by bench/chaos.py --quick in
# the suite (tests/bench/test_chaos.py, fault kill_controller), which checks the same records.
@pytest.mark.parametrize("mode", ["stream", "collective"])
def test_a_run_killed_hard_resumes_and_trains_every_group_once(mode, tmp_path, tiny_model_dir):
    run_dir, log = tmp_path / "run", tmp_path / "controller.log"
    args = letter_overrides(
        run_dir,
        tiny_model_dir,
        f"trainer.total_steps={TOTAL}",
        "trainer.checkpoint_every=4",
        f"weight_sync.mode={mode}",
    )
    proc = start(args, log)
    try:
        wait_for(lambda: last_step(run_dir) >= KILL_AFTER, 240, f"step {KILL_AFTER}", proc)
    except AssertionError:
        proc.kill()
        raise AssertionError(log_tail(log)) from None
    workers, tree = kill_hard(proc)
    assert len(workers) == 3
    assert all_gone(tree, timeout_s=10), "workers (or their fork server) outlived the controller"
    published = _state(run_dir)
    killed_at = last_step(run_dir)
    assert not (run_dir / "final_model").exists()

    code = run_to_end(["--resume", str(run_dir), *args[2:]], log)
    assert code == 0, log_tail(log)
    (after,) = [r["step"] for r in read_records(run_dir) if r.get("event") == "resumed"]
    assert after in (4, 8)  # 8: the killed run reached its second checkpoint first
    if mode == "disk" and after == 4:
        assert published and max(published) >= "v000006"  # versions past the checkpoint
    done = accounting(run_dir)
    assert done["steps"] == list(range(1, TOTAL + 1))
    assert len(done["trained"]) == len(set(done["trained"])) == TOTAL * 2
    everything = done["trained"] + done["dropped"] + done["untrained"]
    assert sorted(everything) == list(range(done["drawn"]))
    superseded = [
        r["step"]
        for r in read_records(run_dir, superseded=True)
        if r["kind"] == "step" and r.get("superseded")
    ]
    # The killed run's steps past the resumed checkpoint, each superseded once; none when
    # the kill came right after the step-8 checkpoint.
    assert superseded == list(range(after + 1, killed_at + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == TOTAL and summary["resumed_after_step"] == after
    assert (run_dir / "final_model" / "config.json").is_file()
