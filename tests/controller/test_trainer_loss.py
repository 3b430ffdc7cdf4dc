"""How the trainer ranks' step in progress ends when a rank is lost (trainers.py, with its
own pool; what it sends is read from the outboxes it hands to `send`, no socket).

The races here are too narrow to hit on purpose in a real run: rank 0 may already have
published the step when its peer dies (the step is then done, and replayed later), or not
(the step is sent again after the restart). The real-process runs are in
test_trainer_recovery.py.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal.config import load_config
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.controller.signal import Changed
from areal.controller.trainers import MAX_RESTARTS, RunFailed, Trainers
from areal.messages import Shutdown, Train, Trained, WorkerKind


def _train(step: int, rank: int) -> Train:
    n = np.zeros(2, np.int32)
    return Train(
        step=step,
        version=step - 1,
        token_ids=n,
        logprobs=n.astype(np.float32),
        versions=n,
        loss_mask=n.astype(bool),
        cu_seqlens=np.array([0, 2], np.int32),
        rewards=np.zeros(1, np.float32),
        group_ids=np.zeros(1, np.int64),
        minibatch_sizes=[rank],
    )


class _Trainers:
    """Trainers over two remote ranks (registered, no local process), recording what it sends,
    prints and asks of the weight sync."""

    def __init__(self, tmp_path: Path) -> None:
        cfg = load_config(
            overrides=[
                "trainer.num_ranks=2",
                "controller.remote_kinds=[trainer]",
                f"run_dir={tmp_path}",
            ]
        )
        self.pool = WorkerPool(cfg, tmp_path, "tcp://127.0.0.1:1", secret=None)
        self.sent: list[tuple[bytes, object]] = []
        self.lines: list[str] = []
        self.weights_told: list[str] = []
        self.trainers = Trainers(
            cfg,
            self.pool,
            Changed(),
            self._send,
            "tcp://127.0.0.1:1",
            lambda *a, **k: None,
            self.lines.append,
            lambda worker_id: tmp_path / f"{worker_id}.log",
            lambda: self.weights_told.append("trainers lost"),
        )
        self.ranks = []
        for rank in range(2):
            handle = WorkerHandle(
                worker_id=f"trainer-{rank}",
                kind=WorkerKind.TRAINER,
                rank=rank,
                identity=f"t{rank}".encode(),
                ready=True,
            )
            self.pool.by_identity[handle.identity] = handle
            self.ranks.append(handle)
        self.trainers.formed = True

    async def _send(self, out: Outbox) -> None:
        self.sent += out.messages

    async def lose(self, handle: WorkerHandle, why: str) -> None:
        """As the controller loses a rank: forgotten by the pool, then the trainers' part."""
        self.pool.forget(handle)
        await self.trainers.lost(handle, why)


@pytest.mark.parametrize("rank0_published", [True, False])
def test_the_step_in_progress_ends_as_far_as_rank_0_got(tmp_path, caplog, rank0_published):
    t = _Trainers(tmp_path)
    _, rank1 = t.ranks

    async def scenario():
        step = asyncio.create_task(
            t.trainers.run_step(5, [_train(5, 0), _train(5, 1)], lambda: False)
        )
        await asyncio.sleep(0)  # sent to both ranks
        if rank0_published:
            assert t.trainers.answer(Trained(step=5, version=5, stats={}, rank=0))
        await t.lose(rank1, "silent")
        if rank0_published:
            return await step
        await asyncio.sleep(0)
        assert not step.done()  # it waits for the restarted ranks, to send the step again
        step.cancel()
        return t.trainers.recovery.steps

    result = asyncio.run(scenario())
    if rank0_published:  # done: the next step waits for the restart and replays this one
        assert result.version == 5
    else:
        assert [m.step for m in result[0]] == [5, 5]  # kept, to be sent again
        assert re.search(
            r"step 5: trainer rank 1 \(trainer-1 .*\) lost \(silent\); it is sent "
            "again",
            caplog.text,
        ), caplog.text
    # Either way every rank is restarted: the survivor is told to stop and come back.
    train, stop = [msg for identity, msg in t.sent if identity == b"t0"]
    assert isinstance(train, Train) and isinstance(stop, Shutdown) and stop.rejoin
    assert t.pool.ready(WorkerKind.TRAINER) == [] and not t.trainers.formed
    assert t.trainers.recovery.num_restores == 1 and t.trainers.group.store == ""
    assert t.weights_told == ["trainers lost"]
    assert "waiting for remote trainer ranks [1, 0]" in t.lines[-1]


def test_a_rank_lost_too_often_fails_the_run(tmp_path):
    t = _Trainers(tmp_path)
    t.ranks[1].num_restarts = MAX_RESTARTS
    with pytest.raises(RunFailed, match=rf"lost {MAX_RESTARTS + 1} times"):
        asyncio.run(t.lose(t.ranks[1], "process exited"))


def test_every_rank_counts_as_restarting_until_the_local_ones_are_started_again(tmp_path):
    """Rank 1 (a local process) dies; the group's restart kills rank 0's process and starts
    both again. Until each is started the pool finds their processes exited: the trainers
    name them restarting meanwhile (the core does not lose them again), and no longer after."""
    t = _Trainers(tmp_path)
    for handle in t.ranks:
        handle.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        t.pool.expected[handle.worker_id] = handle
    rank0, rank1 = t.ranks
    rank1.process.kill()
    rank1.process.wait()
    started = {}

    async def start(kind, index, rank):  # the worker processes' launch is not under test
        started[rank] = (set(t.trainers.restarting), [h.worker_id for h in t.pool.exited()])
        return t.pool.expected[f"trainer-{rank}"]

    t.pool.start = start
    asyncio.run(t.lose(rank1, "process exited"))
    assert rank0.process.poll() is not None  # stopped by the restart
    both = {"trainer-0", "trainer-1"}
    assert started == {rank: (both, ["trainer-0", "trainer-1"]) for rank in (0, 1)}
    assert t.trainers.restarting == set() and t.trainers.recovery.num_restores == 1
    assert "waiting for remote" not in t.lines[-1]
