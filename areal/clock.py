"""The one clock the controller reads: real monotonic time, or a simulation's virtual time.

Every timing read of the controller goes through `now()`. In a real run it is
`time.monotonic()`, exactly as before. When the running event loop keeps virtual time (the
cluster simulation, `areal.sim.loop.VirtualTimeLoop`, marks itself with
`virtual_time = True`), `now()` is that loop's `time()`, so that durations the controller
measures (step time, waits, heartbeats, throughput) are simulated seconds, and a simulated
40-hour run reports 40 hours. Outside any event loop (a thread, a plain function) it is
real time. This module knows nothing about simulation beyond that marker.
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    """Seconds on the controller's clock (monotonic; only differences are meaningful)."""
    loop = asyncio._get_running_loop()  # public in asyncio.events; None outside a loop
    if loop is not None and getattr(loop, "virtual_time", False):
        return loop.time()
    return time.monotonic()
