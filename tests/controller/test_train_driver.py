"""The train driver's decisions (train_driver.py): which groups a step takes (strict bound:
earliest deadline first, none past it), the controller's part of a checkpoint written once
the step's record is, the batch's trajectories released by the packing thread that built
them, and the rest of the batch freed on a thread once the step is recorded."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import numpy as np
import pytest

from decisions import Decisions, config, generated, scored

from areal.controller import train_driver
from areal.controller.outbox import Outbox
from areal.controller.resume import STATE
from areal.messages import Cancel, Completions, Trained, WorkerKind
from areal.tasks.base import Verdict


def _complete(run: Decisions, group_id: int, version: int, rollout, reward) -> None:
    ids = [f"g{group_id}-s{i}-a0" for i in range(2)]
    for request_id in ids:
        run.on(rollout.identity, generated(request_id, version=version))
    run.on(reward.identity, scored(ids, [1.0, 0.0], [Verdict.OK, Verdict.WRONG]))


def test_without_strict_the_first_complete_groups_are_taken_and_trained_in_draw_order(tmp_path):
    """Which groups: those complete first. Their order in the batch: the prompts' draw
    order, so that the trainer's sums do not depend on which finished first."""
    run = Decisions(config(tmp_path, "trainer.batch_size=4"), tmp_path)
    run.admit(3)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    _complete(run, 2, 0, rollout, reward)
    assert run.core.driver.take_batch(2, Outbox()) is None
    _complete(run, 0, 0, rollout, reward)
    batch = run.core.driver.take_batch(2, Outbox())
    assert [g.group_id for g in batch] == [0, 2]
    assert [g.position for g in batch] == sorted(g.position for g in batch)
    assert run.core.ledger.trained_group_ids == [2, 0]  # the buffer gave them in that order


def test_strict_takes_the_earliest_deadline_first_and_drops_what_missed_it(tmp_path):
    run = Decisions(
        config(
            tmp_path,
            "staleness.strict=true",
            "staleness.eta=1",
            "trainer.batch_size=4",
            "rollout.max_concurrent=64",
        ),
        tmp_path,
    )
    run.admit(4)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    run.core.weights.version = 2  # published meanwhile (weight_sync.py owns it)
    _complete(run, 0, 0, rollout, reward)  # oldest token v0: deadline 1 < 2, dropped on arrival
    assert run.core.ledger.dropped_group_ids == [0]
    _complete(run, 1, 2, rollout, reward)  # deadline 3
    _complete(run, 2, 1, rollout, reward)  # deadline 2
    _complete(run, 3, 2, rollout, reward)  # deadline 3
    out = Outbox()
    batch = run.core.driver.take_batch(2, out)
    assert [g.group_id for g in batch] == [1, 2]  # earliest deadlines first, in draw order
    run.core.weights.version = 4
    out = Outbox()
    assert run.core.driver.take_batch(1, out) is None  # group 3 (deadline 3) missed it
    assert run.core.ledger.dropped_group_ids == [0, 3] and not out.sent(Cancel)
    assert run.core.report.dropped_total == {"stale": 2}


def test_the_resume_state_is_written_with_the_step_record_not_before(tmp_path):
    run = Decisions(config(tmp_path), tmp_path)
    run.admit(3)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    run.core.report.start_training()
    for group_id in range(2):
        _complete(run, group_id, 0, rollout, reward)
    checkpoint = tmp_path / "checkpoints" / "step_1"
    checkpoint.mkdir(parents=True)
    driver = run.core.driver
    trained = Trained(step=1, version=1, stats={"loss": 0.5}, checkpoint=str(checkpoint))
    driver.checkpointed(trained)
    assert not (checkpoint / STATE).exists()  # the step's record is not written yet
    groups = driver.take_batch(2, Outbox())
    record = driver.record_step(1, groups, trained, train_s=1.0, waited_s=0.5)
    state = json.loads((checkpoint / STATE).read_text())
    assert state["step"] == 1 and state["version"] == 1 and state["untrained"] == [2]
    assert record["train/loss"] == 0.5 and record["rollout/trained_positions"] == [0, 1]
    assert record["rollout/reward_mean"] == 0.5
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    kinds = [(json.loads(line)["kind"], json.loads(line).get("event")) for line in lines]
    assert kinds[-2:] == [("step", None), ("event", "checkpoint")]
    assert np.isclose(record["perf/train_wait_s"], 0.5)


