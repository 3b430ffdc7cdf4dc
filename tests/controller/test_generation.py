"""When training ends, the controller cancels the training generations still running; a
cancelled request gets no answer, so its slot on the rollout worker must be freed at once.
Otherwise a worker that was full (rollout.max_concurrent requests) looks full forever and
the final evaluation is never dispatched: seen as a hang after the last step of a run with
eta=4 (a decision of generation.py, read from its outbox)."""

from __future__ import annotations

import numpy as np

from areal.config import load_config
from areal.controller.generation import Generation
from areal.controller.ledger import Ledger, Purpose
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.messages import Cancel, Generate, WorkerKind
from areal.seeds import eval_sample_seed, train_sample_seed
from areal.tasks.base import Prompt

CAPACITY = 4


def test_cancelled_training_requests_free_the_workers_slots_for_the_final_evaluation(tmp_path):
    cfg = load_config(
        overrides=[
            f"rollout.max_concurrent={CAPACITY}",
            "rollout.max_queued=0",
            f"run_dir={tmp_path}",
            "task.group_size=2",
            "trainer.batch_size=2",
        ]
    )
    ledger = Ledger()
    pool = WorkerPool(cfg, tmp_path, "tcp://127.0.0.1:1", secret=None)
    generation = Generation(cfg, ledger, pool, stop_token_ids=[0])
    worker = WorkerHandle(
        worker_id="rollout-0", kind=WorkerKind.ROLLOUT, identity=b"r0", ready=True
    )
    pool.by_identity[worker.identity] = worker
    prompt = Prompt(prompt_id="p", text="1+1=", reference="2")
    for _ in range(3):  # 6 training samples: 4 dispatched (the worker is full), 2 pending
        ledger.add_group(prompt, np.array([5], np.int32), 2, version=0)
    generation.room.offer(worker)
    dispatched = Outbox()
    generation.dispatch(dispatched)
    sent = dispatched.sent(Generate)
    assert [len(msg.request_ids) for msg in sent] == [2, 2]  # a group per message
    assert len(ledger.pending) == 2
    assert not generation.can_dispatch()  # full

    out = Outbox()
    generation.cancel_training(out)

    ((identity, cancel),) = out.messages
    assert identity == worker.identity and isinstance(cancel, Cancel)
    assert len(cancel.request_ids) == CAPACITY and not worker.in_flight
    assert generation.room.peek() is worker
    assert not ledger.pending  # training samples not yet sent are gone too
    ledger.add_group(prompt, np.array([5], np.int32), 1, 0, Purpose.EVAL, front=True)
    assert generation.can_dispatch()  # the evaluation can now be dispatched


def test_each_sample_is_sent_with_its_own_seed_named_by_what_it_is(tmp_path, monkeypatch):
    """Training samples by (run seed, draw position, index), held-out samples by (run seed,
    prompt id, index): a retried attempt, another worker or another evaluation round gets
    the same stream (areal.seeds)."""
    cfg = load_config(
        overrides=[f"run_dir={tmp_path}", "task.group_size=2", "seed=7", "trainer.batch_size=2"]
    )
    ledger = Ledger()
    pool = WorkerPool(cfg, tmp_path, "tcp://127.0.0.1:1", secret=None)
    generation = Generation(cfg, ledger, pool, stop_token_ids=[0])
    worker = WorkerHandle(
        worker_id="rollout-0", kind=WorkerKind.ROLLOUT, identity=b"r0", ready=True
    )
    pool.by_identity[worker.identity] = worker
    generation.room.offer(worker)
    ledger.add_group(
        Prompt(prompt_id="t", text="", reference="1"),
        np.array([5], np.int32),
        2,
        version=0,
        position=41,
    )
    for round_id in range(2):
        ledger.add_group(
            Prompt(prompt_id="eval-3", text="", reference="1"),
            np.array([5], np.int32),
            2,
            0,
            Purpose.EVAL,
            eval_round=round_id,
        )
    out = Outbox()
    generation.dispatch(out)
    seeds = [seed for msg in out.sent(Generate) for seed in msg.seeds]
    assert seeds[:2] == [train_sample_seed(7, 41, 0), train_sample_seed(7, 41, 1)]
    assert seeds[2:4] == seeds[4:6] == [eval_sample_seed(7, "eval-3", i) for i in range(2)]

    # a retried attempt: the same seed, written at the group's first dispatch, not hashed again
    retried = ledger.groups[0].samples[1]
    worker.in_flight.discard(retried.request_id)
    ledger.requeue(retried)
    generation.room.offer(worker)
    hashed = []
    monkeypatch.setattr(
        "areal.controller.generation.train_group_seeds", lambda *a: hashed.append(a) or [0, 0]
    )
    out = Outbox()
    generation.dispatch(out)
    (again,) = out.sent(Generate)
    assert again.request_ids == ["g0-s1-a1"] and again.seeds == [train_sample_seed(7, 41, 1)]
    assert hashed == []


def test_a_groups_samples_spread_over_workers_with_room_and_go_together_to_each(tmp_path):
    cfg = load_config(
        overrides=["rollout.max_concurrent=3", "rollout.max_queued=2", f"run_dir={tmp_path}"]
    )
    ledger = Ledger()
    pool = WorkerPool(cfg, tmp_path, "tcp://127.0.0.1:1", secret=None)
    generation = Generation(cfg, ledger, pool, stop_token_ids=[0])
    workers = [
        WorkerHandle(
            worker_id=f"rollout-{i}", kind=WorkerKind.ROLLOUT, identity=b"r%d" % i, ready=True
        )
        for i in range(2)
    ]
    for worker in workers:
        pool.by_identity[worker.identity] = worker
        generation.room.offer(worker)
    prompt = Prompt(prompt_id="p", text="1+1=", reference="2")
    for _ in range(3):  # 12 samples for 2 x (3 + 2) = 10 slots
        ledger.add_group(prompt, np.array([5], np.int32), 4, version=0)
    out = Outbox()
    generation.dispatch(out)
    # each sample to the least-loaded worker: every group spread over both, and each
    # worker's samples of one group in one message
    sent = [(identity, msg.request_ids) for identity, msg in out.messages]
    assert sent == [
        (b"r0", ["g0-s0-a0", "g0-s2-a0"]),
        (b"r1", ["g0-s1-a0", "g0-s3-a0"]),
        (b"r0", ["g1-s0-a0", "g1-s2-a0"]),
        (b"r1", ["g1-s1-a0", "g1-s3-a0"]),
        (b"r0", ["g2-s0-a0"]),
        (b"r1", ["g2-s1-a0"]),
    ]
    assert [s.request_id for s in ledger.pending] == ["g2-s2-a0", "g2-s3-a0"]
    assert all(len(w.in_flight) == 5 for w in workers) and not generation.can_dispatch()
    # a worker's answer frees several slots: the next samples go to it in one message
    answered = ["g0-s0-a0", "g0-s2-a0", "g1-s0-a0"]
    workers[0].in_flight.difference_update(answered)
    generation.room.offer(workers[0])
    out = Outbox()
    generation.dispatch(out)
    assert [(identity, msg.request_ids) for identity, msg in out.messages] == [
        (b"r0", ["g2-s2-a0", "g2-s3-a0"])
    ]
    assert [msg.seeds for msg in out.sent(Generate)] == [
        [train_sample_seed(cfg.seed, ledger.groups[2].position, i) for i in (2, 3)]
    ]
