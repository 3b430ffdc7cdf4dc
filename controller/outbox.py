"""What a decision of the controller asks for: messages to send and loops to wake, in order;
workers to restart; failed training steps to diagnose.

Every decision of the controller (what to do on a message, on a tick of the liveness loop,
when a batch is taken or a version published) is synchronous code that changes the state
of the component that owns it and writes what must follow into an `Outbox`. The async shell
(controller.py) then carries it out: the messages sent and the wake-ups called in the order
they were written, then the restarts. So a decision is tested by calling it and reading its
outbox: no channel, no process.

Wake-ups (a loop's signal notified, a waiting step's result delivered) are written in order
with the messages rather than called at once, because their order is observable: a loop
woken before a message is sent runs before the worker that receives it.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from areal.controller.pool import WorkerHandle

Item = tuple[bytes, Any] | Callable[[], Any]


class Outbox:
    """`items`: (identity, message) to send and wake-ups (callables) to call, in order;
    `restarts`: (handle, why) of workers whose loss was decided: their work is already
    re-queued, their process is the shell's to stop and start again; `step_failures`:
    (handle, error) of trainer ranks that reported a failed step: which rank to blame takes
    waiting (trainers.py)."""

    __slots__ = ("items", "restarts", "step_failures")

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.restarts: list[tuple[WorkerHandle, str]] = []
        self.step_failures: list[tuple[WorkerHandle, str]] = []

    def send(self, identity: bytes, msg: Any) -> None:
        self.items.append((identity, msg))

    def wake(self, wake_up: Callable[[], Any]) -> None:
        """Call `wake_up` once the messages written before it are sent."""
        self.items.append(wake_up)

    def restart(self, handle: WorkerHandle, why: str) -> None:
        self.restarts.append((handle, why))

    def __bool__(self) -> bool:
        return bool(self.items or self.restarts or self.step_failures)

    @property
    def messages(self) -> list[tuple[bytes, Any]]:
        """The (identity, message) pairs, in order, without the wake-ups."""
        return [item for item in self.items if isinstance(item, tuple)]

    def sent(self, kind: type | None = None) -> list[Any]:
        """The messages (of `kind` only, if given), without destinations: for tests and
        inspection."""
        return [msg for _, msg in self.messages if kind is None or isinstance(msg, kind)]
