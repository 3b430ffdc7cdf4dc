"""Collective weight sync: trainer rank 0 broadcasts each version to the rollout workers in a
torch.distributed group (gloo on CPU, NCCL on GPUs) that the controller forms.

    rank 0 = trainer rank 0 (the sender), ranks 1.. = rollout workers, rendezvous at trainer
    rank 0's TCPStore. For each published version:
      members changed or a failure reported -> re-form: generation + 1, JoinGroup to every
          member (trainer rank 0 included)
      UpdateWeights(collective, version, generation, manifest) to each rollout member, then
          BroadcastWeights(version, generation) to trainer rank 0
    A rollout worker that becomes Ready while a version exists (late joiner, restart) gets
    the group re-formed and the current version broadcast again, before it can be sent any
    work. A member lost marks the group for re-forming at the next version. A
    GroupStatus(FAILED) of the current generation (a broadcast or rendezvous failed, e.g. a
    member died in it) also asks for the current version again: the liveness loop's `tick`,
    after lost workers are forgotten, re-forms the group and re-broadcasts.

Members are the rollout workers still connected: the shell checks the `candidates` (a
Heartbeat to a peer whose connection closed fails at once, long before the liveness loop
declares a remote worker lost) and passes the reachable ones in, so that a group never waits
for a departed member. Each member handles its JoinGroup, UpdateWeights and
BroadcastWeights in order on one thread, so a broadcast always runs in the generation it
was announced for.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from collections.abc import Callable

from areal.config import RunConfig
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.controller.weight_sync import WeightSync
from areal.messages import (
    BroadcastWeights,
    GroupName,
    GroupState,
    GroupStatus,
    JoinGroup,
    Trained,
    UpdateWeights,
    WorkerKind,
)

log = logging.getLogger(__name__)


def weights_backend(cfg: RunConfig) -> str:
    """auto: NCCL only when trainer rank 0 and every rollout worker are placed on GPUs."""
    backend = cfg.weight_sync.backend
    if backend == "auto":
        gpus = [*cfg.trainer.devices[:1], *cfg.rollout.devices]
        both = cfg.trainer.devices and cfg.rollout.devices
        return "nccl" if both and all(d.startswith("cuda") for d in gpus) else "gloo"
    return backend


class CollectiveSync(WeightSync):
    mode = "collective"

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        pool: WorkerPool,
        record_event: Callable[..., None],
        store: Callable[[], str],
    ) -> None:
        super().__init__(cfg, run_dir, pool, record_event)
        self.backend = weights_backend(cfg)
        self.timeout_s = cfg.weight_sync.timeout_s
        self.store = store
        """Trainer rank 0's TCPStore address (trainer_group.py)."""
        self.generation = 0
        self.members: list[bytes] = []
        """Rollout identities of the current generation, in rank order (rank = index + 1)."""
        self.manifest: list[dict[str, Any]] = []
        self.num_reformed = 0
        self._dirty = False
        """Re-form before the next broadcast."""
        self._resend_due = False
        """Broadcast the current version again at the next tick."""

    def _sender(self) -> WorkerHandle | None:
        return next((h for h in self.pool.ready(WorkerKind.TRAINER) if h.rank == 0), None)

    def candidates(self, joining: WorkerHandle | None = None) -> list[WorkerHandle]:
        if joining is not None and (joining.kind is not WorkerKind.ROLLOUT or self.version == 0):
            return []
        handles = self.pool.ready(WorkerKind.ROLLOUT)
        if joining is not None and joining not in handles:
            handles.append(joining)
        return handles

    def tick_candidates(self) -> list[WorkerHandle]:
        return self.candidates() if self._tick_due() else []

    def on_ready(self, handle: WorkerHandle, members: list[bytes], out: Outbox) -> None:
        if handle.kind is WorkerKind.ROLLOUT and self.version > 0:
            # Before it is ready for work: its first Generate must wait for this version.
            self._broadcast(self.version, members, out)

    def publish(self, trained: Trained, members: list[bytes], out: Outbox) -> None:
        self.version = trained.version
        self.latest = trained.weights_path
        if trained.manifest:
            self.manifest = trained.manifest
        self._broadcast(trained.version, members, out)

    def _broadcast(self, version: int, members: list[bytes], out: Outbox) -> None:
        """`version` to `members` (the connected rollout workers), re-forming the group first
        if its members changed or it failed."""
        self._resend_due = False
        sender = self._sender()
        if not members or sender is None or not self.manifest:
            self._dirty = True
            return
        if self._dirty or members != self.members:
            self._reform(sender, members, out)
        update = UpdateWeights(
            version=version,
            mode=self.mode,
            interrupt=self.interrupt,
            generation=self.generation,
            manifest=self.manifest,
        )
        for identity in self.members:
            out.send(identity, update)
        out.send(sender.address, BroadcastWeights(version=version, generation=self.generation))

    def _reform(self, sender: WorkerHandle, members: list[bytes], out: Outbox) -> None:
        self.generation += 1
        self.members, self._dirty = members, False
        if self.generation > 1:
            self.num_reformed += 1
        log.info(
            "weights group generation %d: trainer rank 0 + %d rollout workers",
            self.generation,
            len(members),
        )
        store = self.store()
        for rank, identity in enumerate([sender.address, *members]):
            out.send(
                identity,
                JoinGroup(
                    group=GroupName.WEIGHTS,
                    generation=self.generation,
                    rank=rank,
                    world_size=len(members) + 1,
                    backend=self.backend,
                    store=store,
                    timeout_s=self.timeout_s,
                ),
            )

    def on_group_status(self, handle: WorkerHandle, msg: GroupStatus) -> None:
        if msg.state is GroupState.FAILED and msg.generation == self.generation:
            log.warning(
                "weights group generation %d: %s reported %s",
                msg.generation,
                handle.worker_id,
                msg.error,
            )
            self._dirty = self._resend_due = True

    def member_lost(self, handle: WorkerHandle) -> None:
        super().member_lost(handle)
        if handle.identity in self.members:
            self._dirty = True

    def trainers_lost(self) -> None:
        self._dirty = True  # its sender, trainer rank 0, is restarted with a new store

    def _resend(self, handle: WorkerHandle, failed: int, out: Outbox) -> bool:
        """A member could not load the current version: it is broadcast again at the next
        tick, in a re-formed group."""
        self._dirty = self._resend_due = True
        return True

    def _tick_due(self) -> bool:
        return self._resend_due and self.version > 0 and bool(self.manifest)

    def tick(self, members: list[bytes], out: Outbox) -> None:
        if self._tick_due():
            self._broadcast(self.version, members, out)
