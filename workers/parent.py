"""A local worker dies with the controller that started it, at once.

The controller passes its pid in `AREAL_PARENT_PID` to the workers it spawns. At start-up such
a worker asks the kernel to SIGKILL it when that parent exits (Linux `prctl(PR_SET_PDEATHSIG)`,
through ctypes), then checks that the parent is still the one named (it may have died before
the request was made). Without prctl (not Linux) a daemon thread polls the parent instead.
Why SIGKILL: an orphan must not finish a step, publish weights or write `final_model` into
a run directory that a resumed controller now owns; there is nothing it could save anyway.
Such a worker ignores SIGINT and SIGTERM: a Ctrl-C in the terminal (sent to the whole
process group) or a launcher's SIGTERM to every process must reach only the controller,
which then stops the run in order (the current step needs its trainer) and ends its workers.

The kernel ties the signal to the parent *thread* that forked the worker, not to its
process: a worker (or fork server) started from a thread that ends, such as one of the event
loop's default executor, which `asyncio.run` shuts down when it returns, would be killed then.
So the controller starts every local process through `spawning`, one thread of its own that
lasts as long as the process does.
Remote workers (started by hand or a launcher, no `AREAL_PARENT_PID`) are not affected; they
exit when the controller has been silent for `controller.heartbeat_timeout_s` (base.py).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
import os
import signal
import sys
import threading
import time
from typing import TypeVar

PARENT_ENV = "AREAL_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5

log = logging.getLogger(__name__)

T = TypeVar("T")

_SPAWNING = ThreadPoolExecutor(1, thread_name_prefix="areal-spawning")
"""Its one thread is made on first use and lasts until the interpreter shuts down."""


def spawning(start: Callable[[], T]) -> T:
    """`start()` (which starts a process that dies with this one) run in the thread that
    starts every such process, whatever thread calls it: see the module docstring. It must
    not call `spawning` itself (that thread would wait on itself)."""
    return _SPAWNING.submit(start).result()


def die_with_parent(environ: dict[str, str] | None = None) -> bool:
    """Arrange to be killed when the controller in `AREAL_PARENT_PID` exits; False when this
    process was not started by a controller (no such variable)."""
    value = (os.environ if environ is None else environ).get(PARENT_ENV, "")
    if not value:
        return False
    parent = int(value)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if not _request_parent_death_signal():
        threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _request_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d); polling the parent instead",
            ctypes.get_errno(),
        )
        return False
    return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)
