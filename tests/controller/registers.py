"""Registers as this release's workers send them, for the tests that register peers."""

from __future__ import annotations

from typing import Any

from areal.messages import PROTOCOL_VERSION, Register, WorkerKind


def register(
    kind: WorkerKind = WorkerKind.ROLLOUT, worker_id: str = "w", secret: str = "", **fields: Any
) -> Register:
    """A Register stating this release's PROTOCOL_VERSION (pid 1, host "h" unless `fields`
    say otherwise)."""
    return Register(
        kind=kind,
        worker_id=worker_id,
        secret=secret,
        **{"pid": 1, "host": "h", "protocol": PROTOCOL_VERSION, **fields},
    )
