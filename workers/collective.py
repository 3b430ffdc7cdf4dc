"""Process groups among workers: where they meet, how they are (re)formed, and the bucketed
weight broadcast that runs in one (weight_sync.mode='collective').

    trainer rank 0: host_store() -- one TCPStore for the run, listening on its advertised
                    address only; its "host:port" goes to the controller in Ready
    controller:     JoinGroup(group, generation, rank, world_size, backend, store) to members
    member:         connect_store() -> process group under the prefix "<group>/<generation>"
                    -> GroupStatus(JOINED | FAILED)
    weights group:  rank 0 = trainer rank 0 (sends), ranks 1.. = rollout workers (receive):
                    for each bucket of the manifest: broadcast one flat uint8 buffer

Membership changes. A process group cannot change its members, so the controller re-forms
the weights group under a new generation whenever its membership changes (a rollout worker
lost, restarted, or joining late) or a broadcast failed, and then broadcasts the current
version again; members that already serve it receive and drop it. Operations of an older
generation still queued when a newer one is announced are skipped (`Superseded`). One that
is already blocked is aborted, which unblocks NCCL; gloo ignores the abort (a
broadcast to a stopped peer still waits), so there it ends at `timeout_s`. A dead peer
(closed connection) makes gloo fail at once.

Blocking operations (rendezvous, collectives) run on a `SerialThread`: one daemon thread
per group, in submission order, so that the event loop never blocks and a rank stuck in a
collective with a dead peer cannot keep its process alive after Shutdown.

Security: torch.distributed stores and gloo/NCCL connections are not authenticated. The
controller hands their address only to authenticated workers, and the store listens only
on the advertised address (loopback for a loopback controller); across nodes, keep these
ports on a trusted network.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from areal.messages import GroupName, GroupState, GroupStatus, JoinGroup
from areal.models.weights import TensorSpec, bucket_tensors, flatten_bucket, unflatten_bucket

log = logging.getLogger(__name__)

Manifest = list[dict[str, Any]]
"""Per bucket: {"num_bytes": int, "tensors": [[name, dtype, shape, offset, num_bytes], ...]}."""


# -- where groups meet ---------------------------------------------------------------------------


def advertised_host(controller_address: str, override: str | None = None) -> str:
    """The address other members should use to reach this process: `override`, else the
    local address of the interface that routes to the controller (127.0.0.1 for a loopback
    controller). A controller bound to a wildcard (0.0.0.0) says nothing about the network,
    so then: the interface of the default route, else the hostname's address. No packet is
    sent: connecting a UDP socket only picks the route."""
    if override:
        return override
    host = urlparse(controller_address).hostname or "127.0.0.1"
    if host in ("0.0.0.0", "::", "*"):
        try:
            return _route_source("10.255.255.255")
        except OSError:
            return socket.gethostbyname(socket.gethostname())
    return _route_source(host)


def _route_source(host: str) -> str:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def pin_interface(address: str) -> None:
    """Make gloo and NCCL use the interface holding `address` unless the user chose one
    (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); otherwise they use the hostname's address,
    which on many clusters is not the network the other nodes reach."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return
    log.warning(
        "no local interface holds %s; gloo/NCCL pick their own (set "
        "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)",
        address,
    )


def host_store(host: str, port: int = 0, timeout_s: float = 300.0) -> tuple[dist.TCPStore, str]:
    """(master TCPStore, "host:port") listening on `host` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(256)
    port = listener.getsockname()[1]
    # The store serves on this socket from now on: hand it the descriptor for good.
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
    )
    return store, _join_address(host, port)


def connect_store(address: str, timeout_s: float = 300.0) -> dist.TCPStore:
    host, port = _split_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def join_store(address: str, timeout_s: float) -> dist.TCPStore:
    """Connect to trainer rank 0's store at `address`, over the interface that reaches it
    (pin_interface: gloo then uses the same one)."""
    pin_interface(advertised_host(f"tcp://{address}"))
    return connect_store(address, timeout_s)


def _join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def new_group(
    store: dist.Store, prefix: str, rank: int, world_size: int, backend: str, timeout_s: float
) -> Any:
    """A standalone process group (not the default one) under `prefix` of `store`."""
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"process-group backend {backend!r} is not one of gloo, nccl")


# -- a thread for blocking collective operations -------------------------------------------------


class SerialThread:
    """Runs blocking callables one at a time on a daemon thread; `submit` returns an
    asyncio future of the result (exceptions included)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((fn, loop, future))
        return future

    def _run(self) -> None:
        while True:
            fn, loop, future = self._queue.get()
            try:
                result, error = fn(), None
            except BaseException as err:  # handed to the awaiting coroutine
                result, error = None, err
            loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# -- the weights group ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class WeightSnapshot:
    """One published version, flattened into CPU buckets, ready to broadcast."""

    version: int
    buffers: list[torch.Tensor]
    manifest: Manifest


