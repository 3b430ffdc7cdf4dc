"""An asyncio event loop on a virtual clock: idle waits jump to the next timer at once.

Route (a) of docs/design.md section 9. `VirtualTimeLoop.time()` is a number this loop owns.
When nothing is ready to run, a real loop would sleep until its next timer; this one moves
its clock to that timer instead and goes on, so a simulated 40-hour run takes as long as its
callbacks take to execute. Everything that happens inside the loop is therefore
deterministic: the same program gives the same virtual timeline, whatever the machine's load.

That holds only if every event source lives in the loop: timers (`asyncio.sleep`,
`wait_for`), futures and queues. Real sockets would be polled without waiting (the loop
never blocks for them); threads are allowed and take no virtual time: a
`run_in_executor` / `asyncio.to_thread` call runs in its thread while the loop waits for it,
its clock standing still, and its caller continues as if the call were synchronous. The controller reads its clock through `areal.clock`,
which sees the `virtual_time` marker.

A simulation that stops making progress (a deadlock: no timer, no thread, nothing ready)
raises `SimulationStalled` instead of hanging, and so does one whose clock passes
`limit_s`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from typing import Any, TypeVar
from collections.abc import Callable, Coroutine

T = TypeVar("T")

_UNTRACKED_THREAD_WAIT_S = 10.0
"""Real seconds an idle loop with no timer waits for a wake-up before declaring a deadlock."""


class SimulationStalled(RuntimeError):
    """The simulated system can make no more progress, or ran past its time limit."""


class _VirtualSelector(selectors.DefaultSelector):
    """A real selector that never waits: an idle wait advances the loop's virtual clock."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self.loop
        assert loop is not None, "VirtualTimeLoop sets itself as its selector's loop"
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            # Only a thread the loop does not know of could still wake it (e.g. the one
            # asyncio starts to shut its executor down): give such a thread a moment.
            events = super().select(_UNTRACKED_THREAD_WAIT_S)
            if events:
                return events
            raise SimulationStalled(
                f"nothing is scheduled at virtual time {loop.time():.3f} s and no thread is "
                "running: the simulated system is deadlocked"
            )
        if loop.time() + timeout > loop.limit_s:
            raise SimulationStalled(
                f"the simulation passed its limit of {loop.limit_s:.0f} virtual seconds "
                f"(next event at {loop.time() + timeout:.1f} s); it is not making progress"
            )
        loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Event loop whose `time()` is virtual (see the module docstring)."""

    virtual_time = True
    """Marker read by `areal.clock.now()`."""

    def __init__(self, limit_s: float = float("inf")) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0
        self._clock_resolution = 1e-9
        self.limit_s = limit_s

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def run_in_executor(  # type: ignore[override]  # same call, a narrower annotation
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future:
        """`func` runs in a thread of `executor` (default: the loop's) and the loop waits
        for it before going on: the future it returns is already done. So a coroutine that
        awaits it continues at once, as if the call were synchronous, and what else the loop
        runs meanwhile does not depend on how long the thread takes in real time (the
        timeline stays a function of the seed). The work is still done by another thread:
        the CPU time of the loop's thread (sim/accounting.py) does not include it."""
        if executor is None:
            executor = getattr(self, "_default_executor", None)
            if executor is None:
                executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="asyncio")
                self.set_default_executor(executor)
        done = self.create_future()
        try:
            done.set_result(executor.submit(func, *args).result())
        except BaseException as err:  # the caller's await raises it, as from a thread
            done.set_exception(err)
        return done


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]], limit_s: float = float("inf")) -> T:
    """Run `main()` to completion on a fresh `VirtualTimeLoop`; returns its result."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(limit_s)) as runner:
        return runner.run(main())
