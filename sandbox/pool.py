"""`CheckerPool`: the reward worker's concurrency core. Runs reward checks with bounded
parallelism from an event loop and turns every failure into data.

    pool = CheckerPool(max_concurrency=8, timeout_s=10.0)
    outcome = await pool.check(task.reward, completion, reference)   # never raises*
    pool.counts()   # {'in_flight': .., 'queued': .., 'completed': .., 'errors': .., ...}

A check is a plain function (run in one of `max_concurrency` threads: reward functions block
on the sandbox or on math workers, which release the GIL) or a coroutine function (run on the
loop, e.g. `code_reward_async`). Over `timeout_s` the caller gets reward 0 with verdict
TIMEOUT; an exception (or `sys.exit`) in the check gives reward 0 with verdict ERROR and the
exception in `detail`. The trajectory always gets an outcome. (*Cancelling the awaiting task
itself still cancels it, as it should.)

A thread cannot be killed: a timed-out plain check keeps its slot until it really returns
(`abandoned` counts them), so a stuck checker shows up as lost capacity and growing `queued`
instead of as unbounded threads. The checks in this package all end on their own (sandbox
and math-verify timeouts are enforced by killing processes). A coroutine check is cancelled
at its timeout and frees its slot at once.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from areal.tasks.base import RewardOutcome, Verdict


@dataclass
class _Counts:
    queued: int = 0
    in_flight: int = 0
    completed: int = 0
    errors: int = 0
    timeouts: int = 0
    abandoned: int = 0
    check_s_total: float = 0.0


class CheckerPool:
    def __init__(self, *, max_concurrency: int = 8, timeout_s: float = 10.0) -> None:
        if max_concurrency < 1:
            raise ValueError(f"CheckerPool max_concurrency={max_concurrency} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"CheckerPool timeout_s={timeout_s} must be > 0 seconds")
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="reward-check")
        self._counts = _Counts()

    @property
    def in_flight(self) -> int:
        """Checks running now (including timed-out threads still running)."""
        return self._counts.in_flight + self._counts.abandoned

    @property
    def queued(self) -> int:
        """Checks waiting for a free slot."""
        return self._counts.queued

    def counts(self) -> dict[str, int]:
        c = self._counts
        return {
            "in_flight": self.in_flight,
            "queued": c.queued,
            "completed": c.completed,
            "errors": c.errors,
            "timeouts": c.timeouts,
            "abandoned": c.abandoned,
        }

    def metrics(self) -> dict[str, float]:
        """Counts under `reward/`, plus the mean seconds a finished check took."""
        c = self._counts
        mean = c.check_s_total / c.completed if c.completed else 0.0
        return {
            **{f"reward/{k}": float(v) for k, v in self.counts().items()},
            "reward/check_s_mean": mean,
        }

    async def check(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> RewardOutcome:
        """Run `fn(*args)` under the concurrency bound and the time limit."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        self._counts.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._counts.queued -= 1
        self._counts.in_flight += 1
        started = time.monotonic()
        work: asyncio.Future | None = None
        try:
            work = self._start(fn, args)
            outcome = await self._outcome(work, limit, fn)
        finally:
            self._counts.in_flight -= 1
            self._free_slot_when_done(work)
        self._counts.completed += 1
        self._counts.check_s_total += time.monotonic() - started
        if outcome.verdict is Verdict.ERROR:
            self._counts.errors += 1
        elif outcome.verdict is Verdict.TIMEOUT:
            self._counts.timeouts += 1
        return outcome

    def _start(self, fn: Callable[..., Any], args: tuple) -> asyncio.Future:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "func", None)
        ):
            # (the second test sees through functools.partial, which 3.11 does not)
            return asyncio.ensure_future(fn(*args))
        return asyncio.wrap_future(self._executor.submit(fn, *args))

    async def _outcome(
        self, work: asyncio.Future, limit: float, fn: Callable[..., Any]
    ) -> RewardOutcome:
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            value = await asyncio.wait_for(asyncio.shield(work), limit)
        except TimeoutError:
            return RewardOutcome(
                reward=0.0,
                verdict=Verdict.TIMEOUT,
                detail=f"reward check {name} exceeded {limit:g} s",
            )
        except (Exception, SystemExit) as exc:  # fault boundary: a broken checker is data
            return RewardOutcome(
                reward=0.0,
                verdict=Verdict.ERROR,
                detail=f"reward check {name} raised {type(exc).__name__}: {exc}"[:2000],
            )
        return _as_outcome(value, name)

    def _free_slot_when_done(self, work: asyncio.Future | None) -> None:
        if work is None or work.done():
            self._slots.release()
            return
        if isinstance(work, asyncio.Task):
            work.cancel()
            work.add_done_callback(lambda _: self._slots.release())
            return
        self._counts.abandoned += 1

        def finished(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: a late failure of an abandoned check is not news
            self._counts.abandoned -= 1
            self._slots.release()

        work.add_done_callback(finished)

    def close(self) -> None:
        """Stop accepting work; queued thread checks are dropped, running ones finish."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _as_outcome(value: Any, name: str) -> RewardOutcome:
    if isinstance(value, RewardOutcome):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return RewardOutcome(
            reward=float(value), verdict=Verdict.OK if value > 0 else Verdict.WRONG
        )
    return RewardOutcome(
        reward=0.0,
        verdict=Verdict.ERROR,
        detail=f"reward check {name} returned {type(value).__name__}, not RewardOutcome",
    )
