"""Rollout workers whose last weight load failed, until they serve the newest version.

    WeightsUpdated(error) --failed--> kept: since when, which version, why
    every liveness tick   --due-->    resend: the newest version goes to the worker again
                                      (disk: the newest directory; stream: its chunks;
                                      collective: the group re-broadcasts it)
                                      lose: failing for longer than the heartbeat timeout;
                                      the worker is treated as lost (restarted, its work
                                      re-queued; a worker that keeps failing ends the run
                                      with its reason, as any worker that keeps dying does)
    WeightsUpdated(version >= newest) --loaded--> forgotten

A failed load never leaves a worker silently holding its requests: it serves its previous
weights meanwhile (the staleness bound is the controller's, on the trainer's version), and
the next version the trainer publishes usually replaces one that was pruned or unreadable.
This module decides; the controller sends.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class LoadFailure:
    since: float
    version: int
    error: str
    attempts: int = 1


class WeightRetries:
    def __init__(self, give_up_after_s: float) -> None:
        self.give_up_after_s = give_up_after_s
        self.failing: dict[str, LoadFailure] = {}
        """By worker id."""
        self.num_failed = 0
        """Failed loads over the run."""

    def failed(self, worker_id: str, version: int, error: str, now: float) -> LoadFailure:
        self.num_failed += 1
        failure = self.failing.get(worker_id)
        if failure is None:
            failure = self.failing[worker_id] = LoadFailure(since=now, version=version,
                                                            error=error)
        else:
            failure.version, failure.error = version, error
            failure.attempts += 1
        return failure

    def loaded(self, worker_id: str, version: int, newest: int) -> None:
        if version >= newest:
            self.failing.pop(worker_id, None)

    def forget(self, worker_id: str) -> None:
        self.failing.pop(worker_id, None)

    def due(self, now: float) -> tuple[list[str], list[tuple[str, LoadFailure]]]:
        """(worker ids to send the newest version again, (worker id, failure) to lose)."""
        resend, lose = [], []
        for worker_id, failure in self.failing.items():
            if now - failure.since > self.give_up_after_s:
                lose.append((worker_id, failure))
            else:
                resend.append(worker_id)
        return resend, lose
