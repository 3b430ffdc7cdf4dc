"""The controller's garbage-collection policy: rare cyclic collections while a run goes.

The controller allocates a few objects per message (tens of thousands of messages per step
at cluster scale) and keeps many of them alive for a step or more (samples, their
trajectories, the buffer). Each collection walks the objects of its generations that are
still alive, so what matters is how often a long-lived object is walked. With Python's
default thresholds (700, 10, 10) the collector runs hundreds of times per run and its full
collections walk every live sample. With (50000, 1000, 100) a sample is walked once, by the
generation-0 collection that promotes it (one per 50,000 net allocations); a generation-1
collection, which would walk everything promoted since the last one, comes once per 1,000 of
those, and a full one at most once per 100 of those (bench/cluster.py's tables (f) and (r) report
the collector's share of the controller's CPU time, `gc s`). The price is memory held by
cyclic garbage that outlived generation 0, until a generation-1 collection: the
controller's data structures seldom form reference cycles (reference counting frees
them). `controller.gc_thresholds` sets how rarely.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence


_held: list[list[int]] = []
"""The thresholds of each block now open, in the order they were entered (each block's own
list object: blocks of equal thresholds are told apart by identity)."""
_process_thresholds: tuple[int, ...] = ()
"""The thresholds before the first of them opened: what the last to close restores."""


@contextlib.contextmanager
def collection_thresholds(thresholds: Sequence[int]) -> Iterator[None]:
    """`gc.set_threshold(*thresholds)` inside the block; empty: nothing changed.

    A process may run several controllers, one after another or at once (the simulation
    and tests do), and their blocks need not close in the order they opened. So the
    thresholds are the latest open block's, and when the last one closes the process gets
    back what it had before the first opened (restoring each block's own `before` would
    leave an inner block's thresholds behind when an outer one closed first)."""
    global _process_thresholds
    if not thresholds:
        yield
        return
    entry = list(thresholds)
    if not _held:
        _process_thresholds = gc.get_threshold()
    _held.append(entry)
    gc.set_threshold(*entry)
    try:
        yield
    finally:
        del _held[next(i for i, held in enumerate(_held) if held is entry)]
        gc.set_threshold(*(_held[-1] if _held else _process_thresholds))
