"""ZeroMQ sockets carrying `areal.messages`, for the controller and the workers.

Socket types, chosen on purpose:
- controller: one ROUTER. It talks to many peers, must know who sent what (the identity
  frame), and must address a reply to one peer; ROUTER does exactly that.
- worker: one DEALER. Fully asynchronous in both directions (no REQ/REP lock-step), so a
  worker can stream results and heartbeats while requests keep arriving.

Sends are serialised by a lock: a multipart message must never interleave with another
coroutine's. Array frames go out with `copy=False`. Given keys (areal.auth), the ROUTER is a
CurveZMQ server and a DEALER its client.

With an intake (areal/intake.py, set by the owner), the ROUTER's `recv` decodes the
messages already waiting at the socket together (up to READ_AHEAD) and hands each the
intake wants to its thread, returning them in order as each one's intake work is done: the
thread works on the next messages while the caller decides on this one.

The ROUTER decodes a peer's messages in full only once its owner says the peer is
registered (`registered`); before that, only a Register of at most REGISTER_MAX_BYTES is
read, and anything else is refused on its type byte. A worker's identity (`worker_identity`)
cannot be guessed without the run's credential: ROUTER ignores a second connection under
an identity already in use, so a guessable one could be taken first and keep the worker
out. This module does not interpret messages beyond that.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import hmac
import logging
from typing import Any
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio

from areal.auth import ClientKeys, ServerKeys, make_client, make_server
from areal.codec import decode, encode
from areal.intake import Intake
from areal.messages import DEFAULT_MAX_BYTES, REGISTER_MAX_BYTES, MessageError, MsgType

log = logging.getLogger(__name__)


class RouterChannel:
    """The controller's end: receives (identity, message), sends to one identity."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        host: str,
        port: int,
        max_bytes: int = DEFAULT_MAX_BYTES,
        curve: ServerKeys | None = None,
    ) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        if curve is not None:
            make_server(self.socket, curve)  # before bind: every peer then goes through ZAP
        self.socket.setsockopt(zmq.LINGER, 0)
        # A peer that vanished must not make sends block or silently queue forever.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
        else:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self.address = f"tcp://{host}:{port}"
        self.max_bytes = max_bytes
        self.registered: Callable[[bytes], bool] = lambda identity: True
        """Whether a peer's messages are decoded in full (set by the owner, e.g. the
        controller's pool); the others may send only a small Register."""
        self.intake: Intake | None = None
        """Work on received messages done beside the event loop (set by the owner; the
        channel closes it): it is given a message's frames after the identity, and returns
        the message, decoded with this channel's `max_bytes` (`checks.intake_reading`).
        With one, `recv` reads ahead what waits at the socket."""
        self._received: collections.deque[_Received] = collections.deque()
        self._send_lock = asyncio.Lock()

    async def recv(self) -> tuple[bytes, Any]:
        """Next (identity, message). Raises MessageError (with the identity) on bad input.
        With an intake, the messages already waiting (up to READ_AHEAD) are received at
        once, those of registered peers the intake wants handed to it as frames (it decodes
        them) and the others decoded here, and each is returned, in order, once its intake
        work is done: the intake works on the next ones while the caller decides on this
        one."""
        if not self._received:
            self._received.append(self._decoded(await self.socket.recv_multipart(copy=False)))
            while (
                self.intake is not None and len(self._received) < READ_AHEAD and self._waiting()
            ):  # waiting at the socket: received without a wait
                self._received.append(self._decoded(await self.socket.recv_multipart(copy=False)))
        identity, msg, reading = self._received.popleft()
        if isinstance(msg, PeerMessageError):
            raise msg
        if reading is not None:
            if not reading.done():
                await asyncio.wrap_future(reading)
            try:
                msg = reading.result()  # what the intake raised, raised here
            except MessageError as err:
                raise PeerMessageError(identity, err) from None
        return identity, msg

    def _waiting(self) -> bool:
        """Whether a message waits at the socket, to be received without waiting."""
        events = self.socket.get(zmq.EVENTS)
        return isinstance(events, int) and bool(events & zmq.POLLIN)

    def _decoded(self, frames: list[Any]) -> _Received:
        """A received message: handed to the intake undecoded if it wants it (a registered
        peer's only), else decoded here."""
        identity = frames[0].bytes
        registered = self.registered(identity)
        if registered and self.intake is not None:
            reading = self.intake.submit(frames[1:])
            if reading is not None:
                return identity, None, reading
        try:
            if registered:
                msg = decode(frames[1:], self.max_bytes)
            else:
                msg = decode(frames[1:], REGISTER_MAX_BYTES, only=(MsgType.REGISTER,))
        except MessageError as err:
            return identity, PeerMessageError(identity, err), None
        return identity, msg, None

    async def send(self, identity: bytes, msg: Any) -> bool:
        """Send to one peer; False if that peer is gone (ROUTER_MANDATORY)."""
        frames = encode(msg)
        async with self._send_lock:
            return await self._send_frames(identity, frames)

    async def broadcast(self, identities: Iterable[bytes], msg: Any) -> None:
        """`msg` to each of `identities`, encoded once (a peer that is gone is skipped):
        the liveness loop's Heartbeats, one to each of up to thousands of workers."""
        frames = encode(msg)
        async with self._send_lock:
            for identity in identities:
                await self._send_frames(identity, frames)

    async def _send_frames(self, identity: bytes, frames: list[Any]) -> bool:
        """Under the send lock: False if that peer is gone."""
        try:
            await self.socket.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as err:
            if err.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def close(self) -> None:
        self.socket.close(0)
        if self.intake is not None:
            self.intake.close()


READ_AHEAD = 64
"""Messages the controller's channel decodes and hands to its intake ahead of the one it
returns: enough that the intake's thread is rarely idle while messages wait, few enough that
a backlog stays at the socket (its high-water mark), not in this process."""

_Received = tuple[bytes, Any, "concurrent.futures.Future | None"]
"""(identity, message or its PeerMessageError, None) for a message decoded on receipt;
(identity, None, the intake's reading, whose result is the message) for one handed over."""


class PeerMessageError(MessageError):
    """A malformed message, with the identity of the peer that sent it."""

    def __init__(self, identity: bytes, err: MessageError) -> None:
        super().__init__(str(err), err.reason)
        self.identity = identity


def worker_identity(worker_id: str, credential: bytes) -> bytes:
    """A worker's ZeroMQ identity: its id (readable in debugging) and an HMAC of it under
    the run's credential (the shared secret, or the client's CurveZMQ secret key). Stable
    across restarts of the same worker id; not guessable without the credential."""
    tag = hmac.new(credential, worker_id.encode(), hashlib.sha256).hexdigest()[:32]
    return worker_id.encode()[:200] + b"/" + tag.encode()


class DealerChannel:
    """A worker's end: one connection to the controller."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        identity: bytes,
        max_bytes: int = DEFAULT_MAX_BYTES,
        curve: ClientKeys | None = None,
    ) -> None:
        self.socket = ctx.socket(zmq.DEALER)
        if curve is not None:
            make_client(self.socket, curve)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let a final result/error drain on exit
        self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.socket.connect(address)
        self.max_bytes = max_bytes
        self._send_lock = asyncio.Lock()

    async def recv(self) -> Any:
        return decode(await self.socket.recv_multipart(copy=False), self.max_bytes)

    async def send(self, msg: Any) -> None:
        frames = encode(msg)
        async with self._send_lock:
            await self.socket.send_multipart(frames, copy=False)

    def close(self, linger_ms: int = 2000) -> None:
        self.socket.close(linger_ms)
