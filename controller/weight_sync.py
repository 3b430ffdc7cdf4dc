"""Weight synchronisation: how each new policy version reaches the rollout workers.

One interface, one implementation per `weight_sync.mode`, so that nothing else in the
controller branches on the mode:

    disk        the trainer writes weights/v<n>/ (safetensors); UpdateWeights names the
                directory; a joining worker loads the newest version directory there is
    stream      the trainer sends the weights as WeightsChunks through the controller, which
                relays them to every rollout worker and keeps the newest version's chunks
                for workers that join later or failed to load them
    collective  trainer rank 0 broadcasts them in a torch.distributed group with the
                rollout workers (weights_group.py)
    shm         trainer rank 0 writes them into shared-memory slots on this host
                (areal.models.weight_slots); UpdateWeights names the slot file; a joining
                worker, or one whose load failed, is sent the newest version's slot

Every mode owns the policy version in force (`version`: the newest the trainer published),
where its weights are (`latest`), and the workers whose last load failed (`retries`,
weight_retry.py). After a resume, until the trainer publishes a new version, every mode
serves the checkpoint's weights from disk (`restore`).

    Register (rollout) --welcome--> the version and weights path of its Welcome;
                       --after_welcome--> stream: the current version's chunks
    Ready              --on_ready--> collective: the group re-formed with it, the version
                       broadcast again, before it can take work
    Trained (rank 0)   --publish--> version + 1, announced to every ready rollout worker
    WeightsChunk       --on_chunk--> stream: relayed and kept
    WeightsUpdated     --on_updated--> served, or its load failed: one retry owed
    liveness tick      --retry--> the newest weights there are, sent again (or the worker is
                       lost after too many failures); collective: --tick--> re-broadcast

Decisions only: what to send goes into an Outbox. Modes that must know which rollout workers
are still connected before they decide (collective) name them in `candidates`; the shell
probes them and passes the reachable ones in as `members`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from collections.abc import Callable

from areal.config import RunConfig
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.controller.weight_retry import WeightRetries, newest_on_disk
from areal.messages import (
    GroupStatus,
    Trained,
    UpdateWeights,
    WeightsChunk,
    WeightsUpdated,
    WorkerKind,
)

log = logging.getLogger("areal.controller")


class WeightSync:
    """What every mode shares; `DiskSync`, `StreamSync` and `CollectiveSync` differ in how a
    version is announced and sent again."""

    mode = ""

    def __init__(
        self, cfg: RunConfig, run_dir: Path, pool: WorkerPool, record_event: Callable[..., None]
    ) -> None:
        self.run_dir = run_dir
        self.pool = pool
        self.record_event = record_event
        self.interrupt = cfg.mode == "async" and cfg.rollout.interrupt
        """Whether a new version interrupts generations in flight (async mode only)."""
        self.version = 0
        """The policy version in force: the newest the trainer published."""
        self.latest: str | None = None
        """The newest version's weights directory (disk mode), or a resumed checkpoint's."""
        self.resumed_version: int | None = None
        """The version a resumed run started from: until a newer one is published, workers
        load the checkpoint's weights from disk, whatever the mode."""
        self.retries = WeightRetries()

    def restore(self, version: int, weights_path: str) -> None:
        """Continue from a checkpoint's weights at `version`."""
        self.version = self.resumed_version = version
        self.latest = weights_path

    # -- joining workers ------------------------------------------------------------------------

    def _from_disk(self) -> bool:
        return self.version == self.resumed_version

    def welcome(self, handle: WorkerHandle) -> tuple[int, str | None]:
        """(version, weights path) for the Welcome of a registering worker: a rollout worker
        loads the weights at the path, if any, before it is ready; a trainer rank loads its
        checkpoint instead."""
        if handle.kind is WorkerKind.TRAINER or not self._from_disk():
            return self.version, None
        if self.version > 0:  # the newest version directory there is, if it was deleted
            return newest_on_disk(self.run_dir, self.latest, self.version) or (
                self.version,
                self.latest,
            )
        return self.version, self.latest

    def after_welcome(self, handle: WorkerHandle, out: Outbox) -> None:
        """What a registered worker gets after its Welcome (nothing, but in stream mode)."""

    def candidates(self, joining: WorkerHandle | None = None) -> list[WorkerHandle]:
        """Rollout workers whose connection must be checked before `publish` or `on_ready`
        (`joining`: one becoming ready); none but in collective mode."""
        return []

    def on_ready(self, handle: WorkerHandle, members: list[bytes], out: Outbox) -> None:
        """`handle` became ready (before it is given work; `handle.version` is what it
        serves). A rollout worker behind the version in force is sent the newest weights
        there are, which it loads before its first Generate: versions published while it
        set up were announced only to the workers ready then, and the weights its Welcome
        named may have been pruned before it loaded them (it is then ready at version 0)."""
        if handle.kind is WorkerKind.ROLLOUT and handle.version < self.version:
            self._resend(handle, self.version + 1, out)

    # -- new versions ---------------------------------------------------------------------------

    def publish(self, trained: Trained, members: list[bytes], out: Outbox) -> None:
        """The trainer published `trained.version`: it is the version in force, and every
        ready rollout worker is told to serve it."""
        self.version = trained.version
        self.latest = trained.weights_path
        self._announce(trained, members, out)

    def _announce(self, trained: Trained, members: list[bytes], out: Outbox) -> None:
        update = UpdateWeights(
            version=trained.version,
            mode=self.mode,
            path=trained.weights_path,
            num_chunks=trained.num_chunks,
            interrupt=self.interrupt,
        )
        for handle in self.pool.ready(WorkerKind.ROLLOUT):
            out.send(handle.address, update)

    def on_chunk(self, msg: WeightsChunk, out: Outbox) -> str:
        """A chunk of the version being published; '' when taken, else why it is refused."""
        return f"a WeightsChunk in weight_sync.mode={self.mode!r}, which sends no chunks"

    def on_group_status(self, handle: WorkerHandle, msg: GroupStatus) -> None:
        """A weights group member reported (collective mode only)."""

    def member_lost(self, handle: WorkerHandle) -> None:
        """A worker is gone."""
        self.retries.loaded(handle.worker_id)  # a new process starts afresh

    def trainers_lost(self) -> None:
        """Every trainer rank is being restarted."""

    # -- loads ----------------------------------------------------------------------------------

    def on_updated(self, handle: WorkerHandle, msg: WeightsUpdated) -> None:
        """A rollout worker's answer to UpdateWeights: it serves `msg.version`, or its load
        failed and a retry is owed (at the next liveness tick)."""
        if msg.error:
            failure = self.retries.failed(handle.worker_id, msg.version, msg.error)
            log.warning(
                "%s could not load weights version %d (%d in a row): %s; sending the "
                "newest weights again",
                handle.worker_id,
                msg.version,
                failure.attempts,
                msg.error,
            )
            self.record_event(
                "weights_load_failed",
                worker_id=handle.worker_id,
                failed_version=msg.version,
                error=msg.error,
                attempt=failure.attempts,
            )
            return
        handle.version = msg.version
        self.retries.loaded(handle.worker_id)

    def retry(self, out: Outbox) -> list[tuple[WorkerHandle, str]]:
        """The newest weights there are, sent again to each worker owed a retry; returns the
        workers that failed too often in a row, to be lost (restarted)."""
        due, give_up = self.retries.due()
        ready = {h.worker_id: h for h in self.pool.ready(WorkerKind.ROLLOUT)}
        lost = [
            (
                ready[worker_id],
                f"could not load weights ({failure.attempts} failures in a "
                f"row, the last of version {failure.version}): {failure.error}",
            )
            for worker_id, failure in give_up
            if worker_id in ready
        ]
        for worker_id, failure in due:
            handle = ready.get(worker_id)
            if handle is None or not self._resend(handle, failure.version, out):
                self.retries.loaded(worker_id)  # gone, or it serves the newest there is
        return lost

    def _resend(self, handle: WorkerHandle, failed: int, out: Outbox) -> bool:
        """Send `handle` the newest weights older than the `failed` version; False when there
        is nothing newer than what it serves (the trainer's next version will be)."""
        version, path = newest_on_disk(self.run_dir, self.latest, self.version, below=failed) or (
            0,
            None,
        )
        if version <= handle.version:
            return False
        out.send(
            handle.address,
            UpdateWeights(version=version, mode=self.mode, path=path, interrupt=self.interrupt),
        )
        return True

    def tick(self, members: list[bytes], out: Outbox) -> None:
        """The liveness loop's tick (collective mode: re-broadcast after a failure)."""

    def tick_candidates(self) -> list[WorkerHandle]:
        """Rollout workers whose connection `tick` needs checked (collective mode only)."""
        return []


