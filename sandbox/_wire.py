"""Framing between the caller, the launcher and its per-run supervisors (local unix socket).

One message is `[u32 header length][JSON header][blob 0][blob 1]...`; the header lists the
blob sizes under `"blobs"`. Program text, stdin and outputs travel as raw blobs (no base64,
no pickle). The socket is created by the launcher in a 0700 directory.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20


class WireError(ConnectionError):
    """The peer closed the connection early or sent a malformed message."""


def encode(header: dict[str, Any], blobs: list[bytes]) -> bytes:
    payload = json.dumps({**header, "blobs": [len(b) for b in blobs]}).encode()
    return b"".join([_LEN.pack(len(payload)), payload, *blobs])


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise WireError(f"connection closed after {got} of {size} bytes")
        got += n
    return bytes(buf)


def _split(header_bytes: bytes) -> tuple[dict[str, Any], list[int]]:
    try:
        header = json.loads(header_bytes)
        sizes = [int(s) for s in header.pop("blobs")]
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"malformed header: {exc}") from exc
    return header, sizes


def _header_length(raw: bytes) -> int:
    (length,) = _LEN.unpack(raw)
    if length > MAX_HEADER_BYTES:
        raise WireError(f"header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    return length


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[bytes]]:
    """Blocking read of one message (use sock.settimeout for a deadline)."""
    length = _header_length(_recv_exactly(sock, _LEN.size))
    header, sizes = _split(_recv_exactly(sock, length))
    return header, [_recv_exactly(sock, size) for size in sizes]


async def recv_async(reader: Any) -> tuple[dict[str, Any], list[bytes]]:
    """The same from an asyncio StreamReader."""
    import asyncio

    try:
        length = _header_length(await reader.readexactly(_LEN.size))
        header, sizes = _split(await reader.readexactly(length))
        return header, [await reader.readexactly(size) for size in sizes]
    except asyncio.IncompleteReadError as exc:
        raise WireError(f"connection closed after {len(exc.partial)} bytes") from exc
