"""The trainer worker: one data-parallel rank. Trains on its shard, rank 0 publishes weights.

    setup: load the model; rank 0 hosts the TCPStore where process groups meet (when there
           are several ranks or weight_sync.mode=collective) -> Ready(store="host:port")
    JoinGroup(trainer)  -> init_process_group; PPOTrainer over the group (FSDP2 wraps here)
                        -> GroupStatus(JOINED | FAILED)
    Train(step, version i, shard) -> PPOTrainer.step (trainer.audit_steps: its starting
           weights before it, its inputs after it, saved by audit.py) -> full weights, or with
           LoRA the adapters (rank 0; FSDP: all ranks gather) -> rank 0 publishes i + 1
           through the publisher of weight_sync.mode (disk | stream | collective snapshot |
           shm slot) -> every trainer.checkpoint_every steps: checkpoint (all ranks, DCP;
           trainer.checkpoint_async: the state copied, written in the background)
           -> Trained(version i + 1, reduced stats, weights_path | num_chunks | manifest,
              checkpoint completed since the last step, its step) [-> WeightsChunk x
              num_chunks]; ranks > 0 send Trained with the same stats
    Train(replay)  after a restart from Welcome.checkpoint (loaded at setup, or after the
           group formed): the step again, publishing nothing -> Trained(replay)
    collective, rank 0 only:
      JoinGroup(weights)         -> join that generation of the weights group
      BroadcastWeights(v, gen)   -> broadcast snapshot v; a failure -> GroupStatus(FAILED)

Blocking work runs on two daemon threads (areal.workers.collective.SerialThread): "train"
(the group rendezvous, steps and publishing, in order, so weights never change while they
are read) and "weights" (the weights group), so a broadcast overlaps the next step. A rank
stuck in a collective with a dead peer cannot keep its process alive after Shutdown.

When the controller ends a finished run (Shutdown.final) after at least one step, rank 0
saves the final policy as a normal Hugging Face directory (`<run_dir>/final_model`) with its
tokenizer, loadable by transformers or vLLM; written beside it and renamed into place, so a
`final_model/` is always complete (with LoRA: the merged model, and the adapter in
`adapter/`). Never on its own (a lost controller, a failed run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from areal.messages import (
    BroadcastWeights,
    GroupName,
    GroupState,
    GroupStatus,
    JoinGroup,
    Ready,
    Train,
    Trained,
    Welcome,
    WorkerKind,
)
from areal.models.hf import load_model
from areal.models.tokenizer import load_tokenizer
from areal.models.lora import adapter_tensors, merge_into_base, save_adapter_dir
from areal.models.weights import load_tensors, save_tensors
from areal.types import PackedBatch
from areal.workers.base import Worker
from areal.workers.collective import (
    SerialThread,
    WeightSnapshot,
    WeightsMember,
    advertised_host,
    host_store,
    join_store,
    pin_interface,
    report_weights_op,
)
from areal.workers.trainer import audit
from areal.workers.trainer.distributed import DataParallel, resolve_mode
from areal.workers.trainer.ppo import PPOTrainer
from areal.workers.trainer.checkpoint import (
    BackgroundCheckpoints,
    load_checkpoint,
    read_info,
    save_checkpoint,
)
from areal.workers.trainer.publish import (
    Publication,
    Publisher,
    make_publisher,
    save_weights_dir,
    version_dir,
    write_directory,
)

log = logging.getLogger(__name__)

NO_CHECKPOINT = ("", 0)
"""What a Trained reports when no checkpoint completed: (path, step)."""


def trainer_device(devices: list[str], rank: int) -> str:
    """The torch device of a rank: 'cuda' when its configured device is a GPU (the process
    sees only that GPU through CUDA_VISIBLE_DEVICES), else 'cpu'."""
    if devices and devices[rank].startswith("cuda"):
        return "cuda"
    return "cpu"


def batch_from_message(msg: Train) -> PackedBatch:
    return PackedBatch(
        token_ids=torch.from_numpy(msg.token_ids.astype("int64")),
        logprobs=torch.from_numpy(msg.logprobs.astype("float32")),
        versions=torch.from_numpy(msg.versions.astype("int64")),
        loss_mask=torch.from_numpy(msg.loss_mask.astype(bool)),
        cu_seqlens=torch.from_numpy(msg.cu_seqlens.astype("int32")),
        rewards=torch.from_numpy(msg.rewards.astype("float32")),
        group_ids=torch.from_numpy(msg.group_ids.astype("int64")),
    )


class TrainerWorker(Worker):
    kind = WorkerKind.TRAINER

    @property
    def trainer(self) -> PPOTrainer:
        """The rank's PPO trainer: built in `setup` for one rank, once the data-parallel
        group has formed for several (`_train` refuses a step before then)."""
        if self._trainer is None:
            raise RuntimeError(
                f"rank {self.rank} has no trainer before its data-parallel group formed"
            )
        return self._trainer

    async def setup(self, welcome: Welcome) -> int:
        cfg = self.config
        self._busy = False
        self._checkpoints = BackgroundCheckpoints()
        """trainer.checkpoint_async: the checkpoint being written while steps train (set
        first: close() reads it even when the model loaded and a later set-up step failed)."""
        self.dp = DataParallel.single()
        torch.set_num_threads(cfg.trainer.threads)
        torch.manual_seed(cfg.seed + self.rank)
        self.device = trainer_device(cfg.trainer.devices, self.rank)
        if self.device == "cuda":
            torch.cuda.set_device(0)
        self.model = await asyncio.to_thread(
            load_model,
            cfg.model.model_dir(),
            dtype=cfg.model.dtype,
            device=self.device,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        self.checkpoint = read_info(welcome.checkpoint) if welcome.checkpoint else None
        self.version = self.checkpoint.version if self.checkpoint else 0
        self.resume_to = welcome.version
        """The run's version when this rank joined: replayed steps lead up to it."""
        self._train_thread = SerialThread(f"train-rank{self.rank}")
        self._trainer: PPOTrainer | None = None
        if cfg.trainer.num_ranks == 1:
            self._trainer = PPOTrainer(self.model, cfg)
            await self._train_thread.submit(self._restore_sync)
        self._store, self._store_address = None, ""
        if self.rank == 0 and (cfg.trainer.num_ranks > 1 or cfg.weight_sync.mode == "collective"):
            host = advertised_host(self.address, cfg.trainer.store_host)
            pin_interface(host)
            self._store, self._store_address = host_store(
                host, cfg.trainer.store_port, cfg.trainer.dist_timeout_s
            )
            log.info("process groups meet at %s", self._store_address)
        self._snapshots: dict[int, WeightSnapshot] = {}
        self._weights: WeightsMember | None = None
        self._weights_publisher: Publisher | None = None
        return self.version

    def ready_message(self, version: int) -> Ready:
        return Ready(version=version, store=self._store_address)

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Train):
            self.spawn(self._train(msg), f"train-step-{msg.step}")
        elif isinstance(msg, JoinGroup) and msg.group is GroupName.TRAINER:
            self.spawn(self._join_trainer_group(msg), "join-trainer-group")
        elif isinstance(msg, JoinGroup) and msg.group is GroupName.WEIGHTS and self.rank == 0:
            self._join_weights_group(msg)
        elif isinstance(msg, BroadcastWeights) and self.rank == 0:
            self._broadcast(msg)
        else:
            log.warning("trainer rank %d ignores %s", self.rank, type(msg).__name__)

    # -- the data-parallel group ----------------------------------------------------------------

    async def _join_trainer_group(self, msg: JoinGroup) -> None:
        try:
            await self._train_thread.submit(lambda: self._join_trainer_group_sync(msg))
        except Exception as err:  # fault boundary: the controller fails the run, naming us
            log.exception("rank %d could not join the trainer group", self.rank)
            await self.send(
                GroupStatus(
                    group=GroupName.TRAINER,
                    generation=msg.generation,
                    state=GroupState.FAILED,
                    error=repr(err),
                )
            )
            return
        await self.send(
            GroupStatus(group=GroupName.TRAINER, generation=msg.generation, state=GroupState.JOINED)
        )

    def _join_trainer_group_sync(self, msg: JoinGroup) -> None:
        cfg = self.config.trainer
        store = self._store  # rank 0 hosts it
        if store is None:
            store = join_store(msg.store, msg.timeout_s)
        self.dp = DataParallel.join(
            store,
            rank=msg.rank,
            world_size=msg.world_size,
            backend=msg.backend,
            timeout_s=msg.timeout_s,
            mode=resolve_mode(cfg.data_parallel, self.device),
            generation=msg.generation,
            bucket_bytes=self.config.weight_sync.bucket_mb << 20,
        )
        self._trainer = PPOTrainer(self.model, self.config, self.dp)
        self._restore_sync()

    def _restore_sync(self) -> None:
        """Resume from the checkpoint in Welcome (a restart after a trainer rank was lost)."""
        if self.checkpoint is None:
            return
        start = time.perf_counter()
        load_checkpoint(self.trainer.model, self.trainer.optimizer, self.checkpoint.path)
        log.info(
            "rank %d resumed from %s (step %d, version %d) in %.2f s",
            self.rank,
            self.checkpoint.path,
            self.checkpoint.step,
            self.checkpoint.version,
            time.perf_counter() - start,
        )

    # -- training steps -------------------------------------------------------------------------

    async def _train(self, msg: Train) -> None:
        if self._trainer is None:
            raise RuntimeError(
                f"Train for step {msg.step} before the data-parallel group of "
                f"{self.config.trainer.num_ranks} ranks was formed"
            )
        if msg.version != self.version:
            raise RuntimeError(
                f"Train for version {msg.version} but the trainer holds version {self.version}"
            )
        self._busy = True
        try:
            stats, published, checkpoint = await self._train_thread.submit(
                lambda: self._step_sync(msg)
            )
            self.version = msg.version + 1
            await self._send_trained(msg, stats, published, checkpoint)
        finally:
            self._busy = False

    def _step_sync(
        self, msg: Train
    ) -> tuple[dict[str, float], Publication | None, tuple[str, int]]:
        """The step, then (rank 0) the publication of its result and (every
        trainer.checkpoint_every steps, all ranks) a checkpoint, on the train thread. A
        replayed step publishes nothing; the last one checks its result against the weights
        the lost trainer published for that version (where still on disk) and, in collective
        mode, keeps a snapshot of it for late joiners."""
        batch = batch_from_message(msg)
        advantages = None
        if msg.minibatch_sizes:  # a data-parallel shard: the global batch's plan comes along
            if msg.advantages is None:
                raise ValueError(f"Train for step {msg.step} plans minibatches without advantages")
            advantages = torch.from_numpy(msg.advantages.astype("float32"))
        audited = msg.step in self.config.trainer.audit_steps and not msg.replay
        if audited:
            start_weights = self.dp.full_weights(self.trainer.model)
            if start_weights is not None:
                audit.save_start_weights(self.config.run_path(), msg.step, start_weights)
        if advantages is None:
            stats = self.trainer.step(batch, msg.version)
        else:
            stats = self.trainer.step(
                batch,
                msg.version,
                advantages=advantages,
                minibatch_sizes=list(msg.minibatch_sizes),
                minibatch_loss_tokens=list(msg.minibatch_loss_tokens),
                minibatch_loss_seqs=list(msg.minibatch_loss_seqs),
            )
        if audited:
            prox = self.trainer.last_prox
            assert prox is not None  # the step just taken kept it
            audit.save_batch(self.config.run_path(), msg.step, self.rank, batch, prox, msg.version)
        version = msg.version + 1
        if msg.replay and version < self.resume_to:
            return stats, None, NO_CHECKPOINT
        start = time.perf_counter()
        tensors = self.dp.full_weights(self.trainer.model)
        if msg.replay:  # the last one: this rank now holds the run's current version
            if tensors is None:
                return stats, None, NO_CHECKPOINT
            stats.update(self._replay_check(tensors, version))
            # Collective mode: a late joiner may need this version broadcast again.
            return (
                stats,
                self._publisher().publish(tensors, version)
                if self.config.weight_sync.mode == "collective"
                else None,
                NO_CHECKPOINT,
            )
        published = None
        if tensors is not None:
            if self.dp.fsdp:
                self._final_weights = tensors  # gathered CPU copies: what close() saves
            published = self._publisher().publish(tensors, version)
            stats["publish_s"] = time.perf_counter() - start
            stats["publish_bytes"] = float(sum(t.numel() * t.element_size() for _, t in tensors))
        return stats, published, self._checkpoint_sync(msg, stats, tensors)

    def _publisher(self) -> Publisher:
        """Rank 0's publisher of weight_sync.mode (created at the first publication)."""
        if self._weights_publisher is None:
            self._weights_publisher = make_publisher(self.config)
        return self._weights_publisher

    def _checkpoint_sync(
        self, msg: Train, stats: dict[str, float], tensors: list[tuple[str, torch.Tensor]] | None
    ) -> tuple[str, int]:
        """Every trainer.checkpoint_every steps a checkpoint (all ranks), written here or, with
        trainer.checkpoint_async, begun here and written in the background. Returns what
        rank 0's Trained reports: (path, step) of the checkpoint completed since the last
        step, or NO_CHECKPOINT. `checkpoint_s` in `stats`: the seconds this step spent on it."""
        cfg = self.config.trainer
        due = bool(cfg.checkpoint_every) and msg.step % cfg.checkpoint_every == 0
        version = msg.version + 1
        what = (
            self.trainer.model,
            self.trainer.optimizer,
            self.config.run_path(),
            msg.step,
            version,
            cfg.keep_checkpoints,
            tensors,
            lambda directory, weights: save_weights_dir(directory, weights, self.config, version),
        )
        if not cfg.checkpoint_async:
            if not due:
                return NO_CHECKPOINT
            start = time.perf_counter()
            path = save_checkpoint(*what)
            stats["checkpoint_s"] = time.perf_counter() - start
            return (str(path), msg.step) if self.rank == 0 else NO_CHECKPOINT
        written = self._checkpoints.finished()
        if due:
            start = time.perf_counter()
            written = self._checkpoints.wait() or written  # the previous one, if still writing
            self._checkpoints.start(*what)
            stats["checkpoint_s"] = time.perf_counter() - start
        if msg.step >= cfg.total_steps:  # the run's last step: the newest reported now, so
            written = self._checkpoints.wait() or written  # that --resume can train on from it
        if written is None:
            return NO_CHECKPOINT
        stats["checkpoint_write_s"] = written.write_s
        return (str(written.path), written.step) if self.rank == 0 else NO_CHECKPOINT

    def _replay_check(
        self, tensors: list[tuple[str, torch.Tensor]], version: int
    ) -> dict[str, float]:
        """Largest |difference| between the weights after the replay and those the lost
        trainer published for `version` (disk mode: they are still kept)."""
        published = version_dir(self.config.run_path(), version)
        if not published.exists():
            return {}
        saved = load_tensors(published)
        diff = max(
            (float((t.float().cpu() - saved[name].float()).abs().max()) for name, t in tensors),
            default=0.0,
        )
        return {"replay_max_abs_diff": diff}

    async def _send_trained(
        self,
        msg: Train,
        stats: dict[str, float],
        published: Publication | None,
        checkpoint: tuple[str, int],
    ) -> None:
        version = msg.version + 1
        trained = Trained(
            step=msg.step,
            version=version,
            stats=stats,
            rank=self.rank,
            replay=msg.replay,
            checkpoint=checkpoint[0],
            checkpoint_step=checkpoint[1],
        )
        if published is not None:
            trained.weights_path = published.weights_path
            trained.num_chunks = len(published.chunks)
            if published.snapshot is not None:
                trained.manifest = published.snapshot.manifest
                # The controller may still ask for the previous version (a re-broadcast for
                # a late joiner) but never for older ones.
                self._snapshots = {v: s for v, s in self._snapshots.items() if v >= version - 1}
                self._snapshots[version] = published.snapshot
        await self.send(trained)
        for chunk in published.chunks if published is not None else ():
            await self.send(chunk)

    # -- the weights group (collective mode, rank 0) --------------------------------------------

    def _weights_member(self) -> WeightsMember:
        if self._weights is None:
            self._weights = WeightsMember()
        return self._weights

    def _join_weights_group(self, msg: JoinGroup) -> None:
        if self._store is None:
            raise RuntimeError(
                f"rank {self.rank} hosts no store to form the weights group: only rank 0 of a "
                "collective-mode run joins it"
            )
        joined = self._weights_member().join(msg, self._store)  # rank 0 hosts the store
        self.spawn(report_weights_op(self.send, msg.generation, joined, "join"), "join-weights")

    def _broadcast(self, msg: BroadcastWeights) -> None:
        member = self._weights_member()
        snapshot = self._snapshots.get(msg.version)
        if snapshot is None:
            raise RuntimeError(
                f"asked to broadcast version {msg.version}; this rank holds "
                f"{sorted(self._snapshots)}"
            )
        sent = member.thread.submit(lambda: member.group.send(snapshot, msg.generation))
        self.spawn(
            report_weights_op(self.send, msg.generation, sent, f"broadcast of v{msg.version}"),
            f"broadcast-{msg.version}",
        )

    # -- shutdown -------------------------------------------------------------------------------

    async def close(self) -> None:
        if getattr(self, "model", None) is None:
            return
        if self._busy:  # a step is blocked in a collective (a peer died): save nothing
            log.warning(
                "rank %d shuts down in the middle of a step; final model not saved", self.rank
            )
            return
        if self.rank == 0 and self.version > 0 and self.finished:
            target = self.config.run_path() / "final_model"
            try:
                await asyncio.to_thread(write_directory, target, self._save_final)
            except OSError as err:  # a full disk: the previous final_model/ (if any) stays
                log.error(
                    "final policy (version %d) NOT saved to %s: %s", self.version, target, err
                )
            else:
                log.info("saved the final policy (version %d) to %s", self.version, target)
        if self._checkpoints.writing:  # complete on disk; the controller does not hear of it
            try:
                await asyncio.to_thread(self._checkpoints.wait)
            except Exception:  # the run is over: its resume uses an older one
                log.exception("rank %d: the checkpoint being written failed", self.rank)
        if self._weights_publisher is not None:
            self._weights_publisher.close(finished=self.finished)
        self.dp.close()

    def _save_final(self, target: Path) -> None:
        final = getattr(self, "_final_weights", None)
        if self.config.trainer.lora.enabled:
            self._save_final_lora(target, final)
        elif final is not None:  # FSDP: the gathered weights of the last step
            self.model.save_pretrained(target, state_dict=dict(final), safe_serialization=True)
        else:
            self.model.save_pretrained(target, safe_serialization=True)
        cfg = self.config.model
        load_tokenizer(
            cfg.tokenizer_dir(),
            trust_remote_code=cfg.trust_remote_code,
            cache_dir=self.config.cache_dir,
        ).save_pretrained(target)

    def _save_final_lora(self, target: Path, final: list[tuple[str, torch.Tensor]] | None) -> None:
        """LoRA: the merged model (base + (alpha / rank) B A from the untouched base
        checkpoint, loadable without PEFT) and the adapter itself in `adapter/`."""
        cfg = self.config
        adapters = dict(final if final is not None else adapter_tensors(self.model))
        merged = merge_into_base(load_tensors(cfg.model.model_dir()), adapters, cfg.trainer.lora)
        target.mkdir(parents=True)
        save_tensors(target, merged, metadata={"version": str(self.version)})
        self.model.config.save_pretrained(target)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(target)
        save_adapter_dir(
            target / "adapter",
            adapters.items(),
            cfg.trainer.lora,
            base_model=cfg.model.path,
            metadata={"version": str(self.version)},
        )
