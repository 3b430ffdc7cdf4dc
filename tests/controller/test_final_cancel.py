"""When training ends, the controller cancels the training generations still running; a
cancelled request gets no answer, so its slot on the rollout worker must be freed at once.
Otherwise a worker that was full (rollout.max_concurrent requests) looks full forever and
the final evaluation is never dispatched: seen as a hang after the last step of a run with
eta=4 (unit level: the controller's own pool and ledger, a recording channel in place of
the socket)."""

from __future__ import annotations

import asyncio

import numpy as np

from offline import offline_controller

from areal.config import load_config
from areal.controller.ledger import Purpose
from areal.controller.pool import WorkerHandle
from areal.messages import Cancel, WorkerKind
from areal.tasks.base import Prompt

CAPACITY = 4


def test_cancelled_training_requests_free_the_workers_slots_for_the_final_evaluation(tmp_path):
    cfg = load_config(overrides=[f"rollout.max_concurrent={CAPACITY}", f"run_dir={tmp_path}",
                                 "task.group_size=2", "trainer.batch_size=2"])
    ctl = offline_controller(cfg, tmp_path)
    worker = WorkerHandle(worker_id="rollout-0", kind=WorkerKind.ROLLOUT, identity=b"r0",
                          ready=True)
    ctl.pool.by_identity[worker.identity] = worker
    prompt = Prompt(prompt_id="p", text="1+1=", reference="2")
    for _ in range(3):  # 6 training samples: 4 dispatched (the worker is full), 2 pending
        ctl.ledger.add_group(prompt, np.array([5], np.int32), 2, version=0)
    for _ in range(CAPACITY):
        sample = ctl.ledger.pending.popleft()
        ctl.ledger.start_generation(sample, worker.identity, now=0.0)
        worker.in_flight.add(sample.request_id)
    room = ctl._room[WorkerKind.ROLLOUT]  # where dispatch finds a worker with a free slot
    room.offer(worker)
    assert room.peek() is None  # full

    asyncio.run(ctl._cancel_training_requests())

    ((identity, cancel),) = ctl.channel.sent
    assert identity == worker.identity and isinstance(cancel, Cancel)
    assert len(cancel.request_ids) == CAPACITY and not worker.in_flight
    assert room.peek() is worker
    assert not ctl.ledger.pending  # training samples not yet sent are gone too
    ctl.ledger.add_group(prompt, np.array([5], np.int32), 1, 0, Purpose.EVAL, front=True)
    assert len(ctl.ledger.pending) == 1  # the evaluation can now be dispatched
