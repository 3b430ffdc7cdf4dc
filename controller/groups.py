"""The torch.distributed process groups the controller forms among its workers.

    trainer group   after all R trainer ranks are Ready: JoinGroup(trainer, 1, rank, R,
                    backend, store of rank 0) to each -> wait for R GroupStatus(JOINED);
                    a FAILED one or the timeout fails the run, naming the rank and the fix.
                    A lost rank: every rank is restarted from the newest checkpoint
                    (controller.py) and the group formed again, generation + 1.
    weights group   (weight_sync.mode=collective) rank 0 = trainer rank 0 (the sender),
                    ranks 1.. = rollout workers. For each published version:
                      members changed or a failure reported -> re-form: generation + 1,
                          JoinGroup to every member (trainer rank 0 included)
                      UpdateWeights(collective, version, generation, manifest) to each
                          rollout member, then BroadcastWeights(version, generation) to
                          trainer rank 0
                    A rollout worker that becomes Ready while a version exists (late joiner,
                    restart) gets the group re-formed and the current version broadcast
                    again, before it can be sent any work. A member lost marks the group
                    for re-forming at the next version. A GroupStatus(FAILED) of the current
                    generation (a broadcast or rendezvous failed, e.g. a member died in it)
                    also asks for the current version again: the liveness loop's `tick`,
                    after lost workers are forgotten, re-forms the group and re-broadcasts.

Every step here only sends messages: nothing waits inside the receive loop. Each member
handles its JoinGroup, UpdateWeights and BroadcastWeights in order on one thread, so a
broadcast always runs in the generation it was announced for.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from areal.config import RunConfig
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.messages import (
    BroadcastWeights, GroupName, GroupState, GroupStatus, Heartbeat, JoinGroup, UpdateWeights,
    WorkerKind,
)
from areal.transport import RouterChannel

log = logging.getLogger(__name__)


class GroupError(RuntimeError):
    """A process group could not be formed; the text names the members and the fix."""


def trainer_backend(cfg: RunConfig) -> str:
    backend = cfg.trainer.dist_backend
    if backend == "auto":
        devices = cfg.trainer.devices
        return "nccl" if devices and all(d.startswith("cuda") for d in devices) else "gloo"
    return backend


def weights_backend(cfg: RunConfig) -> str:
    """auto: NCCL only when trainer rank 0 and every rollout worker are placed on GPUs."""
    backend = cfg.weight_sync.backend
    if backend == "auto":
        gpus = [*cfg.trainer.devices[:1], *cfg.rollout.devices]
        both = cfg.trainer.devices and cfg.rollout.devices
        return "nccl" if both and all(d.startswith("cuda") for d in gpus) else "gloo"
    return backend


class Groups:
    def __init__(self, cfg: RunConfig, channel: RouterChannel, pool: WorkerPool,
                 record_event: Callable[..., None]) -> None:
        self.cfg = cfg
        self.channel = channel
        self.pool = pool
        self.record_event = record_event
        self.store = ""
        """Trainer rank 0's TCPStore (Ready.store)."""
        self.trainer_generation = 0
        """How often the trainer group was formed (again after its ranks were restarted)."""
        self._trainer_status: dict[int, GroupStatus] = {}
        self._trainer_done = asyncio.Event()
        # weights group
        self.generation = 0
        self.members: list[bytes] = []
        """Rollout identities of the current generation, in rank order (rank = index + 1)."""
        self.manifest: list[dict[str, Any]] = []
        self.num_reformed = 0
        self._dirty = False
        """Re-form before the next broadcast."""
        self._resend = False
        """Broadcast the current version again at the next tick."""

    def on_ready(self, handle: WorkerHandle, store: str) -> None:
        if handle.kind is WorkerKind.TRAINER and handle.rank == 0 and store:
            self.store = store

    def on_status(self, handle: WorkerHandle, msg: GroupStatus) -> None:
        self.record_event(f"{msg.group.value}_group_{msg.state.value}", worker_id=handle.worker_id,
                          generation=msg.generation, error=msg.error)
        if msg.group is GroupName.TRAINER:
            if msg.generation != self.trainer_generation:
                return  # from ranks stopped since
            self._trainer_status[handle.rank] = msg
            if msg.state is GroupState.FAILED or \
                    len(self._trainer_status) == self.cfg.trainer.num_ranks:
                self._trainer_done.set()
        elif msg.state is GroupState.FAILED and msg.generation == self.generation:
            log.warning("weights group generation %d: %s reported %s", msg.generation,
                        handle.worker_id, msg.error)
            self._dirty = self._resend = True

    # -- the trainer group ----------------------------------------------------------------------

    async def form_trainer_group(self) -> None:
        """JoinGroup to every rank; returns when all joined. Raises GroupError."""
        ranks = sorted(self.pool.ready(WorkerKind.TRAINER), key=lambda h: h.rank)
        num_ranks = self.cfg.trainer.num_ranks
        if not self.store:
            raise GroupError("trainer rank 0 announced no TCPStore address in Ready")
        timeout = self.cfg.trainer.dist_timeout_s
        self.trainer_generation += 1
        self._trainer_status = {}
        self._trainer_done = asyncio.Event()
        for handle in ranks:
            await self.channel.send(handle.identity, JoinGroup(
                group=GroupName.TRAINER, generation=self.trainer_generation, rank=handle.rank,
                world_size=num_ranks,
                backend=trainer_backend(self.cfg), store=self.store, timeout_s=timeout))
        try:
            await asyncio.wait_for(self._trainer_done.wait(), timeout + 30)
        except asyncio.TimeoutError:
            missing = sorted(set(range(num_ranks)) - set(self._trainer_status))
            raise GroupError(
                f"trainer ranks {missing} did not join the data-parallel group at {self.store} "
                f"within {timeout + 30:.0f} s; they must reach that address (trainer.store_host) "
                "and each other (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)") from None
        failed = {r: s.error for r, s in self._trainer_status.items()
                  if s.state is GroupState.FAILED}
        if not failed and len(self._trainer_status) < num_ranks:
            raise GroupError("a trainer rank was lost while the data-parallel group formed")
        if failed:
            raise GroupError(f"trainer ranks could not join the data-parallel group at "
                             f"{self.store}: {failed}")
        log.info("data-parallel trainer group of %d ranks formed at %s", num_ranks, self.store)

    def trainer_group_lost(self) -> None:
        """Every trainer rank is being restarted: the new rank 0 announces a new TCPStore, and
        the weights group (collective mode), whose sender it is, must be re-formed."""
        self.store = ""
        self._dirty = True
        self._trainer_done.set()  # a formation in progress ends now, incomplete

    # -- the weights group ----------------------------------------------------------------------

    def _sender(self) -> WorkerHandle | None:
        return next((h for h in self.pool.ready(WorkerKind.TRAINER) if h.rank == 0), None)

    async def _wanted_members(self, joining: WorkerHandle | None) -> list[bytes]:
        """Ready rollout workers (and `joining`) that are still connected: a Heartbeat to a
        peer whose connection closed fails at once (ROUTER_MANDATORY), long before the
        liveness loop declares a remote worker lost, and a group must not wait for it."""
        handles = self.pool.ready(WorkerKind.ROLLOUT)
        if joining is not None and joining not in handles:
            handles.append(joining)
        return [h.identity for h in handles if await self.channel.send(h.identity, Heartbeat())]

    async def _reform(self, members: list[bytes]) -> None:
        sender = self._sender()
        self.generation += 1
        self.members, self._dirty = members, False
        if self.generation > 1:
            self.num_reformed += 1
        log.info("weights group generation %d: trainer rank 0 + %d rollout workers",
                 self.generation, len(members))
        common = dict(group=GroupName.WEIGHTS, generation=self.generation,
                      world_size=len(members) + 1, backend=weights_backend(self.cfg),
                      store=self.store, timeout_s=self.cfg.weight_sync.timeout_s)
        await self.channel.send(sender.identity, JoinGroup(rank=0, **common))
        for rank, identity in enumerate(members, start=1):
            await self.channel.send(identity, JoinGroup(rank=rank, **common))

    async def publish(self, version: int, manifest: list[dict[str, Any]], interrupt: bool,
                      joining: WorkerHandle | None = None) -> None:
        """Broadcast `version` to every rollout worker (and `joining`, not yet ready),
        re-forming the group first if its members changed or it failed."""
        if manifest:
            self.manifest = manifest
        members = await self._wanted_members(joining)
        self._resend = False
        if not members or self._sender() is None or not self.manifest:
            self._dirty = True
            return
        if self._dirty or members != self.members:
            await self._reform(members)
        update = UpdateWeights(version=version, mode="collective", interrupt=interrupt,
                               generation=self.generation, manifest=self.manifest)
        for identity in self.members:
            await self.channel.send(identity, update)
        await self.channel.send(self._sender().identity,
                                BroadcastWeights(version=version, generation=self.generation))

    def request_resend(self) -> None:
        """A member could not load the current version: broadcast it again at the next tick
        (in a re-formed group)."""
        self._dirty = self._resend = True

    def member_lost(self, handle: WorkerHandle) -> None:
        if handle.identity in self.members:
            self._dirty = True

    async def tick(self, version: int, interrupt: bool) -> None:
        """Liveness loop: re-form and re-broadcast after a failure."""
        if self._resend and version > 0 and self.manifest:
            await self.publish(version, [], interrupt)
