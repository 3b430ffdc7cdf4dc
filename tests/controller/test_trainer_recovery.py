"""`kill -9` of a trainer rank in the middle of a run: the run restarts every rank from the
newest checkpoint, replays the steps trained since, and finishes with nothing lost.

Two real runs (real processes, sockets and checkpoints), each killed while a step is in
flight on the trainer:
- one rank, weights published to disk: the replayed weights are compared by the restarted
  trainer with those the killed one published for the same version;
- two data-parallel ranks (gloo), weights broadcast in the collective group: rank 1 dies,
  both restart, the trainer group is formed again (generation 2) and so is the weights group,
  whose sender (rank 0) is a new process. Its checkpoints are written in the background
  (trainer.checkpoint_async, through a gloo group of their own), so the controller hears of
  one a step or more after it was begun, and one being written when the ranks restart is lost.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from areal.config import load_config
from areal.controller import Controller, RunFailed
from areal.messages import WorkerKind

pytestmark = pytest.mark.slow

BATCH, GROUP, STEPS, EVERY, KILL_AFTER = 8, 4, 8, 3, 4
"""Killed while step 5 (or, on a fast machine, 6) is on the trainer: between checkpoints."""


def _config(run_dir: Path, model_dir: str, *overrides: str):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            f"trainer.total_steps={STEPS}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            "staleness.eta=1",
            f"trainer.checkpoint_every={EVERY}",
            "eval.max_prompts=4",
            "eval.every_steps=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "rollout.max_new_tokens=48",
            "controller.heartbeat_interval_s=0.5",
            "controller.heartbeat_timeout_s=30",
            "trainer.lr=1e-3",
            *overrides,
        ]
    )


async def _kill_trainer_mid_step(cfg, victim: str) -> dict:
    ctl = Controller(cfg)
    run = asyncio.create_task(ctl.run())
    records, killed = [], None
    async for record in ctl.events():
        records.append(record)
        if killed is None and record["kind"] == "step" and record["step"] == KILL_AFTER:
            for _ in range(400):  # until the next step is on the trainer
                if ctl.core.trainers.busy:
                    break
                await asyncio.sleep(0.02)
            killed = ctl.core.pool.expected[victim].process.pid
            os.kill(killed, signal.SIGKILL)
    return {"ctl": ctl, "records": records, "summary": await run, "killed": killed}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("one-rank") / "run"
    return asyncio.run(
        _kill_trainer_mid_step(
            _config(run_dir, tiny_model_dir, "weight_sync.mode=disk"), "trainer-0"
        )
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("two-ranks") / "run"
    return asyncio.run(
        _kill_trainer_mid_step(
            _config(
                run_dir,
                tiny_model_dir,
                "weight_sync.mode=collective",
                "trainer.num_ranks=2",
                "weight_sync.timeout_s=20",
                "trainer.checkpoint_async=true",
            ),
            "trainer-1",
        )
    )


def _events(run: dict, name: str) -> list[dict]:
    return [r for r in run["records"] if r["kind"] == "event" and r["event"] == name]


def _check_nothing_lost(run: dict) -> None:
    ctl, summary = run["ctl"], run["summary"]
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    steps = [r["step"] for r in run["records"] if r["kind"] == "step"]
    assert steps == list(range(1, STEPS + 1))
    trained = ctl.ledger.trained_group_ids
    assert len(trained) == len(set(trained)) == STEPS * BATCH // GROUP


@pytest.mark.parametrize("run_name", ["one_rank", "two_ranks"])
def test_a_killed_trainer_rank_is_restarted_and_the_run_completes(run_name, request):
    run = request.getfixturevalue(run_name)
    _check_nothing_lost(run)
    lost = _events(run, "worker_lost")
    assert [r["worker_id"] for r in lost] == [
        "trainer-0" if run_name == "one_rank" else "trainer-1"
    ]
    (restored,) = _events(run, "trainer_restored")
    # The trainer resumes from the newest checkpoint before the loss (every EVERY steps) and
    # replays the steps published since; the interrupted step is then sent again.
    published = lost[0]["version"]  # steps published when the loss was handled
    assert KILL_AFTER <= published < 2 * EVERY
    checkpoints = [r["step"] for r in _events(run, "checkpoint")]
    every_one = list(range(EVERY, STEPS + 1, EVERY))
    newest = EVERY * (published // EVERY)
    if run_name == "two_ranks":  # in the background: heard of a step or more later
        before_loss = run["records"].index(lost[0])
        heard = [
            r["step"] for r in _events(run, "checkpoint") if run["records"].index(r) < before_loss
        ]
        newest = max(heard, default=0)
        assert newest in (EVERY * (published // EVERY), EVERY * (published // EVERY - 1))
        assert checkpoints[-1] == every_one[-1] and set(checkpoints) <= set(every_one)
    else:
        assert checkpoints == every_one
    if newest:
        assert restored["checkpoint"].endswith(f"step_{newest:06d}")
    else:  # none heard of before the loss: the restart begins from the model
        assert restored["checkpoint"] == ""
    assert restored["replayed_steps"] == published - newest > 0


def test_replayed_weights_equal_those_the_killed_trainer_published(one_rank):
    (restored,) = _events(one_rank, "trainer_restored")
    assert restored["replay_max_abs_diff"] == 0.0


def test_two_ranks_form_their_group_again_and_broadcast_from_the_new_rank_0(two_ranks):
    ctl = two_ranks["ctl"]
    assert ctl.core.trainers.group.generation == 2
    joined = list(_events(two_ranks, "trainer_group_joined"))
    assert sorted((r["generation"], r["worker_id"]) for r in joined) == [
        (1, "trainer-0"),
        (1, "trainer-1"),
        (2, "trainer-0"),
        (2, "trainer-1"),
    ]
    # The weights group was formed again with the new sender, and every rollout worker
    # serves the final version.
    assert ctl.core.weights.num_reformed >= 1
    assert {h.version for h in ctl.core.pool.ready(WorkerKind.ROLLOUT)} == {STEPS}


def test_without_checkpoints_a_lost_trainer_fails_the_run_and_says_why(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path / "run", tiny_model_dir, "trainer.checkpoint_every=0")

    async def scenario():
        ctl = Controller(cfg)
        run = asyncio.create_task(ctl.run())
        async for record in ctl.events():
            if record["kind"] == "step":
                os.kill(ctl.core.pool.expected["trainer-0"].process.pid, signal.SIGKILL)
                break
        with pytest.raises(
            RunFailed,
            match=r"trainer rank 0 \(trainer-0 .*\) lost .*"
            r"trainer.checkpoint_every=0: no checkpoint to restart from",
        ):
            await run
        return ctl

    ctl = asyncio.run(scenario())
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert ctl.core.trainers.recovery.num_restores == 0
