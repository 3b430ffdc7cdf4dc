"""Generation requests: which rollout worker takes each pending sample, and cancelling them.

    ledger.pending --dispatch--> Generate of a group's pending samples (one message) to the
                                 least-loaded ready rollout worker with room (room.py:
                                 below rollout.max_concurrent + queued_groups groups)
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
from areal.seeds import eval_sample_seed, train_sample_seed


class Generation:
    def __init__(
        self, cfg: RunConfig, ledger: Ledger, pool: WorkerPool, stop_token_ids: list[int]
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pool = pool
        self.stop_token_ids = stop_token_ids
        self.room = WorkerRoom(
            cfg.rollout.max_concurrent + cfg.rollout.queued_groups * cfg.task.group_size
        )
        """Rollout workers with room, least loaded first: below rollout.max_concurrent
        sequences, plus queued_groups groups for their engine's queue (a worker answers a
        group when the last of its samples is done: the queue keeps the engine full while the
        others wait)."""

    def can_dispatch(self) -> bool:
        return bool(self.ledger.pending and self.room.peek())

    def dispatch(self, out: Outbox) -> None:
        """While a rollout worker has room: one Generate for the pending samples at the head of
        the queue that belong to one group, all of them, to the least-loaded worker with room
        (a group admitted whole goes in one message, a re-queued sample alone). A worker
        thus holds up to max_concurrent + (queued_groups + 1) * group_size - 1 requests; its
        engine decodes max_concurrent at once and queues the rest, as engines do (vLLM's
        max_num_seqs, the torch engine's scheduler). One message per group each way, not
        per sample, is the controller's cost at cluster scale."""
        pending = self.ledger.pending
        while pending:
            worker = self.room.take()
            if worker is None:
                break
            samples = [pending.popleft()]
            group_id = samples[0].group_id
            while pending and pending[0].group_id == group_id:
                samples.append(pending.popleft())
            self._generate(samples, worker, out)
            self.room.offer(worker)

    def _generate(self, samples: list[Sample], worker: WorkerHandle, out: Outbox) -> None:
        """One Generate for `samples`, all of one group."""
        group = self.ledger.groups[samples[0].group_id]
        rollout = self.cfg.rollout
        training = group.purpose is Purpose.TRAIN
        now = clock.now()
        for sample in samples:
            self.ledger.start_generation(sample, worker.identity, now)
            worker.in_flight.add(sample.request_id)
        out.send(
            worker.identity,
            Generate(
                request_ids=[sample.request_id for sample in samples],
                prompt_ids=group.prompt_ids,
                max_new_tokens=rollout.max_new_tokens,
                temperature=rollout.temperature if training else self.cfg.eval.temperature,
                top_p=rollout.top_p if training else 1.0,
                stop_token_ids=self.stop_token_ids,
                seeds=[self._seed(group, sample) for sample in samples],
                **episode_fields(self.cfg, group.prompt),
            ),
        )

    def _seed(self, group: Group, sample: Sample) -> int:
        """The sample's sampling stream, named by what it is (areal.seeds): the same for
        every attempt, every worker and every run with this seed."""
        if group.purpose is Purpose.TRAIN:
            return train_sample_seed(self.cfg.seed, group.position, sample.index)
        return eval_sample_seed(self.cfg.seed, group.prompt.prompt_id, sample.index)

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
                by_worker.setdefault(sample.worker, []).append(sample.request_id)
        for identity, request_ids in by_worker.items():
            out.send(identity, Cancel(request_ids=request_ids))
            handle = self.pool.get(identity)
            if handle is not None:
                handle.in_flight.difference_update(request_ids)
                self.room.offer(handle)
        self.ledger.forget_pending(Purpose.TRAIN)
