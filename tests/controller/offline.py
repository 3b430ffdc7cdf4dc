"""A `Controller` wired for unit tests of its handlers: its own ledger, pool and state, with
a channel that records what it would send instead of a socket, and no worker processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from areal.config import RunConfig
from areal.controller.controller import Controller
from areal.controller.pool import WorkerPool


class RecordingChannel:
    address = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    async def send(self, identity: bytes, msg: object) -> bool:
        self.sent.append((identity, msg))
        return True


def offline_controller(cfg: RunConfig, run_dir: Path) -> Controller:
    """The controller of `cfg` as `run` leaves it before its loops start (set-up, channel,
    pool); the caller adds workers to `ctl.pool.by_identity` and whatever else it needs."""
    ctl = Controller(cfg)
    ctl._setup = SimpleNamespace(run_dir=run_dir)
    ctl.channel = RecordingChannel()
    ctl.pool = WorkerPool(cfg, run_dir, ctl.channel.address, secret=None)
    return ctl
