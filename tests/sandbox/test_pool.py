"""CheckerPool: bounded parallelism, visible counts, and timeouts/crashes as reward 0 with
the reason, for plain, coroutine and real (sandbox, math) checkers."""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time

import pytest

from areal.sandbox.code_reward import code_reward_async
from areal.sandbox.math_reward import MathVerifier, math_reward
from areal.sandbox.pool import CheckerPool
from areal.tasks.base import RewardOutcome, Verdict


class Gauge:
    """Counts concurrent entries and remembers the peak."""

    def __init__(self):
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def check(self, seconds: float, reward: float) -> RewardOutcome:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
        return RewardOutcome(reward=reward, verdict=Verdict.OK)


async def test_parallelism_is_bounded_and_counts_are_visible():
    pool = CheckerPool(max_concurrency=3, timeout_s=5.0)
    gauge = Gauge()
    tasks = [asyncio.create_task(pool.check(gauge.check, 0.3, float(i))) for i in range(10)]
    await asyncio.sleep(0.05)
    assert pool.counts()["in_flight"] == 3 and pool.counts()["queued"] == 7
    outcomes = await asyncio.gather(*tasks)
    assert [o.reward for o in outcomes] == [float(i) for i in range(10)]
    assert gauge.peak == 3
    assert pool.counts() == {
        "in_flight": 0,
        "queued": 0,
        "completed": 10,
        "errors": 0,
        "timeouts": 0,
        "abandoned": 0,
    }
    assert pool.metrics()["reward/completed"] == 10.0 and pool.metrics()["reward/check_s_mean"] > 0
    pool.close()


async def test_timeout_gives_reward_zero_and_keeps_the_slot_until_the_thread_ends():
    pool = CheckerPool(max_concurrency=1, timeout_s=0.2)
    gauge = Gauge()
    outcome = await pool.check(gauge.check, 1.0, 1.0)
    assert (outcome.reward, outcome.verdict) == (0.0, Verdict.TIMEOUT)
    assert "exceeded 0.2 s" in outcome.detail and "Gauge.check" in outcome.detail
    assert pool.counts()["abandoned"] == 1 and pool.in_flight == 1
    started = time.monotonic()
    follow_up = await pool.check(gauge.check, 0.0, 1.0, timeout_s=5.0)
    assert (
        follow_up.verdict is Verdict.OK and time.monotonic() - started > 0.5
    )  # waited for the slot
    assert gauge.peak == 1 and pool.counts()["abandoned"] == 0 and pool.counts()["timeouts"] == 1


async def test_crashing_checks_give_reward_zero_with_the_error_and_the_pool_goes_on():
    pool = CheckerPool(max_concurrency=2, timeout_s=5.0)

    def broken(completion, reference):
        raise KeyError(f"no reference field {reference!r}")

    def exits(completion, reference):
        sys.exit(3)

    crash = await pool.check(broken, "text", "answer")
    assert (crash.reward, crash.verdict) == (0.0, Verdict.ERROR)
    assert "raised KeyError" in crash.detail and "answer" in crash.detail
    assert (await pool.check(exits, "t", "r")).verdict is Verdict.ERROR
    assert (await pool.check(lambda c, r: "nonsense", "t", "r")).verdict is Verdict.ERROR
    assert (await pool.check(lambda c, r: 0.5, "t", "r")) == RewardOutcome(
        reward=0.5, verdict=Verdict.OK
    )
    assert pool.counts()["errors"] == 3 and pool.counts()["completed"] == 4


async def test_coroutine_check_is_cancelled_at_its_timeout():
    pool = CheckerPool(max_concurrency=1, timeout_s=0.1)
    cancelled = asyncio.Event()

    async def hangs(completion, reference):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    outcome = await pool.check(functools.partial(hangs, "t"), "r")
    assert outcome.verdict is Verdict.TIMEOUT
    await asyncio.wait_for(cancelled.wait(), 1.0)
    assert (await pool.check(Gauge().check, 0.0, 1.0)).verdict is Verdict.OK  # slot came back


async def test_cancelling_the_caller_frees_the_slot():
    pool = CheckerPool(max_concurrency=1, timeout_s=5.0)
    waiting = asyncio.create_task(pool.check(Gauge().check, 0.3, 1.0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    outcome = await pool.check(Gauge().check, 0.0, 1.0)
    assert outcome.verdict is Verdict.OK and pool.counts()["in_flight"] == 0


@pytest.mark.slow
async def test_real_checkers_time_out_into_verdicts(sandbox):
    pool = CheckerPool(max_concurrency=4, timeout_s=1.0)
    endless = "```python\nwhile True:\n    pass\n```"
    reference = {"tests": [{"input": "", "output": "1"}], "time_limit_s": 2.5}
    verifier = MathVerifier(num_workers=1)
    try:
        code, math_ok, math_slow = await asyncio.gather(
            pool.check(
                lambda c, r: asyncio.run(code_reward_async(c, r, sandbox=sandbox)),
                endless,
                reference,
            ),
            pool.check(
                lambda c, r: math_reward(c, r, verifier=verifier),
                "\\boxed{\\frac{1}{2}}",
                "0.5",
                timeout_s=120,
            ),
            pool.check(
                lambda c, r: math_reward(c, r, timeout_s=0.5, verifier=verifier),
                "\\boxed{9^{9^{9^{9}}}}",
                "1",
                timeout_s=120,
            ),
        )
    finally:
        verifier.close()
    assert code.verdict is Verdict.TIMEOUT and code.reward == 0.0
    assert math_ok.verdict is Verdict.OK
    assert math_slow.verdict is Verdict.TIMEOUT and "math-verify took longer" in math_slow.detail
    while pool.in_flight:  # the sandboxed loop ends at its own 2.5 s limit and frees its slot
        await asyncio.sleep(0.05)
    assert pool.counts()["abandoned"] == 0
