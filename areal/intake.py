"""The controller's intake: work on received messages done on a thread beside its event loop.

The controller's event loop decides on one message at a time. At cluster scale most of what
a Completions costs it is reading what it carries: decoding its frames, checking that its
parts fit together (`Completions.check`: its lists pair up, its lengths cut its arrays) and a
pass over every token id and log-prob, to find their extremes (controller/checks.py,
`TokenBounds`), two arrays of tens of thousands of values a message and hundreds of millions
a step. That work needs no decision and no state of the controller's, so `Intake` does it on
a thread of its own (controller/checks.py, `intake_reading`) while the loop decides on the
messages received before: the channel (areal/transport.py) reads ahead the frames waiting at
its socket, hands those the intake wants to it undecoded and decodes the others itself; the
loop takes each message, in the order received, once the intake's work on it is done.

What stays on the loop's thread: every decision, and decoding the messages the intake does
not take. The intake's thread holds the GIL for decoding (msgspec's C code), the parts'
check and the Python around each reduction (numpy lets other threads run while it reduces
an array), and for taking and returning each message: it moves that time off the loop's
thread, not out of the process. `cpu_s` is all of its CPU time, reported beside the loop's
(the step records' perf/intake_cpu_s). Handing a message over costs the loop's thread CPU
too, so only messages large enough to repay it are wanted (controller/checks.py,
INTAKE_MIN_BYTES; bench/intake.py measures both sides).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any
from collections.abc import Callable


class Intake:
    """One thread running `prepare` on each item submitted to it that it `wants`, in order:
    the item's future holds what `prepare` returns."""

    def __init__(self, prepare: Callable[[Any], Any], wants: Callable[[Any], bool]) -> None:
        self.wants = wants
        self._prepare = prepare
        self._queue: queue.SimpleQueue[tuple[Any, concurrent.futures.Future] | None] = (
            queue.SimpleQueue()
        )
        self._final_cpu_s: float | None = None
        self._thread = threading.Thread(target=self._serve, name="intake", daemon=True)
        self._thread.start()
        assert self._thread.ident is not None  # started
        self._clock = time.pthread_getcpuclockid(self._thread.ident)

    def submit(self, item: Any) -> concurrent.futures.Future | None:
        """`item`'s work, queued behind what was submitted before: a future that is done
        when it is, holding what `prepare` returned (or its exception); None for an item it
        does not want, which needs nothing done here."""
        if not self.wants(item):
            return None
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((item, done))
        return done

    @property
    def cpu_s(self) -> float:
        """CPU seconds the intake's thread has spent, all of it (waiting costs none)."""
        if self._final_cpu_s is not None:
            return self._final_cpu_s
        try:
            return time.clock_gettime(self._clock)
        except OSError:  # the thread ended between the two reads
            return self._final_cpu_s or 0.0

    def close(self) -> None:
        """The thread ends once the work queued before is done."""
        self._queue.put(None)

    def _serve(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                work, done = item
                try:
                    result = self._prepare(work)
                except BaseException as err:  # the receiver raises it, as its own
                    done.set_exception(err)
                else:
                    done.set_result(result)
        finally:
            self._final_cpu_s = time.thread_time()