def test_a_checkpoint_reported_steps_later_gets_the_state_of_its_own_step(tmp_path):
    # trainer.checkpoint_async: step 2's checkpoint is written while step 3 trains, and the
    # Trained of step 3 reports it. Its resume state is the one taken at step 2's record.
    cfg = config(tmp_path, "trainer.checkpoint_every=2", "trainer.batch_size=2", "staleness.eta=4")
    run = Decisions(cfg, tmp_path)
    run.admit(4)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    run.core.report.start_training()
    driver = run.core.driver
    for step in (1, 2, 3):
        _complete(run, step - 1, 0, rollout, reward)
        trained = Trained(step=step, version=step, stats={})
        driver.record_step(step, driver.take_batch(1, Outbox()), trained, 1.0, 0.0)
    checkpoint = tmp_path / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    assert not (checkpoint / STATE).exists()
    later = Trained(step=3, version=3, stats={}, checkpoint=str(checkpoint), checkpoint_step=2)
    driver.checkpointed(later)
    state = json.loads((checkpoint / STATE).read_text())
    assert (state["step"], state["version"], state["path"]) == (2, 2, str(checkpoint))
    assert state["untrained"] == [2, 3]  # as at step 2: the group step 3 trained included
    assert run.core.trainers.recovery.checkpoint == str(checkpoint)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "checkpoint"] == [2]


@pytest.mark.parametrize(
    "overrides, released",
    [
        ((), True),
        (("logging.save_batches=true",), False),  # _save_batch reads them after packing
        (("trainer.advantage.mask_truncated=true",), False),  # the step record reads them
    ],
)
def test_packing_releases_the_trajectories_it_built_from_recorded_completions(
    tmp_path, overrides, released
):
    """Packed on its thread, a batch of recorded completions leaves no trajectory on its
    samples (freed there, not on the loop with the batch) unless something reads them later;
    one read again is built again, and packs the same."""
    run = Decisions(config(tmp_path, *overrides), tmp_path)
    run.admit(2)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    ids = [f"g{g}-s{i}-a0" for g in range(2) for i in range(2)]
    run.on(
        rollout.identity,
        Completions.of([generated(r, num_tokens=2 + i) for i, r in enumerate(ids)]),
    )
    for g in range(2):
        run.on(
            reward.identity, scored(ids[2 * g : 2 * g + 2], [1.0, 0.0], [Verdict.OK, Verdict.WRONG])
        )
    driver = run.core.driver
    groups = driver.take_batch(2, Outbox())
    samples = [s for g in groups for s in g.samples]
    assert all(s.recorded is not None for s in samples)
    groups[1].episodes = True  # a batch with an agent episode: the step record reads them all
    driver._pack(1, 0, groups)
    assert all(s.trajectory is not None for s in samples)
    groups[1].episodes = False
    for sample in samples:
        sample.release_trajectory()
    first, _ = driver._pack(1, 0, groups)
    assert all((s.trajectory is None) is released for s in samples)
    assert [s.generated.num_tokens for s in samples] == [5, 6, 7, 8]  # built again when read
    again, _ = driver._pack(1, 0, groups)
    assert len(first) == len(again) == 1
    for name in ("token_ids", "logprobs", "versions", "loss_mask", "advantages"):
        assert np.array_equal(getattr(first[0], name), getattr(again[0], name)), name


def test_a_trained_batch_is_freed_on_a_thread_beside_the_loop(tmp_path, monkeypatch):
    """Once its record is written, the loop drops its last references to the step's groups
    and Train messages into a list a worker thread clears: the thousands of objects of a
    batch at cluster scale are freed there, not on the loop's thread, and that thread's
    CPU is counted in the next step's perf/pack_cpu_s."""
    run = Decisions(config(tmp_path, "trainer.total_steps=2"), tmp_path)
    run.admit(4)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    run.core.report.start_training()
    for group_id in range(4):
        _complete(run, group_id, 0, rollout, reward)
    driver = run.core.driver
    freed = []

    def free(batch):
        groups, messages = batch
        # Each group: held by the batch's list, this loop's variable and getrefcount's
        # argument alone. The Train messages' list is not counted here: the finished future
        # of `_pack` holds it too until the loop's thread or the pool's lets that go, which
        # may come before or after this thread runs (a few arrays, not the batch's objects).
        freed.append(
            (threading.get_ident(), [sys.getrefcount(group) for group in groups], id(messages))
        )
        return real_free(batch) + 100.0  # told apart from packing's seconds below

    async def run_step(step, messages, stopping):
        driver.trainers.recovery.steps.append(messages)  # kept until a checkpoint
        return Trained(step=step, version=step, stats={"loss": 0.5})

    real_free = train_driver._free
    monkeypatch.setattr(train_driver, "_free", free)
    monkeypatch.setattr(driver.trainers, "run_step", run_step)

    async def train():
        loop_thread = threading.get_ident()
        async with asyncio.TaskGroup() as periodic:
            assert await driver._train(periodic) == 2
        return loop_thread

    loop_thread = asyncio.run(train())
    assert len(freed) == 2 and all(thread != loop_thread for thread, _, _ in freed)
    assert [counts for _, counts, _ in freed] == [[3, 3], [3, 3]]
    # Once the run is over, each step's Train messages are held by the trainers' kept steps
    # alone (and getrefcount's argument): nothing else kept them.
    kept = driver.trainers.recovery.steps
    assert [id(messages) for messages in kept] == [messages_id for _, _, messages_id in freed]
    assert [sys.getrefcount(messages) for messages in kept] == [3, 3]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["perf/pack_cpu_s"] >= 100.0 for r in steps] == [False, True]
