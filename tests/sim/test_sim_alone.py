"""The controller measured alone (sim/alone.py): its recorded messages replayed to a fresh
controller, which must do exactly what the simulated one did."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time

import msgpack
import numpy as np
import pytest

from areal.config import ConfigError
from areal.messages import MsgType
from areal.sim import alone as alone_mod
from areal.sim import run as run_mod
from areal.sim.accounting import CpuAccounts, as_worker
from areal.sim.config import sim_config
from areal.sim.loop import run_virtual
from areal.sim.run import simulate

from tests.sim.test_sim_run import SMALL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_replayed_controller_sends_every_message_the_simulated_one_sent(mode):
    settings = (
        dict(mode=mode, **SMALL)
        if mode == "async"
        else dict(mode=mode, placement="colocated", **dict(SMALL, num_accelerators=8))
    )
    seen = {}
    real_replay = run_mod.replay

    def replay(*args, **kwargs):
        recording = args[2]
        seen["received"], seen["sent"] = len(recording.arrivals), len(recording.sent_frames)
        result = real_replay(*args, **kwargs)
        seen["replayed"] = (result.num_received, result.num_sent)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_mod, "replay", replay)
        measured = simulate(sim_config(measure_alone=True, **settings))
    plain = simulate(sim_config(**settings))
    # every message in, every message out, each identical (else ReplayDiverged)
    assert seen["received"] > 100 and seen["replayed"] == (seen["received"], seen["sent"])
    assert measured.controller_alone_cpu_s_per_step > 0
    assert "recv" in measured.controller_alone_by_loop
    assert 0 < measured.controller_alone_share < 1
    assert measured.reference_alone_us > 0 and plain.reference_alone_us is None
    # recording changes nothing simulated
    for name in ("step_times", "trained_group_ids", "staleness", "interruptions"):
        assert getattr(measured, name) == getattr(plain, name), name
    assert plain.controller_alone_cpu_s_per_step is None and plain.controller_alone_share is None


def test_the_controller_sends_each_group_for_scoring_in_one_message():
    sent = []
    real_replay = run_mod.replay

    def replay(overrides, env, recording, *rest):
        sent.extend(recording.sent_frames)
        return real_replay(overrides, env, recording, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_mod, "replay", replay)
        result = simulate(sim_config(measure_alone=True, **SMALL))
    scores = [
        msgpack.unpackb(header)["request_ids"]
        for _, kind, header in sent
        if kind == bytes([MsgType.SCORE])
    ]
    groups = [{int(r.split("-")[0][1:]) for r in request_ids} for request_ids in scores]
    assert all(len(g) == 1 for g in groups)  # one group's samples in each
    score_of = {g.pop(): request_ids for g, request_ids in zip(groups, scores, strict=True)}
    assert len(score_of) == len(scores)  # each group once (no check failed here)
    trained = result.trained_group_ids
    assert len(trained) == SMALL["steps"] * SMALL["num_prompts"]
    assert all(len(score_of[g]) == SMALL["group_size"] for g in trained)  # all of each


def test_with_rollout_rewards_no_score_goes_out_and_the_replay_agrees():
    # reward.num_workers=0: the simulated rollout servers check their own completions; the
    # replayed controller must still send exactly what the simulated one sent.
    seen = {}
    real_replay = run_mod.replay

    def replay(overrides, env, recording, *rest):
        seen["kinds"] = {kind for _, kind, _ in recording.sent_frames}
        seen["overrides"] = overrides
        return real_replay(overrides, env, recording, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_mod, "replay", replay)
        result = simulate(sim_config(measure_alone=True, rollout_rewards=True, **SMALL))
    assert "reward.num_workers=0" in seen["overrides"]("run")
    assert bytes([MsgType.SCORE]) not in seen["kinds"]
    assert bytes([MsgType.GENERATE]) in seen["kinds"]
    assert len(result.trained_group_ids) == SMALL["steps"] * SMALL["num_prompts"]
    assert result.controller_alone_cpu_s_per_step > 0


def test_a_second_replay_without_the_intake_makes_the_same_decisions_and_is_measured(
    monkeypatch,
):
    # every Completions to the intake (its threshold lowered): the first replay's thread
    # reads the tokens; the second replay's loop reads them itself, and must still send
    # exactly what the simulated controller sent (a divergence raises ReplayDiverged)
    monkeypatch.setattr("areal.controller.checks.INTAKE_MIN_BYTES", 1)
    calls = []
    real_replay = run_mod.replay

    def replay(overrides, *rest):
        calls.append(overrides("run"))
        return real_replay(overrides, *rest)

    monkeypatch.setattr(run_mod, "replay", replay)
    result = simulate(sim_config(measure_alone=True, alone_without_intake=True, **SMALL))
    assert len(calls) == 2 and "controller.intake_thread=false" in calls[1]
    assert "controller.intake_thread=false" not in calls[0]
    assert result.controller_intake_cpu_s_per_step > 0  # in the simulation
    assert result.controller_alone_intake_cpu_s_per_step > 0  # and alone
    assert result.controller_alone_without_intake_cpu_s_per_step > 0


def test_a_second_replay_needs_the_first():
    with pytest.raises(ConfigError, match="alone_without_intake=true .* needs measure_alone"):
        sim_config(alone_without_intake=True)


def _tampered(tamper):
    """simulate() whose recording is altered by `tamper` before the replay."""
    real_replay = run_mod.replay

    def replay(overrides, env, recording, *rest):
        tamper(recording)
        return real_replay(overrides, env, recording, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_mod, "replay", replay)
        simulate(
            sim_config(mode="async", measure_alone=True, **dict(SMALL, steps=3, measure_from=1))
        )


def test_a_message_sent_otherwise_than_in_the_simulation_stops_the_replay():
    def tamper(recording):
        destination, kind, header = recording.sent_frames[40]
        recording.sent_frames[40] = (destination, kind, header + b"x")

    with pytest.raises(alone_mod.ReplayDiverged, match="message 40 the replayed controller sent"):
        _tampered(tamper)


def test_a_message_due_before_where_the_controller_already_is_stops_the_replay():
    def tamper(recording):
        recording.arrivals[100] = dataclasses.replace(recording.arrivals[100], steps=0)

    with pytest.raises(alone_mod.ReplayDiverged, match="message 100 .* came after 0 steps"):
        _tampered(tamper)


def test_measuring_alone_needs_the_wire():
    with pytest.raises(ConfigError, match="measure_alone=true .* needs wire=true"):
        sim_config(measure_alone=True, wire=False)


def test_the_accounts_count_the_controllers_steps_and_call_back_after_each():
    accounts = CpuAccounts()
    calls = []

    async def worker():
        for _ in range(5):
            await asyncio.sleep(1)

    async def controller():
        for _ in range(3):
            await asyncio.sleep(1)

    async def main():
        accounts.install(asyncio.get_running_loop())
        accounts.after_controller_step = lambda: calls.append(accounts.controller_steps)
        work = as_worker(asyncio.get_running_loop(), worker(), "w")
        await asyncio.create_task(controller())
        await work
        return list(calls), accounts.controller_steps

    # the controller task's 4 steps (start, 3 wake-ups); the worker's are not counted
    assert run_virtual(main) == ([1, 2, 3, 4], 4)


def test_a_recorded_frame_of_few_runs_is_kept_as_its_runs_and_handed_over_whole():
    import numpy as np

    from areal.sim.alone import _Runs, _compact, _expanded

    versions = np.repeat(np.array([3, 4, 6], np.int32), [2000, 1500, 700])
    frame = memoryview(versions).cast("B")
    kept = _compact(frame)
    assert type(kept) is _Runs and kept.values.tolist() == [3, 4, 6]
    (again,) = _expanded([kept])
    assert bytes(again) == bytes(frame)
    noisy = memoryview(np.arange(3000, dtype=np.int32)).cast("B")  # as many runs as values
    assert _compact(noisy) is noisy


def _arrivals(frames: list[list]) -> list:
    return [alone_mod.Arrival(0, 0.0, b"w", [b"t", b"h", *f]) for f in frames]


def test_frames_are_written_ahead_in_order_on_another_thread(monkeypatch):
    writers, write = [], alone_mod._expanded

    def expanded(frames):  # the writer's own, noting the thread it runs on
        writers.append(threading.get_ident())
        return write(frames)

    monkeypatch.setattr(alone_mod, "_expanded", expanded)
    runs = [alone_mod._Runs(np.array([i], np.int32), np.array([1024], np.int32)) for i in range(40)]
    writer = alone_mod._FrameWriter(_arrivals([[r] for r in runs]))
    try:
        deadline = time.monotonic() + 30
        while len(writers) < alone_mod._WRITTEN_AHEAD and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # it would have written more by now, were it not bounded
        assert len(writers) == alone_mod._WRITTEN_AHEAD
        for i in range(len(runs)):
            frames = writer.take(i)
            assert frames[:2] == [b"t", b"h"]
            assert bytes(frames[2]) == np.full(1024, i, np.int32).tobytes()
    finally:
        writer.stop()
    assert len(writers) == len(runs) and threading.get_ident() not in writers


def test_a_frame_that_cannot_be_written_fails_the_message_that_needs_it():
    bad = alone_mod._Runs(np.array([1, 2], np.int32), np.array([-1, 2], np.int32))
    writer = alone_mod._FrameWriter(_arrivals([[b"ok"], [bad], [b"never"]]))
    try:
        assert writer.take(0)[2] == b"ok"
        with pytest.raises(RuntimeError, match="writing message 1's frames failed") as err:
            writer.take(1)
        assert isinstance(err.value.__cause__, ValueError)  # numpy's, about the lengths
    finally:
        writer.stop()


def test_stopping_the_writer_ends_its_thread_while_it_waits_for_room():
    writer = alone_mod._FrameWriter(_arrivals([[b"x"]] * (alone_mod._WRITTEN_AHEAD + 5)))
    writer.stop()  # frames not taken are dropped
    assert not writer._thread.is_alive()


def test_a_view_of_a_shared_buffer_is_delivered_in_fresh_memory_each_time():
    # The simulated servers' token ids and log-probs are views of one zero buffer; replayed
    # as such, every message's arrays would be the same cached bytes, which no socket gives.
    import numpy as np

    from areal.sim.alone import _compact, _expanded

    shared = np.zeros(1 << 14, np.float32)
    view = memoryview(shared[:3000]).cast("B")
    kept = _compact(view)
    first, second = _expanded([kept, kept])
    assert bytes(first) == bytes(view) == bytes(second)
    addresses = {np.frombuffer(f, np.uint8).ctypes.data for f in (first, second, view)}
    assert len(addresses) == 3  # each its own memory, none the shared buffer


def _beats_after_other_messages(log: list[tuple[bytes, bool, float]], interval: float) -> int:
    """Heartbeats in `log` ((peer, is a Heartbeat, virtual time), in order, one direction)
    sent to or from a peer that had some other message in the round before: the
    `interval` up to it (open at both ends: a message at a round's own time may fall on
    either side of it)."""
    last_other: dict[bytes, float] = {}
    late = 0
    for peer, beat, at in log:
        if not beat:
            last_other[peer] = at
        elif at - interval < last_other.get(peer, -math.inf) < at:
            late += 1
    return late


def test_heartbeats_at_the_real_interval_are_replayed_and_each_side_skips_busy_rounds(
    monkeypatch,
):
    """At the run's real interval the controller pays for Heartbeats both ways (sent to all
    in one broadcast, replayed as such); neither side sends one to a peer it sent something
    else in the round before."""
    interval, beat = 1.0, MsgType.HEARTBEAT
    sent: list[tuple[bytes, bool, float]] = []
    real_sent = alone_mod.Recording.sent

    def note_sent(recording, identity, frames):
        sent.append((identity, frames[0][0] == beat, recording.clock()))
        real_sent(recording, identity, frames)

    seen = {}
    real_replay = run_mod.replay

    def replay(overrides, env, recording, *rest):
        seen["received"] = [
            (a.identity, bytes(a.frames[0])[0] == beat, a.time) for a in recording.arrivals
        ]
        return real_replay(overrides, env, recording, *rest)

    monkeypatch.setattr(alone_mod.Recording, "sent", note_sent)
    monkeypatch.setattr(run_mod, "replay", replay)
    result = simulate(sim_config(measure_alone=True, heartbeat_interval_s=interval, **SMALL))
    assert result.controller_alone_cpu_s_per_step > 0  # replayed, without divergence
    for log in (sent, seen["received"]):
        assert sum(b for _, b, _ in log) > 10  # idle rounds still send them
        assert sum(not b for _, b, _ in log) > 10
        assert _beats_after_other_messages(log, interval) == 0
