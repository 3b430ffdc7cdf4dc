"""Dropping training groups on purpose, in a real run: the shared mechanism behind dynamic
sampling, the strict staleness bound and reward failures (Controller.group_filters and
Controller.drop_group). A dropped group is never trained on, its running generations are
cancelled, its slots in the staleness window are freed so that admission replaces it, and
every step record counts what was dropped and the tokens thrown away.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from areal.config import load_config
from areal.controller import Controller
from areal.controller.ledger import Purpose, Stage

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
BATCH, GROUP, STEPS = 8, 4, 4


def _config(run_dir: Path, model_dir: str):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "task.name=letter_task:LetterTask",
            f"trainer.total_steps={STEPS}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            "staleness.eta=1",
            "rollout.max_new_tokens=48",
            "eval.every_steps=0",
            "eval.max_prompts=2",
            "logging.progress=false",
            "logging.tensorboard=false",
            "trainer.checkpoint_every=0",
            "controller.heartbeat_interval_s=0.5",
        ]
    )


def _every_third(group) -> str | None:
    return "every_third" if group.group_id % 3 == 0 else None


async def _run(cfg) -> dict:
    ctl = Controller(cfg)
    ctl.group_filters.append(_every_third)
    run = asyncio.create_task(ctl.run())
    records, cancelled = [], None
    async for record in ctl.events():
        records.append(record)
        if record["kind"] == "step" and record["step"] == 1:
            # Drop a group while some of its samples are still being generated.
            for _ in range(400):
                running = [
                    g
                    for g in ctl.ledger.groups.values()
                    if g.purpose is Purpose.TRAIN
                    and any(s.stage is Stage.GENERATING for s in g.samples)
                ]
                if running:
                    break
                await asyncio.sleep(0.01)
            group = running[0]
            cancelled = {
                "group_id": group.group_id,
                "request_ids": [s.request_id for s in group.samples if s.stage is Stage.GENERATING],
            }
            await ctl.drop_group(group, "by_test")
    summary = await run
    return {"ctl": ctl, "records": records, "summary": summary, "cancelled": cancelled}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("dropped") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        return asyncio.run(_run(_config(run_dir, tiny_model_dir)))


def test_dropped_groups_are_never_trained_and_every_admitted_group_is_accounted_for(run):
    ctl, summary = run["ctl"], run["summary"]
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    trained, dropped = ctl.ledger.trained_group_ids, ctl.ledger.dropped_group_ids
    assert len(trained) == len(set(trained)) == STEPS * BATCH // GROUP
    assert not set(trained) & set(dropped)
    assert run["cancelled"]["group_id"] in dropped
    assert all(g % 3 != 0 for g in trained)
    unfinished = {g.group_id for g in ctl.ledger.buffer} | {
        gid for gid, g in ctl.ledger.groups.items() if g.purpose is Purpose.TRAIN
    }
    admitted = {entry["group_id"] for entry in ctl.core.admission.log}
    assert admitted == set(trained) | set(dropped) | unfinished


def test_every_drop_is_counted_once_in_the_step_records_and_the_summary(run):
    ctl, summary = run["ctl"], run["summary"]
    steps = [r for r in run["records"] if r["kind"] == "step"]
    by_reason = {
        reason: sum(r.get(f"rollout/dropped_groups/{reason}", 0) for r in steps)
        for reason in ("every_third", "by_test")
    }
    assert by_reason["by_test"] == 1 and by_reason["every_third"] >= 1
    assert sum(r["rollout/dropped_groups"] for r in steps) <= len(ctl.ledger.dropped_group_ids)
    assert summary["dropped_groups"]["by_test"] == 1
    assert sum(summary["dropped_groups"].values()) == len(ctl.ledger.dropped_group_ids)
    assert any(r["rollout/dropped_tokens"] > 0 for r in steps)


def test_the_staleness_window_frees_the_slots_of_dropped_groups(run):
    staleness = run["ctl"].core.admission.staleness
    dropped_samples = len(run["ctl"].ledger.dropped_group_ids) * GROUP
    assert staleness.num_aborted + staleness.num_rejected == dropped_samples
    assert staleness.num_consumed == STEPS * BATCH
    assert staleness.num_in_flight >= 0 and staleness.num_buffered >= 0
