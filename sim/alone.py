"""The controller's CPU cost measured alone: a simulation's inbound messages, replayed.

In a simulation the controller shares one thread, and so one core and its caches, with the
whole simulated cluster: between two of its messages, the tasks of hundreds of simulated
servers run and push its data out of the CPU's caches, so each message costs it more than
it would cost a controller on a core of its own, which a real deployment gives it (decoding
a message whose data has left the caches takes several times as long as in a tight loop).

So the controller can also be measured alone (`measure_alone`; bench/cluster.py's table
(r)). The simulation records what its controller
received (`Recording`): each message's frames, the virtual time it arrived and how many
steps the controller's own tasks had taken by then (sim/accounting.py counts them). `replay`
then runs a fresh controller of the same configuration with no simulated worker, on the
same virtual clock, and hands it each message at the same virtual time after the same
number of its own steps. The controller's decisions depend on nothing else (its inputs are
these messages and its clock), so it does the same work in the same order. That is checked,
not assumed: every message it sends (kind, destination, header bytes) must equal the
recorded run's, and a message that would arrive after more of the controller's steps than it
did in the simulation stops the replay (`ReplayDiverged`). Welcome is compared by kind and
destination only: its header carries the run directory, which is another one.

Recording keeps the received frames themselves, a reference each, except buffers of
int32-sized values in few runs (per-token versions, and the simulated servers' token ids
and log-probs, views of one shared zero buffer), which are kept as their runs and written
out again, in fresh memory, before they are delivered: as a socket delivers every frame in
memory of its own. They are written by a thread of the replay's own (`_FrameWriter`), a few
messages ahead of the one delivered, as a socket's I/O thread writes what it receives on
another core: the controller then reads frames another core wrote, as a real one does,
and its caches do not pay for the writing. (In the simulation itself the controller reads
those ids and log-probs from the shared buffer, which stays in the caches: its
in-simulation cost leaves out what a real controller pays to read them.) The arrays of
every completion stay in memory until the replay (a recorded simulation's peak memory is
somewhat higher than an unrecorded one's).
The garbage collector would have their objects to walk in every full collection the
replayed controller triggers, a cost a real controller does not have: `replay` freezes them
(and everything else alive before it, `gc.freeze`) first.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Coroutine, Iterable

import numpy as np

from areal.config import load_config
from areal.controller import Controller
from areal.controller.runtime import Connection
from areal.codec import encode
from areal.messages import MsgType, version_runs

from areal.sim.accounting import CpuAccounts
from areal.sim.channel import SimRouter
from areal.sim.loop import run_virtual
from areal.sim.runtime import SimPool, SimRuntime
from areal.sim.workers import SimEnv

_WELCOME = bytes([MsgType.WELCOME])


class ReplayDiverged(RuntimeError):
    """The replayed controller did not do what the simulated one did."""


@dataclass(frozen=True, slots=True)  # no __dict__: one object fewer for the collector
class Arrival:
    steps: int
    """The controller's steps taken before the message arrived."""
    time: float
    identity: bytes
    frames: list[Any]
    """As received: type byte, header, array frames (a frame of few runs kept as its runs,
    `_Runs`, rebuilt when it is handed over)."""


@dataclass(frozen=True, slots=True)
class _Runs:
    """A frame of int32-sized values in few runs of equal values, as (values, lengths): a
    completion's per-token versions (a handful of versions over thousands of tokens), the
    simulated zero token ids and log-probs. Kept as they arrived, a 7-step simulation at
    2,048 accelerators recorded about 6 GB of versions alone."""

    values: np.ndarray
    lengths: np.ndarray

    def frame(self) -> memoryview:
        if len(self.values) == 1:  # fill, unlike repeat, lets other threads run meanwhile
            out = np.empty(int(self.lengths[0]), np.int32)
            out.fill(self.values[0])
            return out.data.cast("B")
        return np.repeat(self.values, self.lengths).data.cast("B")


_RUNS_MIN_BYTES = 4096
"""Smaller frames are kept as they are (their runs would save little)."""


def _compact(frame: Any) -> Any:
    """`frame`, or its runs when it is a buffer of int32-sized values with far fewer runs
    than values. Views of the simulated servers' shared zero buffers (their token ids and
    log-probs) are compacted too, to one run each: replayed as they are, every message's
    ids and log-probs would be the same few cached bytes, where a socket delivers each
    frame in memory of its own (`_Runs.frame` writes it out again at delivery)."""
    if type(frame) is not memoryview or frame.nbytes < _RUNS_MIN_BYTES or frame.nbytes % 4:
        return frame
    values = np.frombuffer(frame, np.int32)
    run_values, run_lengths = version_runs(values)
    if (len(run_values) - 1) * 16 > len(values):  # kept as it is: its value changes often
        return frame
    return _Runs(run_values, run_lengths)


