"""The trainer worker: receives packed batches, runs the PPO step, publishes weights.

    Train(step, version i, packed batch) -> PPOTrainer.step (in a thread) -> publish i + 1
    -> Trained(version i + 1, stats, weights_path | num_chunks) [-> WeightsChunk x num_chunks]

On shutdown after at least one step, the final policy is saved as a normal Hugging Face
directory (`<run_dir>/final_model`) with its tokenizer, loadable by transformers or vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from areal.messages import Train, Trained, Welcome, WorkerKind
from areal.models.hf import load_model, load_tokenizer
from areal.models.weights import copy_into_model, load_tensors
from areal.types import PackedBatch
from areal.workers.base import Worker
from areal.workers.trainer.ppo import PPOTrainer
from areal.workers.trainer.publish import publish_to_disk, stream_chunks

log = logging.getLogger(__name__)


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
        group_ids=torch.from_numpy(msg.group_ids.astype("int64")))


class TrainerWorker(Worker):
    kind = WorkerKind.TRAINER

    async def setup(self, welcome: Welcome) -> int:
        cfg = self.config
        torch.set_num_threads(cfg.trainer.threads)
        torch.manual_seed(cfg.seed + self.rank)
        device = trainer_device(cfg.trainer.devices, self.rank)
        self.model = await asyncio.to_thread(load_model, cfg.model.path, dtype=cfg.model.dtype,
                                             device=device,
                                             trust_remote_code=cfg.model.trust_remote_code)
        if welcome.weights_path:
            tensors = await asyncio.to_thread(load_tensors, welcome.weights_path)
            copy_into_model(self.model, tensors)
        self.trainer = PPOTrainer(self.model, cfg)
        self.version = welcome.version
        self._busy = False
        return self.version

    def num_running(self) -> int:
        return int(self._busy)

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Train):
            self.spawn(self._train(msg), f"train-step-{msg.step}")
        else:
            log.warning("trainer ignores %s", type(msg).__name__)

    async def _train(self, msg: Train) -> None:
        if msg.version != self.version:
            raise RuntimeError(f"Train for version {msg.version} but the trainer holds "
                               f"version {self.version}")
        self._busy = True
        try:
            batch = batch_from_message(msg)
            stats = await asyncio.to_thread(self.trainer.step, batch, msg.version)
            self.version = msg.version + 1
            start = time.perf_counter()
            if self.config.weight_sync.mode == "stream":
                chunks = await asyncio.to_thread(stream_chunks, self.model, self.config,
                                                 self.version)
                stats["publish_s"] = time.perf_counter() - start
                await self.send(Trained(step=msg.step, version=self.version, stats=stats,
                                        num_chunks=len(chunks)))
                for chunk in chunks:
                    await self.send(chunk)
            else:
                path = await asyncio.to_thread(publish_to_disk, self.model, self.config,
                                               self.version)
                stats["publish_s"] = time.perf_counter() - start
                await self.send(Trained(step=msg.step, version=self.version, stats=stats,
                                        weights_path=path))
        finally:
            self._busy = False

    async def close(self) -> None:
        model = getattr(self, "model", None)
        if model is None or self.version == 0 or self.rank != 0:
            return
        target = Path(self.config.run_dir) / "final_model"
        await asyncio.to_thread(self._save_final, target)
        log.info("saved the final policy (version %d) to %s", self.version, target)

    def _save_final(self, target: Path) -> None:
        self.model.save_pretrained(target, safe_serialization=True)
        cfg = self.config.model
        load_tokenizer(cfg.tokenizer_path or cfg.path,
                       trust_remote_code=cfg.trust_remote_code).save_pretrained(target)
