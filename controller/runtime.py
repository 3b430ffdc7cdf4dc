"""Where a controller's workers live and how it reaches them: the one seam of the controller.

A `Runtime` gives the controller its set-up (`prepare_run`: the run directory, the task, the
model and tokenizer) and its `Connection`: the channel it receives from and sends to, the
pool that starts and watches its workers, and what closes both. Admission, dispatch, the
ledger, the buffer, batching and sharding, the train driver and the weight-update protocol
run unchanged on whatever the runtime provides.

    LocalRuntime   (the default) a ZeroMQ ROUTER socket on controller.host, worker processes
                   started here (WorkerPool), remote workers joining with the run's secret
                   or CurveZMQ keys
    launchers      the same socket, workers started elsewhere (areal.controller.launch)
    SimRuntime     an in-process channel carrying the same messages, simulated workers on
                   a virtual clock (areal.sim)

A channel has `send(identity, msg) -> bool` (False: that peer is gone), `recv() ->
(identity, msg)`, `address`, `registered` (whether a peer's messages are decoded in
full) and `intake` (None, or the `areal.intake.Intake` the controller sets: work on each
received message it wants, done on its thread before `recv` returns the message; the
channel closes it); a pool is a `WorkerPool` whose `start` starts what stands for a worker
process.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable, Coroutine

import zmq
import zmq.asyncio

from areal.auth import ZapHandler, run_keys, watch_handshakes
from areal.config import RunConfig, is_loopback
from areal.controller import preload
from areal.controller.pool import WorkerPool
from areal.controller.setup import RunSetup, prepare_run
from areal.transport import RouterChannel

log = logging.getLogger("areal.controller")


@dataclass(kw_only=True)
class Connection:
    channel: Any
    pool: WorkerPool
    close: Callable[[], None]
    """Releases the channel and the pool's resources after the run (workers are shut down
    by the controller first)."""
    loops: dict[str, Coroutine[Any, Any, Any]] = field(default_factory=dict)
    """Tasks the transport needs while the run lasts (CurveZMQ's authentication), by name:
    the controller runs them in its task group, like its own loops."""


class Runtime(Protocol):
    def prepare_run(self, cfg: RunConfig) -> RunSetup:
        """Everything before the first message (called in a thread, like `prepare_run`)."""

    def connect(self, cfg: RunConfig, setup: RunSetup) -> Connection:
        """The controller's end of the transport and its workers (called in the event
        loop, before any worker starts)."""


class LocalRuntime:
    """The ROUTER socket bound on controller.host; workers started as local processes, or
    joining from elsewhere (controller.remote_kinds) with the run's credentials: a shared
    secret, or CurveZMQ keys (then every connection is authenticated by the ZAP handler)."""

    def __init__(self) -> None:
        self.zap: ZapHandler | None = None
        """The CurveZMQ authenticator (its `refused` connections), under CurveZMQ."""
        self.handshake_failures: list[str] = []
        """Handshakes that failed before authentication (plain TCP against CURVE), each
        reason once."""

    def prepare_run(self, cfg: RunConfig) -> RunSetup:
        preload.warm(cfg)  # the fork server imports while the run is set up
        return prepare_run(cfg)

    def make_pool(
        self,
        cfg: RunConfig,
        setup: RunSetup,
        address: str,
        secret: str | None,
        keys_dir: Path | None,
    ) -> WorkerPool:
        """The pool that starts this runtime's workers (launchers override it)."""
        return WorkerPool(cfg, setup.run_dir, address, secret, keys_dir)

    def closed(self) -> None:
        """Called after the socket is closed (launchers release what they hold)."""

    def connect(self, cfg: RunConfig, setup: RunSetup) -> Connection:
        ctx = zmq.asyncio.Context()
        secret, keys, keys_dir = self._credentials(ctx, cfg, setup)
        channel = RouterChannel(
            ctx,
            cfg.controller.host,
            cfg.controller.port,
            cfg.controller.max_message_mb << 20,
            curve=keys,
        )
        loops: dict[str, Coroutine[Any, Any, Any]] = {}
        if self.zap is not None:
            loops["zap"] = self.zap.serve()
            loops["handshakes"] = watch_handshakes(channel.socket, self.handshake_failures)

        def close() -> None:
            channel.close()
            ctx.destroy(linger=0)  # the ZAP and monitor sockets too, if their loops never ran
            self.closed()

        return Connection(
            channel=channel,
            close=close,
            loops=loops,
            pool=self.make_pool(cfg, setup, channel.address, secret, keys_dir),
        )

    def _credentials(
        self, ctx: zmq.asyncio.Context, cfg: RunConfig, setup: RunSetup
    ) -> tuple[str | None, Any, Path | None]:
        """(Register secret or None, CurveZMQ server keys or None, key directory or None).
        Under CurveZMQ the ZAP handler is made here, before the socket binds."""
        controller = cfg.controller
        if not controller.uses_curve:
            if not is_loopback(controller.host):
                log.warning(
                    "controller.auth=secret on %s: traffic and the secret travel "
                    "unencrypted; use controller.auth=curve off a trusted network",
                    controller.host,
                )
            return controller.secret or secrets.token_hex(16), None, None
        keys, keys_dir = run_keys(controller.keys_dir, setup.run_dir)
        self.zap = ZapHandler(ctx, keys)
        return controller.secret, keys, keys_dir
