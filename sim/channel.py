"""An in-process stand-in for the controller's ROUTER socket and the workers' DEALERs.

Same contract as `areal.transport` (RouterChannel / DealerChannel): the controller receives
(identity, message) and sends to one identity (False when that peer is gone); a worker
sends and receives messages. Messages are the same `areal.messages` objects. With
`wire=True` each one is encoded by its sender and decoded by its receiver with the real
codec (`areal.codec.encode` / `decode`: msgpack header, raw array frames, every field
checked), so the controller pays what it pays on a real socket and the wire contract is
exercised; arrays stay zero-copy views. With `wire=False` the objects are passed as they are.

Everything is an asyncio queue in the simulation's event loop: no sockets, and no threads
but the controller's intake (areal/intake.py), whose work on a message is done on its own
thread while the loop waits. Each side's codec time falls in its own tasks' CPU accounts
(sim/accounting.py).
"""

from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Iterable

from areal.codec import decode, encode
from areal.intake import Intake
from areal.messages import DEFAULT_MAX_BYTES, MessageError
from areal.transport import PeerMessageError

ADDRESS = "sim://in-process"


class SimRouter:
    """The controller's end."""

    address = ADDRESS

    def __init__(self, wire: bool = True, recorder: Any = None) -> None:
        self.wire = wire
        self.recorder = recorder
        """Sees every message in and out as frames (sim/alone.py's Recording); wire only."""
        self._inbox: asyncio.Queue[tuple[bytes, Any]] = asyncio.Queue()
        self._peers: dict[bytes, SimDealer] = {}
        self.intake: Intake | None = None
        """As RouterChannel.intake (wire only)."""
        self.max_bytes = DEFAULT_MAX_BYTES
        """As RouterChannel.max_bytes: the largest message decoded."""

    def connect(self, identity: bytes) -> SimDealer:
        """A new worker connection under `identity` (replacing a closed one)."""
        dealer = SimDealer(self, identity)
        self._peers[identity] = dealer
        return dealer

    async def recv(self) -> tuple[bytes, Any]:
        """As RouterChannel.recv: with an intake, a message it wants is decoded and read on
        its thread before the message is returned, the loop's thread waiting for it (the
        virtual clock standing still, as in `VirtualTimeLoop.run_in_executor`). The
        controller's CPU time leaves the work out and pays for handing the message over
        and back, as a real loop does when the message finds it idle; with a backlog the
        real channel reads ahead and pays less (bench/intake.py)."""
        identity, payload = await self._inbox.get()
        if not self.wire:
            return identity, payload
        reading = self.intake.submit(payload) if self.intake is not None else None
        try:
            msg = decode(payload, self.max_bytes) if reading is None else reading.result()
        except MessageError as err:
            raise PeerMessageError(identity, err) from None
        return identity, msg

    async def send(self, identity: bytes, msg: Any) -> bool:
        peer = self._peers.get(identity)
        if peer is None or peer.closed:
            return False
        self._put(identity, peer, encode(msg) if self.wire else msg)
        return True

    async def broadcast(self, identities: Iterable[bytes], msg: Any) -> None:
        """`msg` to each of `identities`, encoded once, as RouterChannel.broadcast."""
        payload = encode(msg) if self.wire else msg
        for identity in identities:
            peer = self._peers.get(identity)
            if peer is not None and not peer.closed:
                self._put(identity, peer, payload)

    def _put(self, identity: bytes, peer: SimDealer, payload: Any) -> None:
        if self.recorder is not None:
            self.recorder.sent(identity, payload)
        peer._inbox.put_nowait(payload)

    def deliver(self, identity: bytes, payload: Any) -> None:
        """A message from the worker `identity` arrives."""
        if self.recorder is not None:
            self.recorder.received(identity, payload)
        self._inbox.put_nowait((identity, payload))

    def close(self) -> None:
        for peer in self._peers.values():
            peer.closed = True
        if self.intake is not None:
            self.intake.close()


class SimDealer:
    """A worker's end."""

    def __init__(self, router: SimRouter, identity: bytes) -> None:
        self.router = router
        self.identity = identity
        self.closed = False
        self.sent_since_beat = False
        """Something was sent since the worker's heartbeat loop last looked."""
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()

    async def recv(self) -> Any:
        payload = await self._inbox.get()
        return decode(payload) if self.router.wire else payload

    async def send(self, msg: Any) -> None:
        if self.closed:
            return
        self.sent_since_beat = True
        self.router.deliver(self.identity, encode(msg) if self.router.wire else msg)

    def close(self) -> None:
        self.closed = True
