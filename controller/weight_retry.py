"""Rollout workers whose last weight load failed, until they serve the newest weights there are.

    WeightsUpdated(error) --failed--> kept: which version, why, how many failures in a row;
                                      one retry owed
    next liveness tick    --due-->    retry: the newest weights that can be had go to the
                                      worker again (disk: the newest version directory with a
                                      weights file, older than the one that failed: after a
                                      deleted, pruned or corrupt version, the one before;
                                      stream: the newest version's chunks; collective: the
                                      group re-broadcasts it)
                                      lose: MAX_FAILURES failures in a row: the worker is
                                      treated as lost (restarted, its work re-queued; one that
                                      keeps failing ends the run, as any crash loop does)
    any successful load, or nothing newer to send  --> forgotten

A failed load never leaves a worker silently holding its requests: it serves its previous
weights meanwhile (tokens keep the version that sampled them; the staleness bound is the
controller's, on the trainer's version), and the next version the trainer publishes
replaces one that was pruned or unreadable. This module decides; the controller sends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MAX_FAILURES = 5
"""Failed loads in a row (each retried once) after which a rollout worker is lost."""

_VERSION_DIR = re.compile(r"v(\d+)")


@dataclass(kw_only=True)
class LoadFailure:
    version: int
    error: str
    attempts: int = 1
    retry_owed: bool = True


class WeightRetries:
    def __init__(self) -> None:
        self.failing: dict[str, LoadFailure] = {}
        """By worker id."""
        self.num_failed = 0
        """Failed loads over the run."""

    def failed(self, worker_id: str, version: int, error: str) -> LoadFailure:
        self.num_failed += 1
        failure = self.failing.get(worker_id)
        if failure is None:
            failure = self.failing[worker_id] = LoadFailure(version=version, error=error)
        else:
            failure.version, failure.error, failure.retry_owed = version, error, True
            failure.attempts += 1
        return failure

    def loaded(self, worker_id: str) -> None:
        self.failing.pop(worker_id, None)

    def due(self) -> tuple[list[tuple[str, LoadFailure]], list[tuple[str, LoadFailure]]]:
        """((worker id, failure) owed a retry now, (worker id, failure) to lose); marks the
        retries sent."""
        retry, lose = [], []
        for worker_id, failure in list(self.failing.items()):
            if failure.attempts >= MAX_FAILURES:
                lose.append((worker_id, self.failing.pop(worker_id)))
            elif failure.retry_owed:
                failure.retry_owed = False
                retry.append((worker_id, failure))
        return retry, lose


def newest_on_disk(
    run_dir: Path, latest: str | None, version: int, below: int | None = None
) -> tuple[int, str] | None:
    """(version, directory) of the newest disk weights a worker can load: `latest` (the
    current version's) while it holds a weights file, else the newest `weights/v<n>` that
    does, n <= version. `below`: only versions under it (one a worker failed to load)."""
    limit = version if below is None else min(version, below - 1)
    if latest and limit == version and _has_weights(Path(latest)):
        return version, latest
    found = []
    root = run_dir / "weights"
    for path in root.iterdir() if root.is_dir() else []:
        match = _VERSION_DIR.fullmatch(path.name)
        if match and int(match[1]) <= limit and _has_weights(path):
            found.append((int(match[1]), str(path)))
    return max(found, default=None)


def _has_weights(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))
