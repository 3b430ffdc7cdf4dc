"""A broadcast 'something changed' signal for the controller's loops.

Loops wait for a predicate over controller state (`await changed.wait_for(pred)`); any
handler that changes state calls `notify()` (synchronous, so plain callbacks can use it).
Every waiter re-checks its own predicate, so no wake-up is ever lost and none is consumed
by another loop: the failure mode of sharing one `asyncio.Event` between loops.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class Changed:
    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until `predicate()` holds; False if `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not predicate():
            fut = loop.create_future()
            self._waiters.append(fut)
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            if remaining is None:  # the common case: no timer, no wrapper coroutine
                await fut
                continue
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                return predicate()
        return True
