"""The controller's socket over real ZeroMQ connections: unregistered peers may send only a
small Register; worker identities are stable per credential and not guessable without it;
with an intake, the messages waiting are read ahead and returned in order, prepared."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from areal.codec import decode, encode
from areal.intake import Intake
from areal.messages import REGISTER_MAX_BYTES, Cancel, Heartbeat, MsgType, Register, WorkerKind
from areal.transport import PeerMessageError, RouterChannel, worker_identity


def _register(worker_id: str = "w") -> Register:
    return Register(kind=WorkerKind.ROLLOUT, worker_id=worker_id, pid=1, host="h", secret="s")


@contextlib.contextmanager
def _router_and_peer() -> Iterator[tuple[RouterChannel, zmq.asyncio.Socket]]:
    """A controller's channel and a DEALER connected to it as b"peer-1", closed after."""
    ctx = zmq.asyncio.Context()
    channel = RouterChannel(ctx, "127.0.0.1", 0)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"peer-1")
    peer.linger = 0
    peer.connect(channel.address)
    try:
        yield channel, peer
    finally:
        peer.close()
        channel.close()
        ctx.term()


def test_unregistered_peers_may_send_only_a_small_register():
    async def scenario() -> list:
        outcomes = []
        with _router_and_peer() as (channel, peer):
            admitted: set[bytes] = set()
            channel.registered = lambda identity: identity in admitted
            for frames in (
                [bytes([MsgType.HEARTBEAT]), b"\xff" * (1 << 20)],  # not a Register
                encode(_register("w" * REGISTER_MAX_BYTES)),  # a Register too large
                encode(_register()),  # accepted
                encode(Heartbeat()),
            ):  # accepted once registered
                await peer.send_multipart(frames)
                try:
                    outcomes.append(await asyncio.wait_for(channel.recv(), 10))
                except PeerMessageError as err:
                    outcomes.append((err.identity, err.reason))
                if len(outcomes) == 3:
                    admitted.add(b"peer-1")
        return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes == [
        (b"peer-1", "not accepted"),
        (b"peer-1", "too large"),
        (b"peer-1", _register()),
        (b"peer-1", Heartbeat()),
    ]


def test_worker_identities_are_stable_per_credential_and_unguessable_without_it():
    first = worker_identity("rollout-0", b"secret-a")
    assert first == worker_identity("rollout-0", b"secret-a")  # a restart keeps it
    assert first.startswith(b"rollout-0/") and first != b"rollout-0"
    assert first != worker_identity("rollout-0", b"secret-b")
    assert first != worker_identity("rollout-1", b"secret-a")
    assert len(worker_identity("x" * 1000, b"k")) <= 255  # ZeroMQ's identity limit
    assert len(first.split(b"/")[1]) == 32  # 128 bits of HMAC-SHA256


@pytest.mark.parametrize("worker_id", ["rollout-0", "reward-3"])
def test_a_squatter_on_the_old_guessable_identity_does_not_block_the_worker(worker_id):
    async def scenario() -> Register:
        ctx = zmq.asyncio.Context()
        channel = RouterChannel(ctx, "127.0.0.1", 0)
        squatter = ctx.socket(zmq.DEALER)
        squatter.setsockopt(zmq.IDENTITY, worker_id.encode())
        squatter.linger = 0
        squatter.connect(channel.address)
        await asyncio.sleep(0.2)  # the squatter's identity is taken first
        worker = ctx.socket(zmq.DEALER)
        worker.setsockopt(zmq.IDENTITY, worker_identity(worker_id, b"run secret"))
        worker.linger = 0
        worker.connect(channel.address)
        try:
            await worker.send_multipart(encode(_register(worker_id)))
            _, msg = await asyncio.wait_for(channel.recv(), 10)
            return msg
        finally:
            for sock in (squatter, worker):
                sock.close()
            channel.close()
            ctx.term()

    assert asyncio.run(scenario()) == _register(worker_id)


def test_a_broadcast_reaches_every_connected_peer_once_and_skips_one_that_is_gone():
    async def scenario() -> list:
        ctx = zmq.asyncio.Context()
        channel = RouterChannel(ctx, "127.0.0.1", 0)
        peers = []
        try:
            for name in (b"peer-1", b"peer-2"):
                peer = ctx.socket(zmq.DEALER)
                peer.setsockopt(zmq.IDENTITY, name)
                peer.linger = 0
                peer.connect(channel.address)
                await peer.send_multipart(encode(_register(name.decode())))  # now routable
                await asyncio.wait_for(channel.recv(), 10)
                peers.append(peer)
            await channel.broadcast([b"peer-1", b"gone", b"peer-2"], Heartbeat())
            await channel.send(b"peer-1", Cancel(request_ids=["after"]))  # after the broadcast
            got = []
            for peer in peers:
                while await peer.poll(1000):
                    got.append((peer.identity, await peer.recv_multipart()))
            return got
        finally:
            for peer in peers:
                peer.close()
            channel.close()
            ctx.term()

    got = asyncio.run(scenario())
    assert got == [
        (b"peer-1", encode(Heartbeat())),
        (b"peer-1", encode(Cancel(request_ids=["after"]))),
        (b"peer-2", encode(Heartbeat())),
    ]


def test_with_an_intake_messages_waiting_are_read_ahead_decoded_there_and_returned_in_order():
    """Eight messages sent at once, a malformed one among them: each Cancel comes back in
    the order sent, already decoded and prepared on the intake's thread; the malformed one
    (refused by the decoder there) raises in its place with its peer's identity, and the
    ones after it still come. A Heartbeat, which the intake does not want, is decoded on
    the caller's thread."""
    prepared: dict[str, str] = {}
    waiting: list[int] = []

    def prepare(body) -> Cancel:
        msg = decode(body)
        prepared[msg.request_ids[0]] = threading.current_thread().name
        return msg

    def wants(body) -> bool:
        return body[0].bytes == bytes([MsgType.CANCEL])

    async def scenario() -> list:
        outcomes: list = []
        with _router_and_peer() as (channel, peer):
            channel.intake = Intake(prepare, wants)
            for i in range(9):
                if i == 3:
                    frames = [bytes([MsgType.CANCEL]), b"\xc1"]  # not msgpack
                elif i == 8:
                    frames = encode(Heartbeat())
                else:
                    frames = encode(Cancel(request_ids=[f"r{i}"]))
                await peer.send_multipart(frames)
            await asyncio.sleep(0.2)  # all nine wait at the socket: read ahead together
            while len(outcomes) < 9:
                try:
                    _, msg = await asyncio.wait_for(channel.recv(), 10)
                except PeerMessageError as err:
                    outcomes.append(("refused", err.identity))
                    continue
                if type(msg) is Heartbeat:
                    outcomes.append(("heartbeat", len(prepared)))
                    continue
                # prepared before it was returned, not after
                outcomes.append((msg.request_ids[0], prepared.get(msg.request_ids[0])))
                if len(outcomes) == 1:
                    waiting.append(len(channel._received))
        return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes == [
        ("r0", "intake"),
        ("r1", "intake"),
        ("r2", "intake"),
        ("refused", b"peer-1"),
        ("r4", "intake"),
        ("r5", "intake"),
        ("r6", "intake"),
        ("r7", "intake"),
        ("heartbeat", 7),  # decoded here: not one more prepared on the intake
    ]
    assert waiting == [8]  # the first recv took all nine, the Cancels to the intake
