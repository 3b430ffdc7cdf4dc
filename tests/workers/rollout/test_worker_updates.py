"""The rollout worker's update queue over the real torch engine: a worker that falls behind
skips disk versions the trainer may already have pruned and serves the newest one."""

from __future__ import annotations

import asyncio

from rollout_helpers import random_prompts

from areal.messages import UpdateWeights, WeightsUpdated
from areal.workers.rollout.engine import SamplingParams
from areal.workers.rollout.interruptible import InterruptibleGenerator
from areal.workers.rollout.worker import RolloutWorker


async def test_a_worker_behind_skips_pruned_disk_versions(make_engine, weights_dirs, tmp_path):
    worker = RolloutWorker("tcp://127.0.0.1:1", "rollout-test", secret="")
    worker.generator = InterruptibleGenerator(await make_engine(), version=3)
    worker._updates = asyncio.Queue()
    sent: list[WeightsUpdated] = []

    async def send(msg) -> None:
        sent.append(msg)

    worker.send = send
    # Versions 4 and 5 arrive before the worker gets to load 4, whose directory is gone.
    worker._on_update(UpdateWeights(version=4, mode="disk", path=str(tmp_path / "pruned")))
    worker._on_update(UpdateWeights(version=5, mode="disk", path=str(weights_dirs[1])))
    prompt = random_prompts(1, min_len=8, max_len=8, seed=5)[0]
    held = asyncio.create_task(worker.generator.generate("h", prompt,
                                                         SamplingParams(max_new_tokens=6)))
    loop = asyncio.create_task(worker._update_loop())
    try:
        result = await asyncio.wait_for(held, 60)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert [m.version for m in sent] == [5]
    assert worker.generator.version == 5 and result.versions == [5] * 6
