"""How the controller turns buffered groups into a training step and its result into a
new version. A mixin of `Controller` (controller.py), whose train driver loop calls these
in order; kept apart so that the actor's module stays about its loops.

    _take_batch    wait for B complete groups (staleness.strict: earliest deadline first,
                   none past it; those past it dropped)
    _train_step    each rank's shard packed into a Train (areal.algorithms.sharding and
                   shaping), sent, answered through the loss of ranks (trainers.py)
    _publish       the new version announced to every rollout worker (or broadcast in the
                   weights group, groups.py)
    _drop_group    a group never trained: its generations cancelled, its staleness slots
                   freed
"""

from __future__ import annotations

import asyncio

import numpy as np

from areal import clock
from areal.algorithms.sharding import plan_shard_sequences
from areal.algorithms.shaping import training_batch, training_targets
from areal.controller import strict_staleness
from areal.controller.ledger import Group, Purpose, Stage
from areal.messages import Cancel, Train, Trained, UpdateWeights, WorkerKind
from areal.types import pack, pack_arrays


class TrainingSteps:
    """Methods of Controller (self is the Controller)."""

    async def _take_batch(self, num_groups: int) -> list[Group] | None:
        """Wait for `num_groups` complete training groups and take them; None if stopped.
        Strict bound: earliest deadline first, none past it (strict_staleness.py)."""
        while True:
            # Checked by each notify, not by waking this task for it (most leave it false).
            await self.changed.wait_for(
                lambda: len(self.ledger.buffer) >= num_groups or self._stopping, at_notify=True)
            if self._stopping:
                return None
            if not self.cfg.staleness.strict:
                return self.ledger.take_batch(num_groups)
            await self._drop_expired(list(self.ledger.buffer))
            if len(self.ledger.buffer) >= num_groups:
                return self.ledger.take_batch(
                    num_groups, lambda g: strict_staleness.deadline(g, self.cfg.eta))

    async def _drop_expired(self, groups: list[Group]) -> None:
        """Strict bound: drop the training groups among `groups` that the version in force
        can no longer train within eta versions of their oldest token."""
        for group in strict_staleness.expired_groups(groups, self.version, self.cfg.eta):
            await self._drop_group(group, strict_staleness.STALE)

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return every > 0 and step % every == 0 and step < self.cfg.trainer.total_steps

    async def _wait_ready(self) -> None:
        kinds = {WorkerKind.ROLLOUT: self.cfg.rollout.num_workers,
                 WorkerKind.REWARD: self.cfg.reward.num_workers,
                 WorkerKind.TRAINER: self.cfg.trainer.num_ranks}
        await self.changed.wait_for(
            lambda: all(len(self.pool.ready(k)) >= n for k, n in kinds.items()))
        self._metrics.console(f"workers ready after {clock.now() - self._started:.1f} s")

    async def _train_step(self, step: int, groups: list[Group]) -> tuple[Trained, float] | None:
        """Send each trainer rank its shard (areal.algorithms.sharding); wait for them all,
        through the loss and restart of ranks (trainers.py). None: the run was stopped."""
        messages = await self._train_messages(step, groups)
        start = clock.now()
        trained = await self.trainers.run_step(step, messages, lambda: self._stopping)
        return None if trained is None else (trained, clock.now() - start)

    async def _train_messages(self, step: int, groups: list[Group]) -> list[Train]:
        """Each rank's share (areal.algorithms.sharding), packed straight from the
        trajectories into the message's arrays."""
        trajectories = [t for g in groups for t in g.trajectories()]
        # Rewards shaped, advantages, and the loss mask to train on (areal.algorithms.shaping).
        advantages, masked = training_targets(trajectories, self.cfg)
        advantages, masked = advantages.numpy().astype(np.float32), masked.tolist()
        if self.cfg.logging.save_batches:
            batch, _ = training_batch(trajectories, pack(trajectories), self.cfg)  # as trained
            await asyncio.to_thread(self._setup.save_batch, step, self.version, batch)
        trainer_cfg = self.cfg.trainer
        plans = plan_shard_sequences(
            [t.num_tokens for t in trajectories],
            [0 if masked[i] else t.num_loss_tokens
             for i, t in enumerate(trajectories)],
            trainer_cfg.num_ranks, trainer_cfg.num_minibatches)
        return [Train(step=step, version=self.version, advantages=advantages[plan.seq_indices],
                      minibatch_sizes=plan.minibatch_sizes,
                      minibatch_loss_tokens=plan.minibatch_loss_tokens,
                      minibatch_loss_seqs=plan.minibatch_loss_seqs,
                      **pack_arrays([trajectories[i] for i in plan.seq_indices],
                                    [masked[i] for i in plan.seq_indices]))
                for plan in plans]

    async def _publish(self, trained: Trained) -> None:
        """The trainer published `trained.version`: tell every rollout worker to serve it."""
        self.version = trained.version
        mode = self.cfg.weight_sync.mode
        update = UpdateWeights(version=self.version, mode=mode, path=trained.weights_path,
                               num_chunks=trained.num_chunks,
                               interrupt=self.cfg.mode == "async" and self.cfg.rollout.interrupt)
        self._stream_chunks = []
        self._latest_weights = trained.weights_path
        if self.cfg.staleness.strict:
            await self._drop_expired([*self.ledger.buffer, *(
                g for g in self.ledger.groups.values() if g.purpose is Purpose.TRAIN)])
        if mode == "collective":
            await self.groups.publish(self.version, trained.manifest, update.interrupt)
        else:
            for handle in self.pool.ready(WorkerKind.ROLLOUT):
                await self.channel.send(handle.identity, update)
        self.changed.notify()

    async def _cancel_training_requests(self) -> None:
        by_worker: dict[bytes, list[str]] = {}
        for sample in list(self.ledger.in_flight(Purpose.TRAIN)):
            if sample.stage is Stage.GENERATING:
                by_worker.setdefault(sample.worker, []).append(sample.request_id)
        for identity, request_ids in by_worker.items():
            await self.channel.send(identity, Cancel(request_ids=request_ids))
            handle = self.pool.get(identity)
            if handle is not None:  # cancelled requests are never answered: free their slots
                handle.in_flight.difference_update(request_ids)
                self._room[WorkerKind.ROLLOUT].offer(handle)
        self.ledger.pending = type(self.ledger.pending)(
            s for s in self.ledger.pending
            if self.ledger.groups[s.group_id].purpose is Purpose.EVAL)
        self.changed.notify()  # rooms changed: the dispatch loop checks at each notify

    async def _drop_group(self, group: Group, reason: str) -> None:
        """Never train on `group` (wherever it is): its generations are cancelled, its slots
        in the staleness window freed (admission replaces it), the cost counted per reason."""
        dropped = self.ledger.drop_group(group)
        self._score_queue = [b for b in self._score_queue if b[0].group_id != group.group_id]
        for identity, request_ids in dropped.generating.items():
            handle = self.pool.get(identity)
            if handle is not None:
                handle.in_flight.difference_update(request_ids)
                await self.channel.send(identity, Cancel(request_ids=request_ids))
        self.staleness.abort(dropped.num_unfinished)
        self.staleness.reject(dropped.num_finished)
        self._report.on_dropped(reason, dropped)
        self.changed.notify()
