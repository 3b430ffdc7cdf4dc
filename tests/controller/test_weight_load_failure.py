"""A weight version deleted under a running rollout worker (disk mode), as real processes.

The rollout worker is frozen (SIGSTOP) while the trainer publishes from buffered groups;
every version newer than the one the worker serves is then deleted and the worker thawed:
its load fails. Before, its update loop died, its requests stayed held and the run waited
forever with no error. Now the failure is reported, the controller sends the newest version
again each heartbeat, the worker serves its previous weights meanwhile, and the next version
the trainer publishes is loaded: the run finishes every step.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest

from areal.config import load_config
from areal.controller import Controller
from areal.messages import WorkerKind
from cli_runs import HERE, letter_overrides

pytestmark = pytest.mark.slow

STEPS, BATCH = 6, 8


async def _freeze_and_delete(ctl: Controller) -> dict:
    """Freeze the rollout worker with a batch buffered, wait for a publication, delete every
    version it does not serve yet, thaw it."""
    while ctl.ledger.num_buffered() < BATCH:
        await asyncio.sleep(0.01)
    (rollout,) = [h for h in ctl.core.pool.expected.values() if h.kind is WorkerKind.ROLLOUT]
    served = rollout.version
    os.kill(rollout.process.pid, signal.SIGSTOP)
    try:
        version = ctl.version
        while ctl.version == version:
            await asyncio.sleep(0.01)
        deleted = [
            p for p in (ctl.run_dir / "weights").iterdir() if int(p.name.removeprefix("v")) > served
        ]
        for path in deleted:
            shutil.rmtree(path)
    finally:
        os.kill(rollout.process.pid, signal.SIGCONT)
    return {"served": served, "deleted": sorted(p.name for p in deleted)}


async def _run(cfg) -> dict:
    ctl = Controller(cfg)
    run = asyncio.create_task(ctl.run())
    records, fault = [], None
    async for record in ctl.events():
        records.append(record)
        if record["kind"] == "step" and record["step"] == 2:
            fault = await _freeze_and_delete(ctl)
    return {
        "ctl": ctl,
        "records": records,
        "summary": await asyncio.wait_for(run, 120),
        "fault": fault,
    }


def test_a_failed_weight_load_is_retried_and_the_run_finishes(tmp_path, tiny_model_dir):
    cfg = load_config(
        overrides=letter_overrides(
            tmp_path / "run",
            tiny_model_dir,
            f"trainer.total_steps={STEPS}",
            "trainer.checkpoint_every=0",
            "controller.heartbeat_timeout_s=30",
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        run = asyncio.run(_run(cfg))
    assert run["fault"]["deleted"], run["fault"]
    failed = [r for r in run["records"] if r.get("event") == "weights_load_failed"]
    assert failed and "does not exist" in failed[0]["error"]
    assert f"v{failed[0]['failed_version']:06d}" in run["fault"]["deleted"]
    assert not [r for r in run["records"] if r.get("event") == "worker_lost"]
    assert run["summary"]["steps"] == STEPS and run["summary"]["final_version"] == STEPS
    assert not run["ctl"].core.weights.retries.failing
    assert Path(run["summary"]["run_dir"], "final_model", "config.json").is_file()