def snapshot_weights(
    tensors: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int
) -> WeightSnapshot:
    """Flatten (name, tensor) pairs into CPU uint8 buckets (a copy: training may go on)."""
    buffers, manifest = [], []
    for bucket in bucket_tensors(tensors, bucket_bytes):
        flat, specs = flatten_bucket(bucket)
        flat = flat.cpu()  # no copy when it already is
        buffers.append(flat)
        manifest.append(
            {
                "num_bytes": flat.numel(),
                "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.num_bytes] for s in specs],
            }
        )
    return WeightSnapshot(version=version, buffers=buffers, manifest=manifest)


class Superseded(RuntimeError):
    """An operation of a weights-group generation that a newer one replaced."""


class WeightsGroup:
    """One member's view of the weights group across generations. `join`, `send` and
    `receive` block: call them on a SerialThread, in order; `announce` is called from the
    event loop as soon as a newer generation is known."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.generation = 0
        """Generation of the group this member is in (0: none yet)."""
        self.latest = 0
        """Newest generation announced; operations of older ones fail with Superseded."""
        self._group: Any = None
        self._store: tuple[str, dist.Store] | None = None
        """(address, client) of the TCPStore the groups meet at: a new one when trainer rank
        0 (its host) was restarted."""

    def announce(self, generation: int) -> None:
        """A newer generation is coming: queued operations of older ones are skipped, and
        one blocked in the current group is aborted (NCCL; gloo waits for its timeout)."""
        self.latest = max(self.latest, generation)
        group = self._group
        if group is not None and self.generation < self.latest and hasattr(group, "abort"):
            group.abort()

    def join(
        self,
        *,
        store: dist.Store | str,
        generation: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Leave the current generation and join `generation` (blocks until all are in)."""
        self._current(generation, "join")
        if isinstance(store, str):
            if self._store is None or self._store[0] != store:
                self._store = (store, join_store(store, timeout_s))
            store = self._store[1]
        self._group = None
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._group = new_group(
            store, f"weights/{generation}", rank, world_size, backend, timeout_s
        )
        self.generation = generation
        log.info(
            "joined weights group generation %d as rank %d of %d (%s)",
            generation,
            rank,
            world_size,
            backend,
        )

    def _current(self, generation: int, what: str) -> None:
        if generation < self.latest:
            raise Superseded(
                f"{what} in weights group generation {generation} skipped: "
                f"generation {self.latest} replaces it"
            )

    def _group_of(self, generation: int, what: str) -> Any:
        self._current(generation, what)
        if self._group is None or generation != self.generation:
            raise RuntimeError(
                f"{what} in weights group generation {generation}, but this "
                f"member is in generation {self.generation}"
            )
        return self._group

    def send(self, snapshot: WeightSnapshot, generation: int) -> None:
        """Rank 0: broadcast every bucket of `snapshot`."""
        group = self._group_of(generation, f"broadcast of version {snapshot.version}")
        for flat in snapshot.buffers:
            buf = flat.to(self.device)
            group.broadcast(buf, 0).wait()
        self._sync()

    def receive(self, manifest: Manifest, generation: int) -> dict[str, torch.Tensor]:
        """Ranks >= 1: receive every bucket; returns name -> tensor (views of the buckets)."""
        group = self._group_of(generation, "receive")
        tensors: dict[str, torch.Tensor] = {}
        for bucket in manifest:
            buf = torch.empty(int(bucket["num_bytes"]), dtype=torch.uint8, device=self.device)
            group.broadcast(buf, 0).wait()
            specs = [
                TensorSpec(name=n, dtype=d, shape=tuple(s), offset=o, num_bytes=b)
                for n, d, s, o, b in bucket["tensors"]
            ]
            tensors.update(unflatten_bucket(buf, specs))
        self._sync()
        return tensors

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class WeightsMember:
    """A worker's place in the weights group: the group, and the thread its blocking
    operations (join, send, receive) run on, one at a time, in the order asked for."""

    def __init__(self) -> None:
        self.group = WeightsGroup()
        self.thread = SerialThread("weights-group")

    def join(self, msg: JoinGroup, store: dist.Store | str) -> asyncio.Future:
        """Announce the generation at once (it unblocks an operation of an older one), then
        join it on the thread."""
        self.group.announce(msg.generation)
        return self.thread.submit(
            lambda: self.group.join(
                store=store,
                generation=msg.generation,
                rank=msg.rank,
                world_size=msg.world_size,
                backend=msg.backend,
                timeout_s=msg.timeout_s,
            )
        )


async def report_weights_op(
    send: Callable[[GroupStatus], Awaitable[None]], generation: int, done: asyncio.Future, what: str
) -> None:
    """Await a weights-group operation: a failure is reported (the controller re-forms the
    group and sends the version again), a successful "join" too."""
    try:
        await done
    except Exception as err:  # fault boundary
        log.error("weights group generation %d: %s failed: %r", generation, what, err)
        await send(
            GroupStatus(
                group=GroupName.WEIGHTS,
                generation=generation,
                state=GroupState.FAILED,
                error=f"{what}: {err!r}",
            )
        )
        return
    if what == "join":
        await send(
            GroupStatus(group=GroupName.WEIGHTS, generation=generation, state=GroupState.JOINED)
        )