def _expanded(frames: list[Any]) -> list[Any]:
    return [f.frame() if type(f) is _Runs else f for f in frames]


_WRITTEN_AHEAD = 16
"""Messages whose frames `_FrameWriter` writes before the one delivered: at 2,048
accelerators about 13 MB of token ids and log-probs, more than a core's own caches hold
(2 MB of L2 a core on the machine this was measured on), so that what the controller reads
was written by the other core."""


class _FrameWriter:
    """Writes the recorded messages' frames out (`_expanded`), in order, up to
    `_WRITTEN_AHEAD` messages before the one taken, on a thread of its own (see the module
    docstring). `take(i)` waits for message i's frames; an error of the thread is raised
    there."""

    def __init__(self, arrivals: list[Arrival]) -> None:
        self._arrivals = arrivals
        self._written: dict[int, list[Any]] = {}
        self._taken = 0
        self._stopped = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._write, name="replay-frames", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            for i, arrival in enumerate(self._arrivals):
                with self._changed:
                    self._changed.wait_for(
                        lambda: self._stopped or i < self._taken + _WRITTEN_AHEAD  # noqa: B023
                    )
                    if self._stopped:
                        return
                frames = _expanded(arrival.frames)
                with self._changed:
                    self._written[i] = frames
                    self._changed.notify_all()
        except BaseException as err:  # handed to the replay, which waits in `take`
            with self._changed:
                self._error = err
                self._changed.notify_all()

    def take(self, i: int) -> list[Any]:
        """Message i's frames, written (messages are taken in order)."""
        with self._changed:
            self._changed.wait_for(lambda: i in self._written or self._error is not None)
            if i not in self._written:
                raise RuntimeError(f"writing message {i}'s frames failed") from self._error
            self._taken = i + 1
            self._changed.notify_all()
            return self._written.pop(i)

    def stop(self) -> None:
        """Ends the thread (frames not taken are dropped)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._thread.join()


@dataclass
class Recording:
    """What a simulated controller received and sent (SimRouter's `recorder`)."""

    accounts: CpuAccounts
    clock: Callable[[], float]
    arrivals: list[Arrival] = field(default_factory=list)
    sent_frames: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)
    """(destination, type byte, header) of each message the controller sent, in order."""

    def received(self, identity: bytes, frames: list[Any]) -> None:
        self.arrivals.append(
            Arrival(
                self.accounts.controller_steps,
                self.clock(),
                identity,
                [*frames[:2], *map(_compact, frames[2:])],
            )
        )

    def sent(self, identity: bytes, frames: list[Any]) -> None:
        self.sent_frames.append(_sent_key(identity, frames))


def _sent_key(identity: bytes, frames: list[Any]) -> tuple[bytes, bytes, bytes]:
    kind = bytes(frames[0])
    return identity, kind, b"" if kind == _WELCOME else bytes(frames[1])


@dataclass(frozen=True)
class Alone:
    """The replayed controller's marks (run.Mark) at the start and at each step record."""

    marks: list[Any]
    num_received: int
    num_sent: int
    intake_cpu_s: list[float]
    """Each step record's perf/intake_cpu_s: the intake thread's CPU seconds (beside the
    loop's, not in the marks)."""
    pack_cpu_s: list[float]
    """Each step record's perf/pack_cpu_s: the CPU seconds of the thread that packs the
    Train messages and frees the previous step's batch (beside the loop's, not in the
    marks)."""


class _ReplayRouter(SimRouter):
    """Encodes what the controller sends (its cost, as on a socket), compares it with the
    recording, delivers nothing; receives the recorded messages from `_Feeder`. Holds the
    replay's first divergence, after which nothing more is compared or fed."""

    def __init__(self, expected: list[tuple[bytes, bytes, bytes]]) -> None:
        super().__init__(wire=True)
        self.expected = expected
        self.num_sent = 0
        self.diverged: ReplayDiverged | None = None
        self.stop: Callable[[], None] = lambda: None
        """Stops the controller (its `stop`, set once it exists)."""

    def diverge(self, error: ReplayDiverged) -> None:
        """The replay no longer follows the recording: the controller winds down, `replay`
        raises `error`."""
        if self.diverged is None:
            self.diverged = error
            self.stop()

    async def send(self, identity: bytes, msg: Any) -> bool:
        self._compare(_sent_key(identity, encode(msg)), msg)
        return True

    async def broadcast(self, identities: Iterable[bytes], msg: Any) -> None:
        frames = encode(msg)  # once, as the real channel's
        for identity in identities:
            self._compare(_sent_key(identity, frames), msg)

    def _compare(self, key: tuple[bytes, bytes, bytes], msg: Any) -> None:
        identity = key[0]
        i = self.num_sent
        if self.diverged is None and (i >= len(self.expected) or key != self.expected[i]):
            want = self.expected[i][:2] if i < len(self.expected) else "nothing"
            self.diverge(
                ReplayDiverged(
                    f"message {i} the replayed controller sent: {type(msg).__name__} to "
                    f"{identity!r}; the simulated controller sent {want}"
                )
            )
        self.num_sent += 1