class DiskSync(WeightSync):
    """weights/v<n>/ in the run directory, which every worker can read."""

    mode = "disk"

    def _from_disk(self) -> bool:
        return True


class StreamSync(WeightSync):
    """Chunks relayed through the controller; no shared file system needed."""

    mode = "stream"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunks: list[WeightsChunk] = []
        """The newest version's chunks so far, for workers that join or retry later."""
        self.num_chunks = 0
        """How many chunks the newest version has (its Trained says)."""
        self._welcomed: dict[str, int] = {}
        """The version whose chunks followed each joining rollout worker's Welcome, by
        worker id, until it is ready."""
        self._owed: set[str] = set()
        """Rollout workers (by id) to be sent the newest version whole once its last chunk
        is in: they joined, became ready or asked again while it was being published. A
        part of a version is never sent as if it were all of it."""

    def publish(self, trained: Trained, members: list[bytes], out: Outbox) -> None:
        self.chunks = []  # the trainer's chunks of this version follow its Trained
        self.num_chunks = trained.num_chunks
        self._owed -= {h.worker_id for h in self.pool.ready(WorkerKind.ROLLOUT)}  # announced
        super().publish(trained, members, out)

    def _complete(self) -> bool:
        return len(self.chunks) == self.num_chunks > 0

    def after_welcome(self, handle: WorkerHandle, out: Outbox) -> None:
        if handle.kind is WorkerKind.ROLLOUT and self.version > 0 and self.num_chunks:
            self._resend(handle, self.version + 1, out)
            self._welcomed[handle.worker_id] = self.version

    def on_ready(self, handle: WorkerHandle, members: list[bytes], out: Outbox) -> None:
        """As every mode, but a version whose chunks followed the worker's Welcome (or will,
        once all are in) is on its way already: not sent twice."""
        sent = self._welcomed.pop(handle.worker_id, 0)
        if handle.kind is WorkerKind.ROLLOUT and max(sent, handle.version) < self.version:
            self._resend(handle, self.version + 1, out)

    def member_lost(self, handle: WorkerHandle) -> None:
        super().member_lost(handle)
        self._welcomed.pop(handle.worker_id, None)
        self._owed.discard(handle.worker_id)

    def on_chunk(self, msg: WeightsChunk, out: Outbox) -> str:
        self.chunks.append(msg)
        for worker in self.pool.ready(WorkerKind.ROLLOUT):
            if worker.worker_id not in self._owed:  # those get the whole version below
                out.send(worker.address, msg)
        if self._complete() and self._owed:
            for worker in self.pool.by_identity.values():
                if worker.worker_id in self._owed:
                    self._send_chunks(worker, self.version, out)
            self._owed.clear()
        return ""

    def _resend(self, handle: WorkerHandle, failed: int, out: Outbox) -> bool:
        if self.version <= handle.version or not self.num_chunks:
            return False
        if self._complete():
            self._send_chunks(handle, self.version, out)
        else:  # chunks still coming
            self._owed.add(handle.worker_id)
        return True

    def _send_chunks(self, handle: WorkerHandle, version: int, out: Outbox) -> None:
        out.send(
            handle.address,
            UpdateWeights(
                version=version,
                mode=self.mode,
                num_chunks=len(self.chunks),
                interrupt=self.interrupt,
            ),
        )
        for chunk in self.chunks:
            out.send(handle.address, chunk)


