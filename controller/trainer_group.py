"""The trainer ranks' data-parallel torch.distributed group, formed by the controller.

    after all R trainer ranks are Ready: JoinGroup(trainer, generation, rank, R, backend,
    store of rank 0) to each -> wait for R GroupStatus(JOINED); a FAILED one or the timeout
    fails the formation (GroupError), naming the ranks and the fix. Every rank restarted
    (one was lost): the new rank 0 announces a new TCPStore, and the group is formed again,
    generation + 1.

Owns trainer rank 0's TCPStore address (Ready.store), which the weights group of collective
weight sync rendezvouses at too, and the state of the formation in progress.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from areal.config import RunConfig
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.messages import GroupName, GroupState, GroupStatus, JoinGroup, WorkerKind

log = logging.getLogger(__name__)


class GroupError(RuntimeError):
    """A process group could not be formed; the text names the members and the fix."""


def trainer_backend(cfg: RunConfig) -> str:
    backend = cfg.trainer.dist_backend
    if backend == "auto":
        devices = cfg.trainer.devices
        return "nccl" if devices and all(d.startswith("cuda") for d in devices) else "gloo"
    return backend


class TrainerGroup:
    def __init__(
        self, cfg: RunConfig, pool: WorkerPool, send: Callable[[Outbox], Awaitable[None]]
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.send = send
        self.store = ""
        """Trainer rank 0's TCPStore (Ready.store); empty while every rank restarts."""
        self.generation = 0
        """How often the group was formed (again after its ranks were restarted)."""
        self._status: dict[int, GroupStatus] = {}
        self._done = asyncio.Event()

    def on_ready(self, handle: WorkerHandle, store: str) -> None:
        if handle.kind is WorkerKind.TRAINER and handle.rank == 0 and store:
            self.store = store

    def on_status(self, handle: WorkerHandle, msg: GroupStatus) -> None:
        if msg.generation != self.generation:
            return  # from ranks stopped since
        self._status[handle.rank] = msg
        if msg.state is GroupState.FAILED or len(self._status) == self.cfg.trainer.num_ranks:
            self._done.set()

    async def form(self) -> None:
        """JoinGroup to every rank; returns when all joined. Raises GroupError."""
        ranks = sorted(self.pool.ready(WorkerKind.TRAINER), key=lambda h: h.rank)
        num_ranks = self.cfg.trainer.num_ranks
        if not self.store:
            raise GroupError("trainer rank 0 announced no TCPStore address in Ready")
        timeout = self.cfg.trainer.dist_timeout_s
        self.generation += 1
        self._status = {}
        self._done = asyncio.Event()
        out = Outbox()
        for handle in ranks:
            out.send(
                handle.address,
                JoinGroup(
                    group=GroupName.TRAINER,
                    generation=self.generation,
                    rank=handle.rank,
                    world_size=num_ranks,
                    backend=trainer_backend(self.cfg),
                    store=self.store,
                    timeout_s=timeout,
                ),
            )
        await self.send(out)
        try:
            await asyncio.wait_for(self._done.wait(), timeout + 30)
        except TimeoutError:
            missing = sorted(set(range(num_ranks)) - set(self._status))
            raise GroupError(
                f"trainer ranks {missing} did not join the data-parallel group at {self.store} "
                f"within {timeout + 30:.0f} s; they must reach that address (trainer.store_host) "
                "and each other (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
            ) from None
        failed = {r: s.error for r, s in self._status.items() if s.state is GroupState.FAILED}
        if not failed and len(self._status) < num_ranks:
            raise GroupError("a trainer rank was lost while the data-parallel group formed")
        if failed:
            raise GroupError(
                f"trainer ranks could not join the data-parallel group at {self.store}: {failed}"
            )
        log.info("data-parallel trainer group of %d ranks formed at %s", num_ranks, self.store)

    def lost(self) -> None:
        """Every rank is being restarted: a formation in progress ends now, incomplete, and
        the new rank 0 announces a new TCPStore."""
        self.store = ""
        self._done.set()
