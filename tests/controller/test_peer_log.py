"""Refusals are written rate-limited per (peer, reason) and per reason, and counted."""

from __future__ import annotations

import logging

from areal.controller.peer_log import PeerLog, peer_name


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _log(clock: Clock, **kwargs) -> tuple[PeerLog, list[dict]]:
    records: list[dict] = []
    log = PeerLog(
        lambda event, **values: records.append({"event": event, **values}), clock=clock, **kwargs
    )
    return log, records


def test_one_peer_flooding_is_written_a_few_times_then_counted(caplog):
    clock = Clock()
    log, records = _log(clock, per_peer=3, per_reason=20, window_s=60)
    with caplog.at_level(logging.WARNING, logger="areal.controller"):
        written = [log.report("peer a", "malformed", f"message {i}") for i in range(20_000)]
        assert sum(written) == 3 and len(records) == 3 and len(caplog.records) == 3
        assert log.totals["malformed"] == 20_000
        clock.now = 59.0
        log.flush_if_due()  # the window is not over: nothing written
        clock.now = 61.0
        log.flush_if_due()
    assert records[-1] == {
        "event": "peer_refused_suppressed",
        "reason": "malformed",
        "count": 19_997,
        "num_peers": 1,
    }
    assert len(caplog.records) == 4
    assert (
        "suppressed 19997 more 'malformed' reports from 1 peers" in caplog.records[-1].getMessage()
    )
    assert log.report("peer a", "malformed", "again")  # a new window writes again


def test_many_peers_are_capped_per_reason_and_tracked_in_bounded_state():
    clock = Clock()
    log, records = _log(clock, per_peer=3, per_reason=20, window_s=60, max_peers=100)
    for i in range(5000):
        log.report(f"peer {i}", "registration refused", "wrong secret")
    log.report("peer x", "malformed", "bad")  # another reason has its own budget
    assert [r["reason"] for r in records].count("registration refused") == 20
    assert records[-1]["reason"] == "malformed"
    assert len(log._suppressed_peers["registration refused"]) == 100
    log.flush()
    summary = records[-1]
    assert summary["count"] == 4980 and summary["num_peers"] == 100


def test_unregistered_peers_are_named_by_a_hash_never_their_identity():
    identity = b"rollout-0/" + b"f" * 32
    name = peer_name(identity)
    assert name.startswith("peer ") and "rollout" not in name and name == peer_name(identity)
    assert name != peer_name(b"rollout-1/" + b"f" * 32)
