"""Registration refusals: handed to the controller's rate-limited log, counted, and kept in
bounded memory however many a peer sends."""

from __future__ import annotations

import logging

from areal.config import load_config
from areal.controller.pool import WorkerHandle, MAX_REFUSED, WorkerPool
from areal.messages import Register, WorkerKind


def _register(pool: WorkerPool, identity: bytes, worker_id: str, secret: str):
    return pool.register(
        identity,
        Register(kind=WorkerKind.ROLLOUT, worker_id=worker_id, pid=1, host="h", secret=secret),
    )


def test_forged_registrations_are_counted_in_bounded_memory(tmp_path, caplog):
    seen = []
    pool = WorkerPool(
        load_config(),
        tmp_path,
        "tcp://x:1",
        secret="right",
        on_refused=lambda identity, msg, why: seen.append(why),
    )
    with caplog.at_level(logging.WARNING):
        for i in range(1000):
            assert _register(pool, b"evil", f"forged-{i}", "wrong") == "wrong secret"
    assert len(pool.refused) == MAX_REFUSED
    assert seen == ["wrong secret"] * 1000 and caplog.records == []  # the controller logs
    assert isinstance(_register(pool, b"good", "rollout-0", "right"), WorkerHandle)


def test_a_remote_worker_reusing_a_registered_name_gets_a_distinct_one(tmp_path):
    pool = WorkerPool(load_config(), tmp_path, "tcp://x:1", secret=None)
    first = _register(pool, b"rollout-0/" + b"a" * 32, "rollout-0", "")
    pool.expected["rollout-0"] = first
    second = _register(pool, b"rollout-0/" + b"b" * 32, "rollout-0", "")
    assert first.worker_id == "rollout-0" and second.worker_id == "rollout-0@62626262"
