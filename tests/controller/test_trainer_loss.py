"""How the controller ends the step in progress when a trainer rank is lost (unit level: the
controller's own pool, groups and ledger, a recording channel in place of the socket).

The races here are too narrow to hit on purpose in a real run: rank 0 may already have
published the step when its peer dies (the step is then done, and replayed later), or not
(the step is sent again after the restart). The real-process runs are in
test_trainer_recovery.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal.config import load_config
from areal.controller.controller import Controller, TrainerLost
from areal.controller.groups import Groups
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.messages import Shutdown, Trained, WorkerKind


class RecordingChannel:
    address = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    async def send(self, identity: bytes, msg: object) -> bool:
        self.sent.append((identity, msg))
        return True


def _controller(tmp_path: Path) -> tuple[Controller, list[WorkerHandle], list[str]]:
    cfg = load_config(overrides=["trainer.num_ranks=2", "controller.remote_kinds=[trainer]",
                                 f"run_dir={tmp_path}"])
    ctl = Controller(cfg)
    lines: list[str] = []
    ctl._setup = SimpleNamespace(run_dir=tmp_path)
    ctl._metrics = SimpleNamespace(console=lines.append, record=lambda *a, **k: None)
    ctl.channel = RecordingChannel()
    ctl.pool = WorkerPool(cfg, tmp_path, ctl.channel.address, secret=None)
    ctl.groups = Groups(cfg, ctl.channel, ctl.pool, ctl._record_event)
    ranks = []
    for rank in range(2):  # remote ranks: registered, no local process
        handle = WorkerHandle(worker_id=f"trainer-{rank}", kind=WorkerKind.TRAINER, rank=rank,
                              identity=f"t{rank}".encode(), ready=True)
        ctl.pool.by_identity[handle.identity] = handle
        ranks.append(handle)
    ctl._trainers_formed = True
    return ctl, ranks, lines


@pytest.mark.parametrize("rank0_published", [True, False])
def test_the_step_in_progress_ends_as_far_as_rank_0_got(tmp_path, rank0_published):
    ctl, (rank0, rank1), lines = _controller(tmp_path)

    async def scenario():
        ctl._trained = asyncio.get_running_loop().create_future()
        ctl._trained_ranks = {}
        if rank0_published:
            ctl._trained_ranks[0] = Trained(step=5, version=5, stats={}, rank=0)
        await ctl._lose(rank1, "silent")
        return ctl._trained

    trained = asyncio.run(scenario())
    if rank0_published:  # done: the next step waits for the restart and replays this one
        assert trained.result().version == 5
    else:
        with pytest.raises(TrainerLost, match=r"trainer rank 1 \(trainer-1 .*\) lost \(silent\)"):
            trained.result()
    # Either way every rank is restarted: the survivor is told to stop and come back.
    (sent,) = [msg for identity, msg in ctl.channel.sent if identity == b"t0"]
    assert isinstance(sent, Shutdown) and sent.rejoin
    assert ctl.pool.ready(WorkerKind.TRAINER) == [] and not ctl._trainers_formed
    assert ctl.recovery.num_restores == 1 and ctl.groups.store == ""
    assert "waiting for remote trainer ranks [1, 0]" in lines[-1]


def test_a_rank_lost_too_often_fails_the_run(tmp_path):
    from areal.controller import RunFailed
    from areal.controller.controller import MAX_RESTARTS

    ctl, (_, rank1), _ = _controller(tmp_path)
    rank1.num_restarts = MAX_RESTARTS
    with pytest.raises(RunFailed, match=rf"lost {MAX_RESTARTS + 1} times"):
        asyncio.run(ctl._lose(rank1, "process exited"))
