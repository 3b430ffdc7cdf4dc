"""The controller shell's receive loop (controller.py) around its core: a registered
worker's Heartbeat is noted and decides nothing; anything else goes to the core. The core
here is a stand-in that records what it is asked; the core's own decisions are test_core.py's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal.config import load_config
from areal.controller import Controller
from areal.controller.outbox import Outbox
from areal.messages import Heartbeat, WorkerError


class _Core:
    """Records what the receive loop asks of it; knows one worker, b"known"."""

    def __init__(self) -> None:
        self.heard_from: list[bytes] = []
        self.decided: list[tuple[bytes, Any]] = []

    def heard(self, identity: bytes, now: float) -> bool:
        self.heard_from.append(identity)
        return identity == b"known"

    def probe(self, identity: bytes, msg: Any) -> list:
        return []

    def on_message(self, identity: bytes, msg: Any, now: float, members: Any) -> Outbox:
        self.decided.append((identity, msg))
        return Outbox()


class _Channel:
    """The given messages in order, then the end of the test."""

    def __init__(self, messages: list[tuple[bytes, Any]]) -> None:
        self.messages = messages

    async def recv(self) -> tuple[bytes, Any]:
        if not self.messages:
            raise asyncio.CancelledError
        return self.messages.pop(0)


def test_a_known_worker_s_heartbeat_is_noted_without_a_decision_or_a_wake_up(tmp_path):
    controller = Controller(load_config(overrides=[f"run_dir={tmp_path}"]))
    notified = []
    controller.changed.notify = lambda: notified.append(True)  # type: ignore[method-assign]
    core = _Core()
    error = WorkerError(error="x")
    channel = _Channel([(b"known", Heartbeat()), (b"stranger", Heartbeat()), (b"known", error)])
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(controller._receive(core, channel))  # type: ignore[arg-type]
    assert core.heard_from == [b"known", b"stranger"]
    # the stranger's goes to the core (which refuses it), as does every other message
    assert core.decided == [(b"stranger", Heartbeat()), (b"known", error)]
    assert len(notified) == 2
