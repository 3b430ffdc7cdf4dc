"""The controller shell's receive loop (controller.py) around its core: a registered
worker's Heartbeat is noted and decides nothing; anything else goes to the core. The core
here is a stand-in that records what it is asked; the core's own decisions are test_core.py's.
And how the shell sends what a decision wrote: in order, one message to several workers in a
row encoded once (a broadcast)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal.config import load_config
from areal.controller import Controller
from areal.controller.outbox import Outbox
from areal.messages import Cancel, Heartbeat, UpdateWeights, WorkerError


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


class _SendingChannel:
    """Records what the shell sends, one call at a time."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    async def send(self, identity: bytes, msg: Any) -> bool:
        self.calls.append(("send", identity, msg))
        return True

    async def broadcast(self, identities: list[bytes], msg: Any) -> None:
        self.calls.append(("broadcast", list(identities), msg))


def test_a_message_written_to_several_workers_in_a_row_is_broadcast_in_its_place(tmp_path):
    controller = Controller(load_config(overrides=[f"run_dir={tmp_path}"]))
    channel = _SendingChannel()
    controller._channel = channel  # type: ignore[assignment]
    update = UpdateWeights(version=3, mode="disk", path="weights/v3")
    cancel = Cancel(request_ids=["r1"])
    woken: list[str] = []
    wake = lambda: woken.append(f"after {len(channel.calls)} calls")  # noqa: E731
    out = Outbox()
    out.send(b"a", update)
    out.send(b"b", update)
    out.wake(wake)
    out.wake(wake)  # the same wake-up twice in a row: called twice
    out.send(b"c", cancel)
    out.send(b"d", update)  # the same message again, after another: sent on its own
    out.send(b"e", Cancel(request_ids=["r1"]))  # equal to `cancel`, another object
    asyncio.run(controller._send(out))
    assert channel.calls == [
        ("broadcast", [b"a", b"b"], update),
        ("send", b"c", cancel),
        ("send", b"d", update),
        ("send", b"e", cancel),
    ]
    assert woken == ["after 1 calls", "after 1 calls"]
    assert controller._sent_to == {b"a", b"b", b"c", b"d", b"e"}
