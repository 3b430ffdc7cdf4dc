"""Staleness-bounded admission of generation requests (docs/design.md section 5).

Role: the controller asks this object how many new trajectories it may start generating.
With batch size B (trajectories per training step), current policy version i (training
steps done) and bound eta, a request is admitted only while

    floor((N_r - 1) / B) <= i + eta,   i.e.   N_r <= (i + eta + 1) * B,

where N_r counts trajectories generated or in flight, including the one being admitted.
So the trajectory admitted as the k-th one can be at most eta versions older than the
step that will train on it if batches are consumed in admission order; eta = 0 admits
exactly one batch ahead of training (synchronous-equivalent).

Lifecycle of a slot, with the cumulative counters kept here:

    admit -> in flight --finish--> buffered --consume--> trained
                 |                     |
               abort                 reject
         (worker lost; requeued    (finished but never trained on, e.g. filtered
          and admitted again)       out; leaves room for a replacement)

Invariant (every call that would break it is refused, changing nothing): N_r = admitted - aborted - rejected
= in_flight + buffered + consumed, with in_flight >= 0 and buffered >= 0. Aborted and
rejected trajectories free their slot because they will never be trained on; counting
them would shrink the window for good and, with eta = 0, could deadlock the run (a batch
that can never be completed). Consumed trajectories keep theirs: the window moves only
when the version advances.

It does not track individual requests, versions of tokens or wall time, and takes the
current version from the caller (the controller owns it); it only refuses a version that
goes backwards.
"""

from __future__ import annotations

from typing import Any

_COUNTERS = ("num_admitted", "num_finished", "num_aborted", "num_rejected", "num_consumed")


class StalenessController:
    """Counts trajectories through their lifecycle and bounds admission by version."""

    def __init__(self, batch_size: int, eta: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1 (trainer.batch_size)")
        if eta < 0:
            raise ValueError(f"eta={eta!r} must be >= 0 (staleness.eta)")
        self.batch_size = batch_size
        self.eta = eta
        self.num_admitted = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_rejected = 0
        self.num_consumed = 0
        self._latest_version = 0

    @property
    def num_in_flight(self) -> int:
        """Admitted requests still generating."""
        return self.num_admitted - self.num_finished - self.num_aborted

    @property
    def num_buffered(self) -> int:
        """Finished trajectories waiting to be trained on."""
        return self.num_finished - self.num_rejected - self.num_consumed

    @property
    def num_live(self) -> int:
        """N_r without the one being admitted: in flight + buffered + consumed."""
        return self.num_admitted - self.num_aborted - self.num_rejected

    def resume(self, num_trained: int) -> None:
        """Start as a run that has trained `num_trained` trajectories and holds nothing else
        (resuming after a checkpoint: whatever was in flight is generated again)."""
        if self.num_admitted:
            raise RuntimeError("resume() is only for a fresh controller")
        self._check_count("resume", num_trained)
        self.num_admitted = self.num_finished = self.num_consumed = num_trained

    def capacity(self, version: int) -> int:
        """How many requests may be admitted now, at policy `version` (training steps done)."""
        self._check_version(version)
        return max(0, (version + self.eta + 1) * self.batch_size - self.num_live)

    def admit(self, n: int, version: int) -> None:
        """Record n new requests; raises (changing nothing) if that would break the bound."""
        self._check_count("admit", n)
        allowed = self.capacity(version)
        if n > allowed:
            raise ValueError(
                f"admitting {n} requests at version {version} would break the staleness bound "
                f"(batch_size={self.batch_size}, eta={self.eta}, {self.num_live} generated or "
                f"in flight): at most {allowed} may be admitted until the version advances"
            )
        self._latest_version = version
        self.num_admitted += n

    def finish(self, n: int = 1) -> None:
        """n in-flight requests produced their trajectories."""
        self._take("finish", n, self.num_in_flight, "in flight")
        self.num_finished += n

    def abort(self, n: int = 1) -> None:
        """n in-flight requests were lost (e.g. their worker died); their slots are freed.

        A requeued request must be admitted again, under the version current at that time.
        """
        self._take("abort", n, self.num_in_flight, "in flight")
        self.num_aborted += n

    def reject(self, n: int = 1) -> None:
        """n finished trajectories will never be trained on; their slots are freed."""
        self._take("reject", n, self.num_buffered, "buffered")
        self.num_rejected += n

    def consume(self, n: int) -> None:
        """n buffered trajectories were taken into a training batch."""
        self._take("consume", n, self.num_buffered, "buffered")
        self.num_consumed += n

    def state_dict(self) -> dict[str, int]:
        """Counters for a checkpoint (plain ints; msgpack/JSON friendly).

        After restoring, requests that were in flight at checkpoint time are gone: the
        controller should `abort(num_in_flight)` them and requeue their prompts.
        """
        state = {name: getattr(self, name) for name in _COUNTERS}
        state.update(batch_size=self.batch_size, eta=self.eta, latest_version=self._latest_version)
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StalenessController:
        controller = cls(int(state["batch_size"]), int(state["eta"]))
        for name in _COUNTERS:
            setattr(controller, name, int(state[name]))
        controller._latest_version = int(state["latest_version"])
        controller._check_invariant()
        return controller

    def metrics(self, version: int, prefix: str = "staleness/") -> dict[str, float]:
        """Occupancy of the window, for logging."""
        return {
            f"{prefix}in_flight": float(self.num_in_flight),
            f"{prefix}buffered": float(self.num_buffered),
            f"{prefix}capacity": float(self.capacity(version)),
        }

    def _take(self, action: str, n: int, available: int, where: str) -> None:
        self._check_count(action, n)
        if n > available:
            raise ValueError(f"cannot {action} {n} trajectories: only {available} are {where}")

    def _check_count(self, action: str, n: int) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{action}: n={n!r} must be a non-negative int")

    def _check_version(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"version={version!r} must be >= 0 (training steps done)")
        if version < self._latest_version:
            raise ValueError(
                f"version {version} is older than version {self._latest_version} already used "
                "for admission; policy versions only increase"
            )

    def _check_invariant(self) -> None:
        if min(self.num_in_flight, self.num_buffered, *(getattr(self, n) for n in _COUNTERS)) < 0:
            raise ValueError(f"inconsistent staleness counters: {self.state_dict()}")
