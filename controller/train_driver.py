"""The train driver: buffered groups into training steps, each step's record, evaluations,
resume state and the run's summary.

    wait for every worker -> evaluate (version 0, or the resumed one) -> for each step:
        take_batch    wait for B complete groups (staleness.strict: earliest deadline first,
                      none past it; those past it dropped)
        train step    each rank's shard packed straight into a Train (sharding, shaping),
                      sent, answered through the loss of ranks (trainers.py); rank 0's
                      Trained publishes the next version as it arrives (the controller's)
        record        metrics.jsonl (report.py); the controller's part of a checkpoint
                      (resume.py) once the step's record is written
        every eval.every_steps steps: an evaluation, beside training
    -> training over: admission closed, training generations cancelled -> the periodic
       evaluations finish -> final evaluation -> summary

Owns the step counter, the evaluation before training, the checkpoint whose resume state
is owed, and the summary; writes the step records (report.py).
Its sync decisions (`take_batch`, `train_messages`, `record_step`, `checkpointed`) are tested
without a channel; `run` is its task.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from collections.abc import Awaitable, Callable

import numpy as np

from areal import clock
from areal.algorithms.shaping import shaping_in_force, training_batch, training_targets
from areal.algorithms.sharding import plan_shard_sequences
from areal.config import RunConfig
from areal.controller import strict_staleness
from areal.controller.admission import Admission
from areal.controller.evaluations import Evaluations
from areal.controller.generation import Generation
from areal.controller.ledger import Group, Ledger
from areal.controller.metrics import MetricsSink
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerPool
from areal.controller.report import StepReport, eval_record, summary_lines
from areal.controller.resume import ResumeState, write_state
from areal.controller.peer_log import PeerLog
from areal.controller.scoring import Scoring
from areal.controller.setup import RunSetup
from areal.controller.signal import Changed
from areal.controller.trainers import Trainers
from areal.messages import Train, Trained, WorkerKind
from areal.types import pack, pack_arrays


def _free(batch: list[Any]) -> float:
    """Drop `batch`'s references, the last ones to a trained step's groups and Train
    messages, on the calling (worker) thread; the CPU seconds it took there."""
    start = time.thread_time()
    batch.clear()
    return time.thread_time() - start


class TrainDriver:
    def __init__(
        self,
        cfg: RunConfig,
        setup: RunSetup,
        ledger: Ledger,
        admission: Admission,
        generation: Generation,
        scoring: Scoring,
        evaluations: Evaluations,
        trainers: Trainers,
        pool: WorkerPool,
        metrics: MetricsSink,
        peer_log: PeerLog,
        changed: Changed,
        report: StepReport,
        *,
        version: Callable[[], int],
        stopping: Callable[[], bool],
        send: Callable[[Outbox], Awaitable[None]],
        drop: Callable[[Group, str, Outbox], None],
        malformed: Callable[[], int],
        record_event: Callable[..., None],
        started: float,
        intake_cpu_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """`version`: the policy version in force; `stopping`: whether the run was asked to
        stop; `send`: the shell's; `drop(group, reason, out)`: never train on `group`;
        `malformed`: messages dropped undecoded so far (for the summary); `intake_cpu_s`:
        the CPU seconds of the channel's intake so far (each step record its share)."""
        self.cfg = cfg
        self.setup = setup
        self.ledger = ledger
        self.admission = admission
        self.generation = generation
        self.scoring = scoring
        self.evaluations = evaluations
        self.trainers = trainers
        self.pool = pool
        self.metrics = metrics
        self.peer_log = peer_log
        self.changed = changed
        self.version = version
        self.stopping = stopping
        self.send = send
        self.drop = drop
        self.malformed = malformed
        self.intake_cpu_s = intake_cpu_s
        self._intake_cpu_at_record = 0.0
        """`intake_cpu_s()` when the last step record was written."""
        self.record_event = record_event
        self.started = started
        self.report = report
        """What the step records count; fed by the decisions on messages too (core.py)."""
        self.start_step = 0
        """The last step trained before this run started (a resumed run's checkpoint)."""
        self.eval_before: dict[str, Any] | None = None
        """The run's evaluation before any training (a resumed run's: from its state)."""
        self.resumed_after: int | None = None
        self._checkpointed: dict[int, tuple[str, float | None]] = {}
        """Checkpoints rank 0 reported complete whose resume state is not written yet: step ->
        (path, seconds it took)."""
        self._resume_at: dict[int, ResumeState] = {}
        """The controller's part of each checkpoint step's state, taken as its record was
        written, until the trainer reports the checkpoint complete (with
        trainer.checkpoint_async, a later step's Trained does)."""
        self.summary: dict[str, Any] | None = None
        """Set once the run has finished: its summary."""
        self._release_trajectories = not (cfg.logging.save_batches or shaping_in_force(cfg))
        """Whether `_pack` releases the batch's trajectories once packed: not when the step
        record reads them (shaping's metrics, and episodes' for a batch with any) or
        `_save_batch` does."""

    def resume(self, state: ResumeState) -> None:
        """Continue after step `state.step`."""
        self.start_step = self.resumed_after = state.step
        self.eval_before = state.eval_before

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        await self._wait_ready()
        before = await self.evaluate()
        if self.eval_before is None:
            self.eval_before = before
        self.report.start_training()
        async with asyncio.TaskGroup() as periodic:  # their records precede the summary
            step = await self._train(periodic)
            self.admission.close()
            out = Outbox()
            self.generation.cancel_training(out)
            await self.send(out)
            self.changed.notify()  # rooms changed: the dispatch loop checks at each notify
        after = await self.evaluate()
        return self._finish(before=self.eval_before, after=after, steps=step)

    async def _train(self, periodic: asyncio.TaskGroup) -> int:
        """Train until the last step or a stop; returns the last step trained."""
        groups_per_step = self.cfg.trainer.batch_size // self.cfg.task.group_size
        step = self.start_step
        freed_s = 0.0  # CPU seconds freeing the last step's batch took in its thread
        while step < self.cfg.trainer.total_steps and not self.stopping():
            step += 1
            waited = clock.now()
            groups = await self._wait_for_batch(groups_per_step)
            if groups is None:  # stopped while waiting: this step was not trained
                return step - 1
            waited = clock.now() - waited
            self.admission.consumed(self.cfg.trainer.batch_size)
            messages, pack_s = await asyncio.to_thread(self._pack, step, self.version(), groups)
            if self.cfg.logging.save_batches:
                await asyncio.to_thread(self._save_batch, step, groups)
            start = clock.now()
            trained = await self.trainers.run_step(step, messages, self.stopping)
            if trained is None:  # stopped while a lost trainer was being restored
                return step - 1
            self.record_step(step, groups, trained, clock.now() - start, waited, pack_s + freed_s)
            # The batch's last references, handed to a worker thread that drops them: its
            # groups' samples and what they hold, about a million objects a step at cluster
            # scale, are freed there instead of on the loop's thread (docs/history.md, "A
            # step's batch freed beside the loop").
            batch: list[Any] = [groups, messages]
            del groups, messages
            freed_s = await asyncio.to_thread(_free, batch)
            if self._eval_due(step):
                periodic.create_task(self.evaluate(), name="eval")
        return step

    async def _wait_ready(self) -> None:
        kinds = {
            WorkerKind.ROLLOUT: self.cfg.rollout.num_workers,
            WorkerKind.REWARD: self.cfg.reward.num_workers,
            WorkerKind.TRAINER: self.cfg.trainer.num_ranks,
        }
        await self.changed.wait_for(
            lambda: all(len(self.pool.ready(k)) >= n for k, n in kinds.items())
        )
        self.metrics.console(f"workers ready after {clock.now() - self.started:.1f} s")

    async def _wait_for_batch(self, num_groups: int) -> list[Group] | None:
        """Wait for `num_groups` complete training groups and take them; None if stopped."""
        while True:
            # Checked by each notify, not by waking this task for it (most leave it false).
            await self.changed.wait_for(
                lambda: len(self.ledger.buffer) >= num_groups or self.stopping(), at_notify=True
            )
            if self.stopping():
                return None
            out = Outbox()
            groups = self.take_batch(num_groups, out)
            await self.send(out)
            if groups is not None:
                return groups

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return every > 0 and step % every == 0 and step < self.cfg.trainer.total_steps

    # -- decisions ------------------------------------------------------------------------------

    def take_batch(self, num_groups: int, out: Outbox) -> list[Group] | None:
        """`num_groups` complete training groups from the buffer, or None if it holds too
        few. Strict bound: earliest deadline first, none past it; those past it are dropped
        (their Cancels into `out`). The batch is in draw order: which groups finished first
        is timing, and the trainer's sums (packing, micro-batches) follow the batch's order,
        so a synchronous run trains the same batch the same way every time."""
        if not self.cfg.staleness.strict:
            batch = (
                self.ledger.take_batch(num_groups)
                if len(self.ledger.buffer) >= num_groups
                else None
            )
        else:
            self.drop_expired(list(self.ledger.buffer), out)
            if len(self.ledger.buffer) < num_groups:
                return None
            batch = self.ledger.take_batch(
                num_groups, lambda g: strict_staleness.deadline(g, self.cfg.eta)
            )
        return None if batch is None else sorted(batch, key=lambda g: (g.position, g.group_id))

    def drop_expired(self, groups: list[Group], out: Outbox, version: int | None = None) -> None:
        """Strict bound: drop the training groups among `groups` that `version` (default: the
        one in force) can no longer train within eta versions of their oldest token."""
        version = self.version() if version is None else version
        for group in strict_staleness.expired_groups(groups, version, self.cfg.eta):
            self.drop(group, strict_staleness.STALE, out)

    def train_messages(self, step: int, groups: list[Group]) -> list[Train]:
        return train_messages(self.cfg, step, self.version(), groups)

    def _pack(self, step: int, version: int, groups: list[Group]) -> tuple[list[Train], float]:
        """`train_messages` for a worker thread, with the CPU seconds it took there. Packing
        copies every trained token (hundreds of MB a step at cluster scale) and those copies
        release the GIL: the event loop's thread goes on receiving meanwhile. The groups are
        the train driver's alone once taken from the buffer; nothing else touches them.

        The trajectories packing built from recorded completions (`Sample.generated`) are
        released here, once packed, unless the step record or `logging.save_batches` reads
        them (`_release_trajectories`; the step record reads every trajectory of a batch
        with an agent episode): freed on this thread as soon as they are packed (about a
        dozen objects a sample, tens of thousands of samples a step at cluster scale;
        docs/history.md, "Trajectories freed where they were built"); the rest of the batch
        is freed on a thread too, once the step is recorded (`_free`)."""
        start = time.thread_time()
        messages = train_messages(self.cfg, step, version, groups)
        if self._release_trajectories and not any(group.episodes for group in groups):
            for group in groups:
                for sample in group.samples:
                    sample.release_trajectory()
        return messages, time.thread_time() - start

    def _save_batch(self, step: int, groups: list[Group]) -> None:
        """logging.save_batches: the batch as trained, packed (runs in a thread)."""
        trajectories = [t for g in groups for t in g.trajectories()]
        batch, _ = training_batch(trajectories, pack(trajectories), self.cfg)
        self.setup.save_batch(step, self.version(), batch)

    def record_step(
        self,
        step: int,
        groups: list[Group],
        trained: Trained,
        train_s: float,
        waited_s: float,
        pack_s: float = 0.0,
    ) -> dict[str, Any]:
        """Write step `step`'s record (and the progress line), then the controller's part
        of its checkpoint, if the trainer made one. `pack_s`: CPU seconds of the thread
        beside the loop, packing the Train messages and freeing the previous step's batch
        (perf/pack_cpu_s); the intake's thread's since the last record are
        perf/intake_cpu_s."""
        record = self.report.step_record(
            step,
            self.version(),
            groups,
            trained.stats,
            train_s,
            waited_s,
            cfg=self.cfg,
            in_flight=len(self.ledger.by_request),
            score_queue=self.scoring.num_queued,
            buffered=self.ledger.num_buffered(),
            started=self.started,
        )
        record["perf/pack_cpu_s"] = pack_s
        intake_cpu_s = self.intake_cpu_s()
        record["perf/intake_cpu_s"] = intake_cpu_s - self._intake_cpu_at_record
        self._intake_cpu_at_record = intake_cpu_s
        record.update(self.scoring.faults.window_metrics())
        self.metrics.record("step", record, step=step)
        every = self.cfg.trainer.checkpoint_every
        if step in self._checkpointed or (every and step % every == 0):  # a checkpoint's step
            self._resume_at[step] = self._resume_state(step, trained.version)
        self._save_resume_states()
        self.metrics.progress(
            step,
            {
                k.split("/")[-1]: record[k]
                for k in ("rollout/reward_mean", "train/loss")
                if k in record
            },
        )
        return record

    def checkpointed(self, msg: Trained) -> None:
        """Rank 0 reported a checkpoint complete: the replays start after its step, and its
        resume state is written once the step's record is (at once for a replayed step,
        whose record exists)."""
        step = msg.checkpoint_step or msg.step
        self.trainers.recovery.checkpointed(step, msg.checkpoint)
        seconds = msg.stats.get("checkpoint_write_s", msg.stats.get("checkpoint_s"))
        self._checkpointed[step] = (msg.checkpoint, seconds)
        if msg.replay:
            self._resume_at[step] = self._resume_state(step, msg.version)
        self._save_resume_states()

    def _resume_state(self, step: int, version: int) -> ResumeState:
        return ResumeState(
            step=step,
            version=version,
            drawn=self.setup.num_drawn,
            untrained=self.untrained_positions(),
            eval_before=self.eval_before,
        )

    def _save_resume_states(self) -> None:
        """The controller's part of each checkpoint both reported complete and recorded: a
        run killed between the two resumes from the checkpoint before and trains the step
        again, instead of resuming after a step whose record never reached metrics.jsonl."""
        for step in sorted(self._checkpointed.keys() & self._resume_at.keys()):
            path, seconds = self._checkpointed.pop(step)
            state = self._resume_at.pop(step)
            state.path = path
            write_state(state)
            self.record_event("checkpoint", step=step, path=path, seconds=seconds)
            for older in [s for s in self._resume_at if s < step]:  # never reported
                del self._resume_at[older]

    def untrained_positions(self) -> list[int]:
        """Draw positions of the prompt groups admitted and not trained, or queued again."""
        return sorted(self.ledger.untrained_positions() + self.setup.requeued_positions())

    # -- evaluations and the end ----------------------------------------------------------------

    async def evaluate(self) -> dict[str, Any]:
        """Generate and score the held-out prompts at the current version; record and return."""
        round_ = self.evaluations.start(self.version())
        self.changed.notify()
        start = clock.now()
        await round_.done.wait()
        self.evaluations.finish(round_)  # its groups (every trajectory) are not kept
        record = eval_record(round_.groups, round_.version, clock.now() - start)
        record["perf/train_elapsed_s"] = self.report.train_elapsed()
        self.metrics.record("eval", record, step=round_.version)
        self.metrics.console(
            f"eval @ version {round_.version}: pass@1 {record['eval/pass@1']:.3f} "
            f"over {int(record['eval/num_problems'])} held-out problems"
        )
        return record

    def _finish(self, before: dict[str, Any], after: dict[str, Any], steps: int) -> dict[str, Any]:
        summary = self.report.summary(
            before,
            after,
            clock.now() - self.started,
            steps,
            run_dir=Path(self.setup.run_dir),
            mode=self.cfg.mode,
            final_version=self.version(),
            num_drawn=self.setup.num_drawn,
            untrained_positions=self.untrained_positions(),
            malformed_messages=self.malformed(),
        )
        if self.resumed_after is not None:
            summary["resumed_after_step"] = self.resumed_after
        self.peer_log.flush()
        summary["peer_refusals"] = dict(self.peer_log.totals)
        self.metrics.record("summary", summary)
        for line in summary_lines(summary):
            self.metrics.console(line)
        self.setup.write_summary(summary)
        self.summary = summary
        return summary


