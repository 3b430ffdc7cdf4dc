"""Generation requests: which rollout worker takes each pending sample, and cancelling them.

    ledger.pending --dispatch--> each sample to the least-loaded ready rollout worker with
                                 room (room.py: max_concurrent + max_queued), a group's
                                 samples to one worker in one Generate
    a dropped group's samples being generated --cancel--> Cancel to their workers
    training ends --cancel_training--> Cancel of every training generation; training samples
                                 not yet sent are forgotten (evaluations still run)

Owns the rollout workers' room (who has capacity, least loaded first). Decisions only:
every method writes what to send into an Outbox.
"""

from __future__ import annotations

from areal import clock
from areal.config import RunConfig
from areal.controller.episodes import episode_fields
from areal.controller.ledger import Group, Ledger, Purpose, Sample, Stage
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.controller.room import WorkerRoom
from areal.messages import Cancel, Generate
from areal.seeds import eval_group_seeds, train_group_seeds


class Generation:
    def __init__(
        self, cfg: RunConfig, ledger: Ledger, pool: WorkerPool, stop_token_ids: list[int]
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pool = pool
        self.stop_token_ids = stop_token_ids
        self.room = WorkerRoom(cfg.rollout.max_concurrent + cfg.rollout.max_queued)
        """Rollout workers below max_concurrent + max_queued requests, least loaded first."""

    def can_dispatch(self) -> bool:
        return bool(self.ledger.pending and self.room.peek())

    def dispatch(self, out: Outbox) -> None:
        """Each pending sample, in order, to the least-loaded rollout worker with room: fewer
        requests than rollout.max_concurrent (what its engine decodes at once) plus
        rollout.max_queued (what it queues). The samples of one group that go to one worker
        in this call go in one Generate: when a worker's answer frees room for several, the
        next samples, mostly of one group, go to it in one message (the controller's cost is
        per message); when many workers have room (the start), a group is spread over them,
        as its samples' lengths go together (a hard prompt's are all long)."""
        pending, start = self.ledger.pending, self.ledger.start_generation
        batches: dict[tuple[int, int], tuple[WorkerHandle, list[Sample]]] = {}
        now = clock.now()
        while pending:
            turn = self.room.take_turns(len(pending))
            if turn is None:
                break
            worker, count = turn  # the samples one at a time would go to it `count` times
            address, in_flight = worker.address, worker.in_flight
            for _ in range(count):
                sample = pending.popleft()
                start(sample, address, now)
                in_flight.add(sample.request_id)
                batches.setdefault((id(worker), sample.group_id), (worker, []))[1].append(sample)
            self.room.offer(worker)
        for worker, samples in batches.values():
            out.send(worker.address, self._generate(samples))

    def _generate(self, samples: list[Sample]) -> Generate:
        """The Generate of `samples`, all of one group."""
        group = self.ledger.groups[samples[0].group_id]
        rollout = self.cfg.rollout
        training = group.purpose is Purpose.TRAIN
        seeds = group.seeds
        if seeds is None:
            seeds = group.seeds = self._seeds(group)
        return Generate(
            request_ids=[sample.request_id for sample in samples],
            prompt_ids=group.prompt_ids,
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature if training else self.cfg.eval.temperature,
            top_p=rollout.top_p if training else 1.0,
            stop_token_ids=self.stop_token_ids,
            seeds=[seeds[sample.index] for sample in samples],
            **episode_fields(self.cfg, group.prompt),
        )

    def _seeds(self, group: Group) -> list[int]:
        """Each sample's seed of `group`, by index: its sampling stream, named by what it
        is (areal.seeds), the same for every attempt, every worker and every run with this
        seed. Taken at the group's first dispatch, for the whole group in one hash call,
        and kept on the group (`Group.seeds`): a group is often spread over many workers,
        and a sample sent again keeps its seed."""
        size = len(group.samples)
        if group.purpose is Purpose.TRAIN:
            return train_group_seeds(self.cfg.seed, group.position, size)
        return eval_group_seeds(self.cfg.seed, group.prompt.prompt_id, size)

    def cancel(self, generating: dict[bytes, list[str]], out: Outbox) -> None:
        """Cancel these requests (by rollout worker identity); a cancelled request is never
        answered, so its slot is freed here."""
        for identity, request_ids in generating.items():
            handle = self.pool.get(identity)
            if handle is not None:
                handle.in_flight.difference_update(request_ids)
                out.send(identity, Cancel(request_ids=request_ids))

    def cancel_training(self, out: Outbox) -> None:
        """Training is over: cancel its generations and forget its samples not yet sent,
        freeing the workers' slots at once for the final evaluation."""
        by_worker: dict[bytes, list[str]] = {}
        for sample in list(self.ledger.in_flight(Purpose.TRAIN)):
            if sample.stage is Stage.GENERATING:
                assert sample.worker is not None  # set with the stage
                by_worker.setdefault(sample.worker, []).append(sample.request_id)
        for identity, request_ids in by_worker.items():
            out.send(identity, Cancel(request_ids=request_ids))
            handle = self.pool.get(identity)
            if handle is not None:
                handle.in_flight.difference_update(request_ids)
                self.room.offer(handle)
        self.ledger.forget_pending(Purpose.TRAIN)
