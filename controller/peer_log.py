"""Warnings and event records about what peers did wrong, rate-limited, with counts.

A peer can send garbage as fast as the socket carries it; logging each message would let it
fill the disk and hold the event loop. Every refusal goes through `PeerLog.report(peer,
reason, detail)`: within each window of `window_s` seconds, the first `per_peer` reports of
one (reason, peer) and the first `per_reason` of one reason (over all peers) are written,
as a warning and an event record (kind 'event', event 'peer_refused'); the rest are only
counted. When a window with suppressed reports ends, one warning and one record per reason
say how many were suppressed and from how many peers. `totals` counts everything, for the
run's summary.

Peers are named by worker id once registered, else by a short hash of their ZeroMQ
identity (an identity is a credential: it is never written out). State is bounded: at most
`max_peers` distinct peers are tracked per window. This module sends nothing.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from typing import Any
from collections.abc import Callable

log = logging.getLogger("areal.controller")


def peer_name(identity: bytes) -> str:
    """How an unregistered peer is named in logs: a hash, not its identity."""
    return "peer " + hashlib.sha256(identity).hexdigest()[:10]


class PeerLog:
    def __init__(
        self,
        record_event: Callable[..., None],
        *,
        per_peer: int = 3,
        per_reason: int = 20,
        window_s: float = 60.0,
        max_peers: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.record_event = record_event
        self.per_peer = per_peer
        self.per_reason = per_reason
        self.window_s = window_s
        self.max_peers = max_peers
        self.clock = clock
        self.totals: collections.Counter[str] = collections.Counter()
        """Every report since the start, by reason."""
        self._window_start = clock()
        self._written: collections.Counter[tuple[str, str]] = collections.Counter()
        self._written_by_reason: collections.Counter[str] = collections.Counter()
        self._suppressed: collections.Counter[str] = collections.Counter()
        self._suppressed_peers: dict[str, set[str]] = collections.defaultdict(set)

    def report(self, peer: str, reason: str, detail: str, **fields: Any) -> bool:
        """Count one refusal; True when it was written (not suppressed)."""
        self.flush_if_due()
        self.totals[reason] += 1
        key = (reason, peer)
        if (
            self._written[key] >= self.per_peer
            or self._written_by_reason[reason] >= self.per_reason
            or (key not in self._written and len(self._written) >= self.max_peers)
        ):
            self._suppressed[reason] += 1
            peers = self._suppressed_peers[reason]
            if len(peers) < self.max_peers:
                peers.add(peer)
            return False
        self._written[key] += 1
        self._written_by_reason[reason] += 1
        log.warning("%s: %s (%s)", peer, reason, detail[:500])
        self.record_event("peer_refused", peer=peer, reason=reason, detail=detail[:500], **fields)
        return True

    def flush_if_due(self) -> None:
        """End the window if it is over (called on each report and by the liveness loop)."""
        if self.clock() - self._window_start >= self.window_s:
            self.flush()

    def flush(self) -> None:
        """Write what was suppressed in this window, and start a new one."""
        for reason, count in sorted(self._suppressed.items()):
            num_peers = len(self._suppressed_peers[reason])
            log.warning(
                "suppressed %d more '%s' reports from %s%d peers in the last %.0f s",
                count,
                reason,
                "at least " if num_peers >= self.max_peers else "",
                num_peers,
                self.clock() - self._window_start,
            )
            self.record_event(
                "peer_refused_suppressed", reason=reason, count=count, num_peers=num_peers
            )
        self._window_start = self.clock()
        self._written.clear()
        self._written_by_reason.clear()
        self._suppressed.clear()
        self._suppressed_peers.clear()
