"""A broadcast 'something changed' signal for the controller's loops.

Loops wait for a predicate over controller state (`await changed.wait_for(pred)`); any
handler that changes state calls `notify()` (synchronous, so plain callbacks can use it).
Every waiter re-checks its own predicate, so no wake-up is ever lost and none is consumed
by another loop: the failure mode of sharing one `asyncio.Event` between loops.

A waiter may ask for its predicate to be checked by `notify` itself (`at_notify=True`): it
is woken only when the predicate holds there (or raises: the error surfaces in the waiter).
For a loop that waits on a condition most notifications leave false (admission, on the
staleness bound, while every message notifies, tens of thousands a step at scale; the
train driver, on a full batch; dispatch, whose work the receive loop does itself after
each message), that saves waking a task to find nothing to do. The predicate must then read only state
whose every change is followed by a `notify` (the contract above).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Changed:
    def __init__(self) -> None:
        self._waiters: list[tuple[asyncio.Future, Callable[[], bool] | None]] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut, predicate in waiters:
            if fut.done():
                continue
            if predicate is not None and not _holds_or_raises(predicate):
                self._waiters.append((fut, predicate))  # still false: not woken
                continue
            fut.set_result(None)

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float | None = None,
        *,
        at_notify: bool = False,
    ) -> bool:
        """Wait until `predicate()` holds; False if `timeout` seconds passed first.
        `at_notify`: `notify` checks the predicate and wakes this waiter only if it holds."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not predicate():
            fut = loop.create_future()
            self._waiters.append((fut, predicate if at_notify else None))
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            if remaining is None:  # the common case: no timer, no wrapper coroutine
                await fut
                continue
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                return predicate()
        return True


def _holds_or_raises(predicate: Callable[[], bool]) -> bool:
    try:
        return bool(predicate())
    except Exception:  # the waiter checks it again, and gets the error in its own task
        return True
