"""The strict staleness bound in real runs (staleness.strict): with it on, no step trains a
token more than eta versions old; with it off, the admission-only bound of before.

Both runs have a straggler (late_reward_task.py): the second training group's reward checks
finish only after LATE_AFTER other checks. Why that breaks the admission-only bound whatever
the machine's speed: when the straggler's last sample is generated at version v, at most
(v + eta + 1) * B - v * B = 16 samples are admitted and not yet trained, 4 of them its own;
so of the LATE_AFTER = 32 checks it waits for, at least 20 are of samples admitted later,
which needs the window to grow by 20 samples, i.e. the version to reach v + 3. The group is
then trained 3 or more versions after it was sampled (off), or dropped as stale (on).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from areal.config import load_config
from areal.controller import Controller
from areal.controller.ledger import Purpose

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
BATCH, GROUP, STEPS, ETA, LATE_AFTER = 8, 4, 8, 1, 32


def _config(run_dir: Path, model_dir: str, strict: bool):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "task.name=late_reward_task:LateRewardTask",
            f"task.params={{late_index: 1, wait_for: {LATE_AFTER}, max_wait_s: 30}}",
            f"trainer.total_steps={STEPS}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            f"staleness.eta={ETA}",
            f"staleness.strict={strict}",
            "rollout.max_new_tokens=32",
            "reward.timeout_s=60",
            "eval.every_steps=0",
            "eval.max_prompts=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            "trainer.checkpoint_every=0",
            "controller.heartbeat_interval_s=0.5",
        ]
    )


async def _run(cfg) -> dict:
    ctl = Controller(cfg)
    run = asyncio.create_task(ctl.run())
    records = [r async for r in ctl.events() if r["kind"] == "step"]
    return {"ctl": ctl, "steps": records, "summary": await run}


async def _both(tmp: Path, model_dir: str) -> dict[bool, dict]:
    # Concurrently: the two runs spend much of their time waiting on worker start-up.
    off, on = await asyncio.gather(
        *(_run(_config(tmp / f"strict-{s}", model_dir, s)) for s in (False, True))
    )
    return {False: off, True: on}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        return asyncio.run(_both(tmp_path_factory.mktemp("strict"), tiny_model_dir))


def _staleness_max(run: dict) -> list[int]:
    return [r["staleness/max"] for r in run["steps"]]


def test_with_strict_on_no_step_trains_a_token_more_than_eta_versions_old(runs):
    run = runs[True]
    assert run["summary"]["steps"] == STEPS and len(run["steps"]) == STEPS
    assert all(m <= ETA for m in _staleness_max(run)), _staleness_max(run)
    for record in run["steps"]:
        assert all(int(k) <= ETA for k in record["staleness/hist"]), record["staleness/hist"]


def test_the_straggler_is_dropped_as_stale_and_its_cost_counted(runs):
    ctl, summary, steps = runs[True]["ctl"], runs[True]["summary"], runs[True]["steps"]
    straggler = next(e["group_id"] for e in ctl.core.admission.log if e["position"] == 1)
    assert straggler in ctl.ledger.dropped_group_ids
    assert straggler not in ctl.ledger.trained_group_ids
    num_stale = summary["dropped_groups"]["stale"]
    assert num_stale == len(ctl.ledger.dropped_group_ids)  # no other reason in this run
    assert sum(r.get("rollout/dropped_groups/stale", 0) for r in steps) <= num_stale
    assert summary["dropped_tokens"] > 0
    assert summary["dropped_tokens"] >= sum(r["rollout/dropped_tokens"] for r in steps)
    # Admission replaced what was dropped: every admitted group is accounted for.
    live = {g.group_id for g in ctl.ledger.buffer} | {
        gid for gid, g in ctl.ledger.groups.items() if g.purpose is Purpose.TRAIN
    }
    admitted = {e["group_id"] for e in ctl.core.admission.log}
    assert admitted == set(ctl.ledger.trained_group_ids) | set(ctl.ledger.dropped_group_ids) | live
    assert (
        ctl.core.admission.staleness.num_aborted + ctl.core.admission.staleness.num_rejected
        == num_stale * GROUP
    )


def test_with_strict_off_the_straggler_is_trained_beyond_eta_as_before(runs):
    run = runs[False]
    ctl, summary = run["ctl"], run["summary"]
    assert summary["dropped_groups"] == {} and not ctl.ledger.dropped_group_ids
    straggler = next(e["group_id"] for e in ctl.core.admission.log if e["position"] == 1)
    assert straggler in ctl.ledger.trained_group_ids
    assert max(_staleness_max(run)) >= ETA + 2, _staleness_max(run)
    # Admission itself kept the bound: N_r <= (version + eta + 1) * B at every admission.
    assert all(
        e["num_admitted"] <= (e["version"] + ETA + 1) * BATCH for e in ctl.core.admission.log
    )
