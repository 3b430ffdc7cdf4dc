"""The life cycle every worker shares: connect, register, set up, serve, heartbeat, exit.

    connect DEALER --Register--> controller --Welcome(config, version)--> setup() --Ready-->
    serve: recv loop -> handle(msg) (never blocks: long work runs in tasks/threads)
    heartbeat loop: a Heartbeat each interval in which nothing else was sent (any message
        proves the worker alive); exit when the controller is silent too long
    Shutdown, a fatal error, or a lost controller -> close() -> exit code (0: shut down;
    1: refused; 2: failed; 3: controller lost; 75: told to stop and be started again)

A worker holds no state that must survive: the controller re-queues whatever a lost worker
was doing. Subclasses implement `setup`, `handle` and `close`. Work items
that fail are reported as `WorkerError` with their request id and the worker goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any
from collections.abc import Sequence

import zmq
import zmq.asyncio

from areal.auth import (
    KEYS_ENV,
    KEYS_TEXT_ENV,
    ClientKeys,
    KeyFileError,
    client_keys_from_text,
    load_client_keys,
)
from areal.config import RunConfig, config_from_dict, parse_cpu_list
from areal.messages import (
    REJOIN_EXIT_CODE,
    Heartbeat,
    MessageError,
    PROTOCOL_VERSION,
    Ready,
    Register,
    Shutdown,
    Welcome,
    WorkerError,
    WorkerKind,
)
from areal.transport import DealerChannel, worker_identity
from areal.workers.parent import die_with_parent

log = logging.getLogger(__name__)

SECRET_ENV = "AREAL_SECRET"
"""Environment variable holding the run's shared secret (never passed on the command line,
where other users of the machine could read it)."""
CPUS_ENV = "AREAL_CPUS"
"""CPU list this worker pins itself to (set by the controller from rollout/trainer.cpus)."""
REGISTER_TIMEOUT_S = 60.0


class ControllerLost(RuntimeError):
    """The controller stopped answering; the worker exits."""


class Worker(ABC):
    kind: WorkerKind

    def __init__(
        self,
        address: str,
        worker_id: str,
        secret: str,
        rank: int = 0,
        keys: ClientKeys | None = None,
    ) -> None:
        self.address = address
        self.worker_id = worker_id
        self.secret = secret
        self.keys = keys
        self.rank = rank
        self._config: RunConfig | None = None
        self._channel: DealerChannel | None = None
        self._last_heard = time.monotonic()
        self._sent_since_beat = False
        """Something was sent since the heartbeat loop last looked: no Heartbeat needed."""
        self._tasks: set[asyncio.Task] = set()
        self._ready = False
        self.finished = False
        """The controller said the run finished (Shutdown.final): write final artifacts."""

    @property
    def channel(self) -> DealerChannel:
        """The connection to the controller, which `serve` opens first."""
        if self._channel is None:
            raise RuntimeError(f"{self.worker_id} is not connected: serve() connects it")
        return self._channel

    @property
    def config(self) -> RunConfig:
        """The run's configuration, as the controller's Welcome carried it: there from
        `setup` on (subclasses read it there and after)."""
        if self._config is None:
            raise RuntimeError(
                f"{self.worker_id} has no run configuration: it comes with the controller's "
                "Welcome, which has not arrived"
            )
        return self._config

    @config.setter
    def config(self, config: RunConfig) -> None:
        self._config = config

    # -- subclass API ---------------------------------------------------------------------------

    @abstractmethod
    async def setup(self, welcome: Welcome) -> int:
        """Load models etc. (off the event loop). Returns the policy version now served."""

    @abstractmethod
    async def handle(self, msg: Any) -> None:
        """React to one message from the controller; must return quickly."""

    def ready_message(self, version: int) -> Ready:
        """What to announce once set up (the trainer adds where its process groups meet)."""
        return Ready(version=version)

    async def close(self) -> None:
        """Release engines and models."""

    # -- plumbing ------------------------------------------------------------------------------

    def spawn(
        self, coro: Any, request_id: str = "", request_ids: Sequence[str] = ()
    ) -> asyncio.Task:
        """Run a work item in the background; its failure is reported, not fatal.
        `request_id` names it; `request_ids`: every request it answers for, when several."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._finished(t, request_id, list(request_ids)))
        return task

    def _finished(self, task: asyncio.Task, request_id: str, request_ids: list[str]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        log.error("work item %s failed: %r", request_id or "?", err, exc_info=err)
        self.spawn(
            self.send(
                WorkerError(
                    error=f"{type(err).__name__}: {err}",
                    request_id=request_id,
                    request_ids=request_ids,
                )
            )
        )

    async def send(self, msg: Any) -> None:
        self._sent_since_beat = True
        await self.channel.send(msg)

    async def serve(self) -> int:
        """Run until shutdown; returns the process exit code."""
        ctx = zmq.asyncio.Context()
        credential = self.keys.secret if self.keys is not None else self.secret.encode()
        self._channel = DealerChannel(
            ctx, self.address, worker_identity(self.worker_id, credential), curve=self.keys
        )
        heartbeat = None
        try:
            welcome = await self._register()
            if welcome is None:
                return 1
            self.config = config_from_dict(welcome.config)
            heartbeat = asyncio.create_task(self._heartbeat_loop())
            version = await self.setup(welcome)
            self._last_heard = (
                time.monotonic()
            )  # nothing is read during setup (vLLM's: tens of seconds)
            self._ready = True
            await self.send(self.ready_message(version))
            log.info("%s ready at version %d", self.worker_id, version)
            return await self._serve_loop(heartbeat)
        except ControllerLost as err:
            log.error("%s: %s", self.worker_id, err)
            return 3
        except Exception as err:  # fault-tolerance boundary: report, then die loudly
            log.exception("%s failed", self.worker_id)
            try:
                await asyncio.wait_for(
                    self.send(WorkerError(error=f"{type(err).__name__}: {err}", fatal=True)), 5
                )
            except (TimeoutError, zmq.ZMQError):
                pass
            return 2
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.close()
            self.channel.close()
            ctx.term()

    async def _register(self) -> Welcome | None:
        await self.send(
            Register(
                kind=self.kind,
                worker_id=self.worker_id,
                pid=os.getpid(),
                host=socket.gethostname(),
                secret=self.secret,
                rank=self.rank,
                protocol=PROTOCOL_VERSION,
            )
        )
        try:
            reply = await asyncio.wait_for(self.channel.recv(), REGISTER_TIMEOUT_S)
        except TimeoutError:
            log.error(
                "no answer from the controller at %s within %.0f s (%sa controller of an "
                "earlier areal release cannot read this worker's registration: install the "
                "same release on both machines)",
                self.address,
                REGISTER_TIMEOUT_S,
                ""
                if self.keys
                else "a controller using CurveZMQ answers only peers with its "
                "keys: pass --keys DIR; ",
            )
            return None
        if isinstance(reply, Shutdown):
            log.error("controller refused registration: %s", reply.reason)
            return None
        if not isinstance(reply, Welcome):
            raise RuntimeError(f"expected Welcome, got {type(reply).__name__}")
        self._last_heard = time.monotonic()
        return reply

    async def _serve_loop(self, heartbeat: asyncio.Task) -> int:
        recv = asyncio.create_task(self.channel.recv())
        try:
            while True:
                done, _ = await asyncio.wait({recv, heartbeat}, return_when=asyncio.FIRST_COMPLETED)
                if heartbeat in done:
                    heartbeat.result()  # raises ControllerLost
                    raise RuntimeError("heartbeat loop returned on its own")
                try:
                    msg = recv.result()
                except MessageError as err:
                    log.error("dropping malformed message from the controller: %s", err)
                    await self.send(WorkerError(error=f"malformed message: {err}"))
                    recv = asyncio.create_task(self.channel.recv())
                    continue
                self._last_heard = time.monotonic()
                recv = asyncio.create_task(self.channel.recv())
                if isinstance(msg, Shutdown):
                    log.info("%s shutting down: %s", self.worker_id, msg.reason)
                    self.finished = msg.final
                    return REJOIN_EXIT_CODE if msg.rejoin else 0
                if not isinstance(msg, Heartbeat):
                    await self.handle(msg)
        finally:
            recv.cancel()

    async def _heartbeat_loop(self) -> None:
        """A Heartbeat each interval in which the worker sent nothing else: the controller
        counts every message as a sign of life, and at cluster scale a Heartbeat from each
        of thousands of workers every interval is a real part of its CPU (docs/guides/
        scaling-out.md). So the controller hears from a worker at least every two intervals
        (the configuration requires a timeout of at least three)."""
        cfg = self.config.controller
        interval = self.config.heartbeat_interval()
        while True:
            if not self._sent_since_beat:
                await self.send(Heartbeat())
            self._sent_since_beat = False  # after the Heartbeat: only other messages count
            await asyncio.sleep(interval)
            silent = time.monotonic() - self._last_heard
            if self._ready and silent > cfg.heartbeat_timeout_s:
                raise ControllerLost(f"controller silent for {silent:.1f} s")


def worker_main(worker_cls: type[Worker], argv: list[str] | None = None) -> None:
    """Command-line entry point shared by `python -m areal.workers.<kind>`."""
    kind = worker_cls.kind.value
    parser = argparse.ArgumentParser(
        prog=f"python -m areal.workers.{kind}",
        description=f"Start a {kind} worker that joins a running controller. The shared "
        f"secret is read from ${SECRET_ENV}.",
    )
    parser.add_argument(
        "--connect",
        required=True,
        metavar="tcp://HOST:PORT",
        help="address of the controller socket",
    )
    parser.add_argument("--worker-id", default=None, help="unique name (default: kind-host-uuid)")
    parser.add_argument(
        "--rank",
        type=int,
        default=0,
        help="trainer rank; for rollout workers, the index that picks their seed (default 0)",
    )
    parser.add_argument(
        "--keys",
        default=os.environ.get(KEYS_ENV),
        metavar="DIR",
        help=f"CurveZMQ key directory holding server.key and client.key_secret "
        f"(default ${KEYS_ENV}); see python -m areal.auth",
    )
    parser.add_argument(
        "--cpus",
        default=os.environ.get(CPUS_ENV),
        metavar="LIST",
        help=f"pin this worker to these CPUs, e.g. 0-3,8 (default ${CPUS_ENV})",
    )
    args = parser.parse_args(argv)
    die_with_parent()  # a local worker (AREAL_PARENT_PID set) never outlives its controller
    secret = os.environ.get(SECRET_ENV, "")
    keys = None
    try:
        if args.keys:
            keys = load_client_keys(args.keys)
        elif os.environ.get(KEYS_TEXT_ENV):  # a launcher's (controller/launch)
            keys = client_keys_from_text(os.environ[KEYS_TEXT_ENV])
    except KeyFileError as err:
        parser.error(str(err))
    if keys is None and not secret:
        parser.error(
            f"no credentials: pass --keys DIR (CurveZMQ) or set ${SECRET_ENV} (the "
            "run's shared secret)"
        )
    if args.cpus:
        try:
            os.sched_setaffinity(0, parse_cpu_list(args.cpus))
        except (ValueError, OSError) as err:
            parser.error(f"--cpus {args.cpus!r}: {err}")
    worker_id = args.worker_id or f"{kind}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    logging.basicConfig(
        level=os.environ.get("AREAL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {worker_id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvloop

    worker = worker_cls(args.connect, worker_id, secret, args.rank, keys)
    sys.exit(uvloop.run(worker.serve()))
