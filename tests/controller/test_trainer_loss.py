"""How the controller ends the step in progress when a trainer rank is lost (unit level: the
controller's own pool, groups, ledger and trainers.py, a recording channel in place of the
socket).

The races here are too narrow to hit on purpose in a real run: rank 0 may already have
published the step when its peer dies (the step is then done, and replayed later), or not
(the step is sent again after the restart). The real-process runs are in
test_trainer_recovery.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from offline import offline_controller

from areal.config import load_config
from areal.controller.controller import Controller
from areal.controller.groups import Groups
from areal.controller.pool import WorkerHandle
from areal.controller.trainers import MAX_RESTARTS, RunFailed, TrainerLost, Trainers
from areal.messages import Shutdown, Train, Trained, WorkerKind


def _train(step: int, rank: int) -> Train:
    n = np.zeros(2, np.int32)
    return Train(step=step, version=step - 1, token_ids=n, logprobs=n.astype(np.float32),
                 versions=n, loss_mask=n.astype(bool), cu_seqlens=np.array([0, 2], np.int32),
                 rewards=np.zeros(1, np.float32), group_ids=np.zeros(1, np.int64),
                 minibatch_sizes=[rank])


def _controller(tmp_path: Path) -> tuple[Controller, list[WorkerHandle], list[str]]:
    cfg = load_config(overrides=["trainer.num_ranks=2", "controller.remote_kinds=[trainer]",
                                 f"run_dir={tmp_path}"])
    ctl = offline_controller(cfg, tmp_path)
    lines: list[str] = []
    ctl._metrics = SimpleNamespace(console=lines.append, record=lambda *a, **k: None)
    ctl.groups = Groups(cfg, ctl.channel, ctl.pool, ctl._record_event)
    ctl.trainers = Trainers(cfg, ctl.channel, ctl.pool, ctl.groups, ctl.changed, ctl.recovery,
                            ctl._record_event, lines.append, ctl._log_of)
    ranks = []
    for rank in range(2):  # remote ranks: registered, no local process
        handle = WorkerHandle(worker_id=f"trainer-{rank}", kind=WorkerKind.TRAINER, rank=rank,
                              identity=f"t{rank}".encode(), ready=True)
        ctl.pool.by_identity[handle.identity] = handle
        ranks.append(handle)
    ctl.trainers.formed = True
    return ctl, ranks, lines


@pytest.mark.parametrize("rank0_published", [True, False])
def test_the_step_in_progress_ends_as_far_as_rank_0_got(tmp_path, rank0_published):
    ctl, (_rank0, rank1), lines = _controller(tmp_path)

    async def scenario():
        step = asyncio.create_task(ctl.trainers._send([_train(5, 0), _train(5, 1)]))
        await asyncio.sleep(0)  # sent to both ranks
        if rank0_published:
            assert ctl.trainers.answer(Trained(step=5, version=5, stats={}, rank=0))
        await ctl._lose(rank1, "silent")
        await asyncio.wait([step])
        return step

    trained = asyncio.run(scenario())
    if rank0_published:  # done: the next step waits for the restart and replays this one
        assert trained.result().version == 5
    else:
        with pytest.raises(TrainerLost, match=r"trainer rank 1 \(trainer-1 .*\) lost \(silent\)"):
            trained.result()
    # Either way every rank is restarted: the survivor is told to stop and come back.
    _, stop = [msg for identity, msg in ctl.channel.sent if identity == b"t0"]
    assert isinstance(stop, Shutdown) and stop.rejoin
    assert ctl.pool.ready(WorkerKind.TRAINER) == [] and not ctl.trainers.formed
    assert ctl.recovery.num_restores == 1 and ctl.groups.store == ""
    assert "waiting for remote trainer ranks [1, 0]" in lines[-1]


def test_a_rank_lost_too_often_fails_the_run(tmp_path):
    ctl, (_, rank1), _ = _controller(tmp_path)
    rank1.num_restarts = MAX_RESTARTS
    with pytest.raises(RunFailed, match=rf"lost {MAX_RESTARTS + 1} times"):
        asyncio.run(ctl._lose(rank1, "process exited"))
