"""Registration refusals (a wrong secret, another release's protocol): handed to the controller's rate-limited log, counted, and kept in
bounded memory however many a peer sends."""

from __future__ import annotations

import logging

import pytest

from areal.codec import decode, encode
from areal.config import load_config
from areal.controller.pool import WorkerHandle, MAX_REFUSED, WorkerPool
from areal.messages import PROTOCOL_VERSION, Register, WorkerKind
from registers import register


def _register(
    pool: WorkerPool, identity: bytes, worker_id: str, secret: str, protocol: int = PROTOCOL_VERSION
):
    return pool.register(
        identity,
        Register(
            kind=WorkerKind.ROLLOUT,
            worker_id=worker_id,
            pid=1,
            host="h",
            secret=secret,
            protocol=protocol,
        ),
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


def test_only_a_registered_worker_has_an_address_to_send_to(tmp_path):
    pool = WorkerPool(load_config(), tmp_path, "tcp://x:1", secret=None)
    launched = WorkerHandle(worker_id="rollout-0", kind=WorkerKind.ROLLOUT)
    pool.expected["rollout-0"] = launched
    with pytest.raises(RuntimeError, match="rollout-0 has not registered"):
        _ = launched.address
    assert _register(pool, b"r0", "rollout-0", "") is launched
    assert launched.address == b"r0"


def test_a_worker_of_another_release_is_refused_with_both_protocol_versions(tmp_path):
    """A Register stating another PROTOCOL_VERSION, or none (a release from before
    versions: read as 0), is refused before it is known, and the reason names both; a wrong
    secret is still refused as that, whatever its protocol."""
    pool = WorkerPool(load_config(), tmp_path, "tcp://x:1", secret="right")
    older = _register(pool, b"a", "rollout-0", "right", protocol=0)
    assert older == (
        f"the worker speaks protocol 0 (a release from before protocol versions), this "
        f"controller {PROTOCOL_VERSION}: install the same areal release on the worker's "
        "machine as on the controller's"
    )
    newer = _register(pool, b"b", "rollout-1", "right", protocol=PROTOCOL_VERSION + 1)
    assert newer.startswith(
        f"the worker speaks protocol {PROTOCOL_VERSION + 1}, this controller {PROTOCOL_VERSION}:"
    )
    assert _register(pool, b"c", "rollout-2", "wrong", protocol=0) == "wrong secret"
    assert pool.by_identity == {} and pool.refused == ["rollout-0", "rollout-1", "rollout-2"]
    assert isinstance(_register(pool, b"a", "rollout-0", "right"), WorkerHandle)


def test_a_register_without_a_protocol_reads_as_protocol_0_on_the_wire():
    """What a worker from before versions sends: a Register with no protocol field."""
    frames = encode(Register(kind=WorkerKind.ROLLOUT, worker_id="w", pid=1, host="h", secret=""))
    assert b"protocol" not in bytes(frames[1]) and decode(frames).protocol == 0
    current = register(WorkerKind.ROLLOUT, "w", "")
    assert decode(encode(current)).protocol == PROTOCOL_VERSION
