"""Where a controller's workers live and how it reaches them: the one seam of the controller.

By default (`Controller(cfg)`, runtime None) the controller binds a ZeroMQ ROUTER socket and
starts worker processes (`WorkerPool`). A `Runtime` replaces exactly that, and the set-up that
needs a real model and tokenizer (`prepare_run`), and nothing else: admission, dispatch, the
ledger, the buffer, batching and sharding, the train driver and the weight-update protocol
run unchanged on whatever the runtime provides. The cluster simulation (`areal.sim`) is one:
an in-process channel carrying the same messages and simulated workers on a virtual clock.

A runtime's channel has `send(identity, msg) -> bool` (False: that peer is gone),
`recv() -> (identity, msg)` and `address`; its pool is a `WorkerPool` whose `spawn` starts
what stands for a worker process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable

if TYPE_CHECKING:
    from areal.config import RunConfig
    from areal.controller.pool import WorkerPool
    from areal.controller.setup import RunSetup


class Runtime(Protocol):
    def prepare_run(self, cfg: RunConfig) -> RunSetup:
        """Everything before the first message (called in a thread, like `prepare_run`)."""

    def connect(self, cfg: RunConfig,
                setup: RunSetup) -> tuple[Any, WorkerPool, Callable[[], None]]:
        """(channel, pool, close): the controller's end of the transport, its workers, and
        what releases them after the run."""