def train_messages(cfg: RunConfig, step: int, version: int, groups: list[Group]) -> list[Train]:
    """Each trainer rank's share of the batch `groups` (areal.algorithms.sharding), packed
    straight from the trajectories into the message's arrays, with the rewards shaped, the
    advantages and the loss mask to train on (areal.algorithms.shaping)."""
    trajectories = [t for g in groups for t in g.trajectories()]
    advantage_tensor, masked_tensor = training_targets(trajectories, cfg)
    advantages = advantage_tensor.numpy().astype(np.float32)
    masked: list[bool] = masked_tensor.tolist()
    plans = plan_shard_sequences(
        [t.num_tokens for t in trajectories],
        [0 if masked[i] else t.num_loss_tokens for i, t in enumerate(trajectories)],
        cfg.trainer.num_ranks,
        cfg.trainer.num_minibatches,
    )
    return [
        Train(
            step=step,
            version=version,
            advantages=advantages[plan.seq_indices],
            minibatch_sizes=plan.minibatch_sizes,
            minibatch_loss_tokens=plan.minibatch_loss_tokens,
            minibatch_loss_seqs=plan.minibatch_loss_seqs,
            **pack_arrays(
                [trajectories[i] for i in plan.seq_indices], [masked[i] for i in plan.seq_indices]
            ),
        )
        for plan in plans
    ]
