"""The controller shell's liveness loop (controller.py) on a virtual clock: its round is one
second whatever the Heartbeat interval, so exited processes are found and failed weight
loads retried within a second; Heartbeats go out, and silence is looked for, once an
interval. The core here is a stand-in that records what it is asked."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from areal import clock
from areal.config import load_config
from areal.controller import Controller
from areal.sim.loop import run_virtual


class _Pool:
    def __init__(self, exits_at: float) -> None:
        self.exits_at = exits_at
        self.calls: list[tuple[float, bool]] = []
        self.worker = SimpleNamespace(process=SimpleNamespace(poll=lambda: 9))

    def lost(self, timeout_s: float, silent: bool = True) -> list[Any]:
        self.calls.append((clock.now(), silent))
        return [self.worker] if clock.now() >= self.exits_at else []


class _Weights:
    def __init__(self) -> None:
        self.retried: list[float] = []

    def retry(self, out: Any) -> list:
        self.retried.append(clock.now())
        return []

    def tick(self, members: list, out: Any) -> None:
        pass

    def tick_candidates(self) -> list:
        return []


class _Core:
    def __init__(self, pool: _Pool) -> None:
        self.pool, self.weights = pool, _Weights()
        self.peer_log = SimpleNamespace(flush_if_due=lambda: None)

    def heartbeat_targets(self, sent_to: Any) -> list[bytes]:
        return [b"w"]


class _Channel:
    def __init__(self) -> None:
        self.beats: list[float] = []

    async def broadcast(self, identities: list[bytes], msg: Any) -> None:
        self.beats.append(clock.now())

    async def send(self, identity: bytes, msg: Any) -> bool:
        raise AssertionError("nothing failed: nothing to send")


def _liveness(tmp_path, interval_s: float, until_s: float, exits_at: float):
    controller = Controller(
        load_config(
            overrides=[f"run_dir={tmp_path}", f"controller.heartbeat_interval_s={interval_s}"]
        )
    )
    pool = _Pool(exits_at)
    core, channel = _Core(pool), _Channel()
    controller._channel = channel
    lost: list[tuple[float, str]] = []

    async def lose(handle: Any, why: str) -> None:
        lost.append((clock.now(), why))
        pool.exits_at = float("inf")  # restarted

    controller._lose = lose  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.create_task(controller._liveness(core))  # type: ignore[arg-type]
        await asyncio.sleep(until_s)
        assert not task.done(), task.exception()
        task.cancel()

    run_virtual(main)
    return channel.beats, pool.calls, core.weights.retried, lost


def test_beyond_a_second_the_interval_paces_heartbeats_and_silence_only(tmp_path):
    beats, calls, retried, lost = _liveness(tmp_path, 10.0, 25.5, exits_at=3.5)
    assert beats == [10.0, 20.0]
    assert [t for t, silent in calls if silent] == [10.0, 20.0]
    assert sorted({t for t, _ in calls}) == [float(t) for t in range(1, 26)]  # every round
    assert retried == [float(t) for t in range(1, 26)]  # weight loads retried every second
    assert lost == [(4.0, "process exited")]  # found at the first round after it exited


def test_an_interval_of_a_second_or_less_is_the_round(tmp_path):
    beats, calls, retried, _ = _liveness(tmp_path, 0.5, 2.25, exits_at=float("inf"))
    assert beats == [0.5, 1.0, 1.5, 2.0] == retried
    assert all(silent for _, silent in calls)


def test_an_interval_not_a_whole_number_of_rounds_beats_a_little_sooner(tmp_path):
    beats, _, _, _ = _liveness(tmp_path, 2.5, 9.5, exits_at=float("inf"))
    assert beats == [2.0, 4.0, 6.0, 8.0]  # never later than the interval
