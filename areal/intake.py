"""The controller's intake: work on received messages done on a thread beside its event loop.

The controller's event loop decides on one message at a time. At cluster scale most of what
a Completions costs it is reading the tokens it carries: a pass over every token id and
log-prob, to find their extremes (controller/checks.py, `TokenBounds`), two arrays of tens of
thousands of values a message and hundreds of millions a step; and before it, checking that
the message's parts fit together (`Completions.check`: its lists pair up, its lengths cut
its arrays). That work needs no decision and no state of the controller's, and numpy lets
other threads run while it reduces an array, so `Intake` does it on a thread of its own
(controller/checks.py, `read_completions`) while the loop decides on the messages received
before: the channel (areal/transport.py) reads ahead the messages waiting at its socket and
hands each one the intake wants to it as it decodes it; the loop takes a message once its
intake work is done, in the order received.

What stays on the loop's thread: decoding (its C parts hold the GIL, so moving it would only
move the time), and every decision. The intake's thread holds the GIL for the Python around
each reduction, for the parts' check and for taking and returning each message; `cpu_s` is
all of its CPU time, reported beside the loop's (the step records' perf/intake_cpu_s).
Handing a message over costs the loop's thread CPU too, so only messages large enough to
repay it are wanted (controller/checks.py, INTAKE_MIN_TOKENS; bench/intake.py measures both
sides).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any
from collections.abc import Callable


class Intake:
    """One thread running `prepare` on each message submitted to it that it `wants`, in
    order."""

    def __init__(self, prepare: Callable[[Any], None], wants: Callable[[Any], bool]) -> None:
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

    def submit(self, msg: Any) -> concurrent.futures.Future | None:
        """`msg`'s work, queued behind what was submitted before: a future that is done when
        it is (holding its exception if `prepare` raised); None for a message it does not
        want, which needs nothing done here."""
        if not self.wants(msg):
            return None
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((msg, done))
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
                msg, done = item
                try:
                    self._prepare(msg)
                except BaseException as err:  # the receiver raises it, as its own
                    done.set_exception(err)
                else:
                    done.set_result(None)
        finally:
            self._final_cpu_s = time.thread_time()
