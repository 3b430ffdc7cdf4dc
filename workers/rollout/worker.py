"""The rollout worker: serves Generate requests with an engine, swaps weights on command.

    Generate  -> InterruptibleGenerator.generate (a task per request) -> Generated
    UpdateWeights(disk)        -> update from <path>
    UpdateWeights(stream) + WeightsChunk x n -> update from the received tensors
    Cancel    -> the request's task is cancelled; no result is sent

Updates are applied one at a time, in version order. In async mode they interrupt
in-flight sequences, which continue under the new weights (tokens keep the version that
sampled them); otherwise in-flight sequences finish first. Requests that arrive while an
update is pending wait for it, so their tokens carry the new version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from areal.messages import (
    Cancel, Generate, Generated, UpdateWeights, Welcome, WeightsChunk, WeightsUpdated, WorkerKind,
)
from areal.workers.base import Worker
from areal.workers.rollout.engine import DiskWeights, SamplingParams, TensorWeights
from areal.workers.rollout.factory import make_engine
from areal.workers.rollout.interruptible import InterruptibleGenerator

log = logging.getLogger(__name__)


class RolloutWorker(Worker):
    kind = WorkerKind.ROLLOUT

    async def setup(self, welcome: Welcome) -> int:
        cfg = self.config
        torch.set_num_threads(cfg.rollout.threads)
        self.engine = await make_engine(cfg, self.rank)
        # The engine starts from the model directory: version 0. A worker joining later
        # catches up from the latest weights (disk: now; stream: the controller re-sends them).
        self.generator = InterruptibleGenerator(self.engine, version=0)
        if welcome.weights_path and welcome.version > 0:
            await self.generator.update_weights(DiskWeights(welcome.weights_path),
                                                welcome.version)
        self._requests: dict[str, asyncio.Task] = {}
        self._updates: asyncio.Queue = asyncio.Queue()
        self._stream: tuple[UpdateWeights, list[WeightsChunk]] | None = None
        self._generated_tokens = 0
        self.spawn(self._update_loop(), "weight-updates")
        return welcome.version

    def num_running(self) -> int:
        return len(self._requests)

    def stats(self) -> dict[str, float]:
        return {"rollout/generated_tokens": float(self._generated_tokens)}

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Generate):
            task = self.spawn(self._generate(msg), msg.request_id)
            self._requests[msg.request_id] = task
            task.add_done_callback(lambda _, rid=msg.request_id: self._requests.pop(rid, None))
        elif isinstance(msg, Cancel):
            for request_id in msg.request_ids:
                task = self._requests.pop(request_id, None)
                if task is not None:
                    task.cancel()
        elif isinstance(msg, UpdateWeights):
            self._on_update(msg)
        elif isinstance(msg, WeightsChunk):
            self._on_chunk(msg)
        else:
            log.warning("rollout worker ignores %s", type(msg).__name__)

    def _on_update(self, msg: UpdateWeights) -> None:
        # Block new requests *now*, before any later Generate is handled: their tokens must
        # carry the new version.
        self.generator.hold_new_requests()
        if msg.mode == "disk":
            self._updates.put_nowait((msg, DiskWeights(msg.path)))
        elif msg.mode == "stream":
            self._stream = (msg, [])
            if msg.num_chunks == 0:
                raise ValueError(f"stream update to version {msg.version} with no chunks")
        else:
            raise ValueError(f"weight_sync.mode={msg.mode!r} is not supported by this worker")

    def _on_chunk(self, msg: WeightsChunk) -> None:
        if self._stream is None or self._stream[0].version != msg.version:
            log.warning("dropping a weight chunk of version %d: no stream update pending",
                        msg.version)
            return
        update, chunks = self._stream
        chunks.append(msg)
        if len(chunks) == update.num_chunks:
            tensors = {name: tensor for chunk in chunks
                       for name, tensor in zip(chunk.names, chunk.tensors, strict=True)}
            self._stream = None
            self._updates.put_nowait((update, TensorWeights(tensors)))

    async def _update_loop(self) -> None:
        while True:
            update, source = await self._updates.get()
            start = time.monotonic()
            num_interrupted = await self.generator.update_weights(
                source, update.version, interrupt=update.interrupt)
            await self.send(WeightsUpdated(version=update.version,
                                           pause_s=time.monotonic() - start,
                                           num_interrupted=num_interrupted))

    async def _generate(self, msg: Generate) -> None:
        start = time.monotonic()
        params = SamplingParams(max_new_tokens=msg.max_new_tokens, temperature=msg.temperature,
                                top_p=msg.top_p, stop_token_ids=list(msg.stop_token_ids))
        result = await self.generator.generate(msg.request_id, msg.prompt_ids.tolist(), params)
        self._generated_tokens += len(result.token_ids)
        await self.send(Generated(
            request_id=msg.request_id, output_ids=result.token_ids_array(),
            logprobs=result.logprobs_array(), versions=result.versions_array(),
            finish_reason=result.finish_reason, num_interruptions=result.num_interruptions,
            generation_s=time.monotonic() - start))

    async def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.close()
