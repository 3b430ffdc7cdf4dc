"""What the rollout worker makes of each kind of update, over the real torch engine: with
LoRA (trainer.lora), a disk version directory, streamed chunks, a shared-memory slot and a
collective receive each deliver the adapter alone, and the worker then serves it (its
log-probs equal the trainer's under that adapter); without LoRA a shm slot is read in place.
Only the update path of the worker runs (no controller), as in test_worker_updates.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from lora_helpers import LORA, adapted_model, random_adapters
from rollout_helpers import assert_close, random_prompts, recompute_logprobs
from test_worker_updates import updating_worker

from areal.config import load_config
from areal.messages import UpdateWeights
from areal.models.weight_slots import SlotWriter
from areal.models.weights import load_tensors
from areal.workers.collective import SerialThread
from areal.workers.rollout.engine import SamplingParams
from areal.workers.trainer.publish import publish_to_disk, stream_chunks

ATOL = 1e-4


async def _apply(worker, update) -> None:
    """Hand the worker one update (`update()` delivers its messages) and run its update
    loop until the worker reports it applied."""
    sent = []

    async def send(msg) -> None:
        sent.append(msg)

    worker.send = send
    loop = asyncio.create_task(worker._update_loop())
    try:
        update()
        while not sent:
            await asyncio.sleep(0.01)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert [m.error for m in sent] == [""]


async def _check_serves(worker, model, version: int, seed: int) -> None:
    prompt = random_prompts(1, min_len=10, max_len=10, seed=seed)[0]
    out = await worker.generator.generate(f"c{version}", prompt, SamplingParams(max_new_tokens=12))
    assert out.versions == [version] * 12
    assert_close(
        out.logprobs,
        recompute_logprobs(model, prompt, out.token_ids, temperature=1.0),
        atol=ATOL,
        what=f"served version {version}",
    )


@pytest.mark.slow
async def test_every_mode_delivers_the_adapter_alone(make_engine, weights_dirs, tmp_path):
    cfg = load_config(
        overrides=[
            f"model.path={weights_dirs[0]}",
            f"run_dir={tmp_path}",
            f"trainer.lora.rank={LORA.rank}",
            f"trainer.lora.alpha={LORA.alpha}",
        ]
    )
    worker = updating_worker(await make_engine(lora=LORA), version=0)
    worker.config = cfg
    adapters = {v: random_adapters(weights_dirs[0], seed=v) for v in (1, 2, 3, 4)}
    disk = publish_to_disk(list(adapters[1].items()), cfg, 1)
    chunks = stream_chunks(list(adapters[2].items()), cfg, 2)
    slot = SlotWriter(tmp_path / "slots", 2).publish(list(adapters[3].items()), 3)
    worker._weights_member = SimpleNamespace(
        thread=SerialThread("weights-test"), group=SimpleNamespace(receive=lambda *_: adapters[4])
    )

    def stream() -> None:
        worker._on_update(UpdateWeights(version=2, mode="stream", num_chunks=len(chunks)))
        for chunk in chunks:
            worker._on_chunk(chunk)

    steps = [
        lambda: worker._on_update(UpdateWeights(version=1, mode="disk", path=disk)),
        stream,
        lambda: worker._on_update(UpdateWeights(version=3, mode="shm", path=slot)),
        lambda: worker._on_collective_update(UpdateWeights(version=4, mode="collective")),
    ]
    for version, step in enumerate(steps, start=1):
        await _apply(worker, step)
        await _check_serves(
            worker, adapted_model(weights_dirs[0], adapters[version]), version, seed=version
        )


async def test_shm_full_weights_are_read_in_place(
    make_engine, weights_dirs, reference_models, tmp_path
):
    worker = updating_worker(await make_engine(), version=0)
    worker.config = load_config(
        overrides=[f"model.path={weights_dirs[0]}", f"run_dir={tmp_path}", "weight_sync.mode=shm"]
    )
    writer = SlotWriter(tmp_path / "slots", 2)
    try:
        slot = writer.publish(list(load_tensors(weights_dirs[1]).items()), 1)
        await _apply(
            worker, lambda: worker._on_update(UpdateWeights(version=1, mode="shm", path=slot))
        )
        await _check_serves(worker, reference_models[1], 1, seed=9)
    finally:
        writer.close(remove=True)
