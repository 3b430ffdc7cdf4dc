"""What the controller's handshake monitor may log for a plain-TCP peer against CurveZMQ.

Which side notices the mechanism mismatch first is a race: the controller either reads the
peer's NULL greeting (`zmtp_mechanism_mismatch`) or finds the connection already closed by the
peer, which saw the controller's CURVE greeting first (EPIPE / ECONNRESET, no detail).
"""

from __future__ import annotations

import errno
import os

PLAIN_PEER_REASONS = (
    "zmtp_mechanism_mismatch",
    f"no detail: {os.strerror(errno.EPIPE)}",
    f"no detail: {os.strerror(errno.ECONNRESET)}",
)


def is_plain_peer_refusal(reason: str) -> bool:
    return reason in PLAIN_PEER_REASONS
