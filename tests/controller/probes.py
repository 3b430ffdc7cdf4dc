"""Hostile peers of a controller socket (issue 14, "Why" 4-8), as plain functions of its
address. Each connects its own DEALER(s), sends, waits until ZeroMQ has delivered, closes.

Run one in a separate process when the controller's memory is measured, so the sender's
buffers do not count: `python probes.py ADDRESS NAME [ARGS...]`.
"""

from __future__ import annotations

import random
import sys
import time

import msgpack
import numpy as np
import zmq

from areal.codec import decode, encode
from areal.messages import MsgType, Shutdown, WorkerKind
from registers import register

LINGER_MS = 60_000
"""How long close() waits for queued messages to reach the controller."""


def stats_bomb_header(num_entries: int = 1 << 20) -> bytes:
    """A Heartbeat header holding a map of `num_entries` distinct keys under "stats" (a
    field Heartbeats once had): 8 MB at 2^20, the probe that once held the controller's loop
    for ~3 s per message."""
    records = np.zeros(num_entries, dtype=[("prefix", "u1"), ("key", "S7"), ("value", "u1")])
    records["prefix"] = 0xA7  # fixstr of 7 bytes
    records["key"] = np.char.zfill(np.arange(num_entries).astype("S7"), 7)
    return (
        b"\x81"
        + msgpack.packb("stats")
        + b"\xdf"
        + num_entries.to_bytes(4, "big")
        + records.tobytes()
    )


def _dealer(ctx: zmq.Context, address: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def _send_all(address: str, messages, identity: bytes | None = None) -> int:
    ctx = zmq.Context()
    sock = _dealer(ctx, address, identity)
    count = 0
    for frames in messages:
        sock.send_multipart(frames, copy=False)
        count += 1
    sock.close()  # lingers until delivered
    ctx.term()
    return count


def heartbeat_bombs(address: str, count: int = 16, num_entries: int = 1 << 20) -> int:
    header = stats_bomb_header(num_entries)
    return _send_all(address, ([bytes([MsgType.HEARTBEAT]), header] for _ in range(count)))


def big_frames(address: str, count: int = 3, size: int = 100 << 20) -> int:
    payload = bytes(size)
    return _send_all(address, ([bytes([MsgType.HEARTBEAT]), payload] for _ in range(count)))


def garbage(address: str, count: int = 20_000, seed: int = 0) -> int:
    """Messages that are each refused once: random bytes, unknown type bytes, other kinds
    than Register, truncated and mangled Registers."""
    rng = random.Random(seed)
    forged = encode(register(WorkerKind.ROLLOUT, "g", "x"))

    def one(i: int) -> list[bytes]:
        pick = i % 5
        if pick == 0:
            return [rng.randbytes(rng.randint(1, 64)) for _ in range(rng.randint(1, 3))]
        if pick == 1:
            return [bytes([rng.choice([0, 20, 99, 255])]), rng.randbytes(16)]
        if pick == 2:
            kind = rng.choice([k for k in MsgType if k is not MsgType.REGISTER])
            return [bytes([kind]), rng.randbytes(rng.randint(0, 256))]
        if pick == 3:
            return [forged[0], forged[1][: rng.randint(0, len(forged[1]) - 1)]]
        return [forged[0], msgpack.packb({"kind": "rollout", "worker_id": rng.random()})]

    return _send_all(address, (one(i) for i in range(count)))


def forged_registers(address: str, count: int = 1000, num_peers: int = 1) -> int:
    """Registrations with a wrong secret, spread over `num_peers` connections."""
    sent = 0
    for peer in range(num_peers):
        share = count // num_peers + (peer < count % num_peers)
        sent += _send_all(
            address,
            (
                encode(
                    register(WorkerKind.ROLLOUT, f"forged-{peer}-{i}", "wrong", pid=i, host="evil")
                )
                for i in range(share)
            ),
        )
    return sent


def flood(
    address: str,
    num_garbage: int = 20_000,
    num_forged: int = 1000,
    num_forged_peers: int = 1,
    num_spread: int = 100,
    num_spread_peers: int = 50,
) -> int:
    """`garbage`, then `forged_registers` from one peer, then spread over many peers."""
    return (
        garbage(address, num_garbage)
        + forged_registers(address, num_forged, num_forged_peers)
        + forged_registers(address, num_spread, num_spread_peers)
    )


class Pinger:
    """Asks the controller something it must answer: a registration (refused, wrong secret)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = _dealer(self.ctx, address)
        self.sock.setsockopt(zmq.LINGER, 0)

    def ping(self, timeout_s: float = 30.0) -> float:
        """Seconds until the answer; TimeoutError when there is none: the loop is held."""
        start = time.monotonic()
        self.sock.send_multipart(
            encode(register(WorkerKind.REWARD, "ping", "wrong", pid=0, host="probe"))
        )
        if not self.sock.poll(timeout_s * 1000):
            raise TimeoutError(f"no answer from the controller within {timeout_s} s")
        reply = decode(self.sock.recv_multipart())
        assert isinstance(reply, Shutdown), reply
        return time.monotonic() - start

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # closes its socket, then terminates

    def __enter__(self) -> Pinger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ping(address: str, timeout_s: float = 30.0) -> float:
    pinger = Pinger(address)
    try:
        return pinger.ping(timeout_s)
    finally:
        pinger.close()


if __name__ == "__main__":
    address, name, *args = sys.argv[1:]
    print(globals()[name](address, *map(int, args)))