class _ReplayPool(SimPool):
    """Workers that only exist: each is an idle task, as alive as a simulated one."""

    def worker(self, kind: Any, worker_id: str, rank: int) -> Coroutine[Any, Any, Any]:
        return _idle()


async def _idle() -> None:
    await asyncio.get_running_loop().create_future()  # until cancelled (pool.stop_all)


class _ReplayRuntime(SimRuntime):
    def __init__(self, env: SimEnv, router: _ReplayRouter) -> None:
        super().__init__(env, wire=True)
        self.replay_router = router

    def connect(self, cfg, setup):
        self.router = self.replay_router
        return Connection(
            channel=self.router,
            close=self.router.close,
            pool=_ReplayPool(cfg, setup.run_dir, self.router, self.env),
        )


class _Feeder:
    """Hands each recorded message to the router when the controller has taken as many steps
    as it had in the simulation and the clock has reached its time."""

    def __init__(
        self,
        arrivals: list[Arrival],
        router: _ReplayRouter,
        accounts: CpuAccounts,
        writer: _FrameWriter,
    ) -> None:
        self.arrivals, self.router, self.accounts = arrivals, router, accounts
        self.writer = writer
        self.next = 0
        self.timer_for = -1

    def __call__(self) -> None:
        loop = asyncio.get_running_loop()
        while self.next < len(self.arrivals) and self.router.diverged is None:
            arrival = self.arrivals[self.next]
            steps = self.accounts.controller_steps
            if steps > arrival.steps:
                self.router.diverge(
                    ReplayDiverged(
                        f"message {self.next} ({arrival.frames[0].hex()} from "
                        f"{arrival.identity!r}) came after {arrival.steps} steps of the simulated "
                        f"controller; the replayed one has taken {steps}"
                    )
                )
                return
            if steps < arrival.steps:
                return
            if loop.time() < arrival.time:
                if self.timer_for != self.next:
                    self.timer_for = self.next
                    loop.call_at(arrival.time, self)
                return
            self.router.deliver(arrival.identity, self.writer.take(self.next))
            self.next += 1


def replay(
    cfg_overrides: Callable[[str], list[str]],
    env: SimEnv,
    recording: Recording,
    drive: Callable[..., Any],
    limit_s: float,
    run_dir: Path,
) -> Alone:
    """Run a fresh controller on `recording`'s messages (see the module docstring); its marks
    are taken by `drive` (run._drive) as the simulation's were."""
    cfg = load_config(overrides=cfg_overrides(str(run_dir)))
    accounts = CpuAccounts()
    router = _ReplayRouter(recording.sent_frames)
    ctl = Controller(cfg, runtime=_ReplayRuntime(env, router))
    router.stop = ctl.stop
    writer = _FrameWriter(recording.arrivals)
    feeder = _Feeder(recording.arrivals, router, accounts, writer)

    async def main() -> Any:
        accounts.after_controller_step = feeder
        feeder()  # what arrived before the controller's first step
        return await drive(ctl, accounts, env)

    gc.collect()
    gc.freeze()  # the recording and the simulation's leftovers: not the controller's to walk
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            _, records, marks = run_virtual(main, limit_s)
    except Exception:
        if router.diverged is not None:
            raise router.diverged from None  # what failed followed from it
        raise
    finally:
        writer.stop()
        gc.unfreeze()
    if router.diverged is not None:
        raise router.diverged
    if feeder.next != len(recording.arrivals) or router.num_sent != len(recording.sent_frames):
        raise ReplayDiverged(
            f"the replayed controller took {feeder.next} of {len(recording.arrivals)} "
            f"messages and sent {router.num_sent} of {len(recording.sent_frames)}"
        )
    return Alone(
        marks=marks,
        num_received=feeder.next,
        num_sent=router.num_sent,
        intake_cpu_s=[r["perf/intake_cpu_s"] for r in records if r["kind"] == "step"],
        pack_cpu_s=[r["perf/pack_cpu_s"] for r in records if r["kind"] == "step"],
    )
