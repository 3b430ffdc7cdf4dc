"""The controller's garbage-collection policy: rare cyclic collections while a run goes.

The controller allocates a few objects per message (tens of thousands of messages per step
at cluster scale) and keeps many of them alive for a step or more (samples, their
trajectories, the buffer), so with Python's default thresholds (700, 10, 10) the cyclic
collector runs hundreds of times per run and its full collections walk all of them; with
(50000, 20, 100) it runs a few times and seldom fully (bench/cluster.py's tables (f) and (r)
report the collector's share of the controller's CPU time, `gc s`). Its data structures
seldom form reference cycles (reference counting frees them), so collecting rarely costs
little memory; `controller.gc_thresholds` sets how rarely.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def collection_thresholds(thresholds: Sequence[int]) -> Iterator[None]:
    """`gc.set_threshold(*thresholds)` inside the block, the previous thresholds restored
    after it (a process may run several controllers, the simulation and tests do); empty:
    nothing changed."""
    if not thresholds:
        yield
        return
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)