class ShmSync(WeightSync):
    """Shared-memory slots on one host, written in turn: only the newest versions' slots
    hold them (weight_sync.keep_versions), so joining and retrying workers get the newest.
    Until a resumed run publishes, the checkpoint's directory (as every mode)."""

    mode = "shm"

    def welcome(self, handle: WorkerHandle) -> tuple[int, str | None]:
        if handle.kind is WorkerKind.TRAINER or self._from_disk() or self.latest is None:
            return super().welcome(handle)
        return self.version, self.latest

    def _resend(self, handle: WorkerHandle, failed: int, out: Outbox) -> bool:
        if self._from_disk():
            return super()._resend(handle, failed, out)
        if self.version <= handle.version or self.latest is None:
            return False
        out.send(
            handle.address,
            UpdateWeights(
                version=self.version, mode=self.mode, path=self.latest, interrupt=self.interrupt
            ),
        )
        return True


def make_weight_sync(
    cfg: RunConfig,
    run_dir: Path,
    pool: WorkerPool,
    record_event: Callable[..., None],
    store: Callable[[], str],
) -> WeightSync:
    """The implementation of `cfg.weight_sync.mode`; `store`: trainer rank 0's TCPStore
    address, where the collective weights group meets."""
    from areal.controller.weights_group import CollectiveSync

    modes: dict[str, Any] = {
        "disk": DiskSync,
        "stream": StreamSync,
        "collective": CollectiveSync,
        "shm": ShmSync,
    }
    sync = modes[cfg.weight_sync.mode]
    if sync is CollectiveSync:
        return CollectiveSync(cfg, run_dir, pool, record_event, store)
    return sync(cfg, run_dir, pool, record_event)
