"""The virtual clock (sim/loop.py) and the controller's one clock (areal/clock.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal import clock
from areal.sim.loop import SimulationStalled, run_virtual


def test_a_simulated_day_takes_no_real_time():
    async def main() -> tuple[float, float]:
        start = clock.now()
        await asyncio.sleep(24 * 3600)
        return start, clock.now()

    wall = time.perf_counter()
    start, end = run_virtual(main)
    assert (start, end) == (0.0, 24 * 3600.0)
    assert time.perf_counter() - wall < 5  # a day of virtual time, not of real time


def test_timers_fire_in_virtual_order_the_same_way_every_time():
    async def main() -> list[tuple[str, float]]:
        order: list[tuple[str, float]] = []

        async def worker(name: str, delays: list[float]) -> None:
            for delay in delays:
                await asyncio.sleep(delay)
                order.append((name, asyncio.get_running_loop().time()))

        await asyncio.gather(
            worker("a", [1.5, 2.0, 0.25]),
            worker("b", [0.5, 3.5]),
            asyncio.wait_for(worker("c", [10.0]), timeout=7.0),
            return_exceptions=True,
        )
        return order

    first = run_virtual(main)
    assert first == [("b", 0.5), ("a", 1.5), ("a", 3.5), ("a", 3.75), ("b", 4.0)]
    assert run_virtual(main) == first


def test_clock_is_real_time_outside_a_virtual_loop():
    before = time.monotonic()
    assert before <= clock.now() <= time.monotonic()

    async def main() -> float:
        return clock.now()

    assert before <= asyncio.run(main()) <= time.monotonic()


def test_threads_take_no_virtual_time():
    async def main() -> float:
        await asyncio.to_thread(time.sleep, 0.05)
        return asyncio.get_running_loop().time()

    assert run_virtual(main) == 0.0


def test_a_deadlock_raises_instead_of_hanging(monkeypatch):
    monkeypatch.setattr("areal.sim.loop._UNTRACKED_THREAD_WAIT_S", 0.01)

    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever set it

    with pytest.raises(SimulationStalled, match="deadlocked"):
        run_virtual(main)


def test_a_run_past_its_virtual_limit_raises():
    async def main() -> None:
        await asyncio.sleep(100.0)

    with pytest.raises(SimulationStalled, match="limit of 50 virtual seconds"):
        run_virtual(main, limit_s=50.0)


def test_shared_cores_slow_work_only_while_the_other_kind_runs():
    from areal.messages import WorkerKind
    from areal.sim.workers import Host

    async def main() -> tuple[float, float]:
        host = Host(contention=2.0)
        train = asyncio.create_task(host.work(WorkerKind.TRAINER, 3.0))
        await asyncio.sleep(1.0)  # 1 s alone: 1 s of training done
        await host.work(WorkerKind.ROLLOUT, 1.0)  # 2 s together, at half speed each
        generated_at = asyncio.get_running_loop().time()
        await train  # 2 - 1 = 1 s of training left, alone again
        return generated_at, asyncio.get_running_loop().time()

    assert run_virtual(main) == (pytest.approx(3.0), pytest.approx(4.0))


def test_more_busy_threads_than_cores_share_the_cores():
    from areal.messages import WorkerKind
    from areal.sim.workers import Host

    async def main() -> list[float]:
        host = Host(contention=1.0, cores=2)
        loop = asyncio.get_running_loop()
        # three one-thread workers on two cores: each at 2/3 of its speed while all run
        done = []

        async def work(kind: WorkerKind, seconds: float) -> None:
            await host.work(kind, seconds)
            done.append(loop.time())

        await asyncio.gather(
            work(WorkerKind.TRAINER, 2.0),
            work(WorkerKind.ROLLOUT, 2.0),
            work(WorkerKind.ROLLOUT, 1.0),
        )
        return done

    # 1 s of work at 2/3 speed: 1.5 s; then two threads on two cores: 1 s left each
    assert run_virtual(main) == [pytest.approx(1.5), pytest.approx(2.5), pytest.approx(2.5)]
