"""The rollout worker's update queue over the real torch engine: a worker that falls behind
skips disk versions the trainer may already have pruned and serves the newest one; a version
broadcast again (collective mode) never leaves new requests waiting; a worker whose Welcome
names weights gone by the time it loads them starts at version 0 (on vLLM too, in its CI
stage)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from rollout_helpers import random_prompts
from safetensors.torch import load_file

from areal.config import load_config
from areal.messages import GroupStatus, UpdateWeights, WeightsUpdated, Welcome
from areal.workers.rollout.engine import SamplingParams
from areal.workers.rollout.interruptible import InterruptibleGenerator
from areal.workers.collective import SerialThread
from areal.workers.rollout.worker import RolloutWorker


def updating_worker(engine, version: int) -> RolloutWorker:
    """A rollout worker's update path (what `setup` builds for it), without a controller."""
    worker = RolloutWorker("tcp://127.0.0.1:1", "rollout-test", secret="")
    worker.config = load_config()  # what the Welcome brings (full weights: no trainer.lora)
    worker.generator = InterruptibleGenerator(engine, version=version)
    worker._updates = asyncio.Queue()
    worker._collective_hold, worker._announced = False, 0
    return worker


async def test_a_worker_behind_skips_pruned_disk_versions(make_engine, weights_dirs, tmp_path):
    worker = updating_worker(await make_engine(), version=3)
    sent: list[WeightsUpdated] = []

    async def send(msg) -> None:
        sent.append(msg)

    worker.send = send
    # Versions 4 and 5 arrive before the worker gets to load 4, whose directory is gone.
    worker._on_update(UpdateWeights(version=4, mode="disk", path=str(tmp_path / "pruned")))
    worker._on_update(UpdateWeights(version=5, mode="disk", path=str(weights_dirs[1])))
    prompt = random_prompts(1, min_len=8, max_len=8, seed=5)[0]
    held = asyncio.create_task(
        worker.generator.generate("h", prompt, SamplingParams(max_new_tokens=6))
    )
    loop = asyncio.create_task(worker._update_loop())
    try:
        result = await asyncio.wait_for(held, 60)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert [m.version for m in sent] == [5]
    assert worker.generator.version == 5 and result.versions == [5] * 6


def test_a_disk_update_without_a_path_is_refused_before_new_requests_wait_on_it(tmp_path):
    worker = RolloutWorker("tcp://127.0.0.1:1", "rollout-test", secret="")
    worker.config = load_config()
    held = []
    worker.generator = SimpleNamespace(hold_new_requests=lambda: held.append(True))
    worker._updates = asyncio.Queue()
    with pytest.raises(ValueError, match="disk update to version 2 names no path"):
        worker._on_update(UpdateWeights(version=2, mode="disk"))
    assert worker._updates.empty() and not held  # new requests were never held for it


class ReceivedWeights:
    """Stands in for the weights group of one worker (tests/workers/test_collective.py tests
    the real broadcast): `receive` hands over a saved weight set, at once or when let go."""

    def __init__(self, weights_dir) -> None:
        self.tensors = load_file(str(weights_dir / "model.safetensors"))
        self.let_go: dict[int, threading.Event] = {}

    def receive(self, manifest, generation: int) -> dict:
        if generation in self.let_go:
            self.let_go[generation].wait(60)
        return self.tensors


async def test_a_version_broadcast_again_while_it_loads_does_not_hold_requests(
    make_engine, weights_dirs
):
    """The controller broadcasts the current version again when a late rollout worker joins
    (re-formed group). If that copy arrives while the first copy of the same version loads,
    it takes the gate's hold, and is then dropped as already served: the hold must go with
    it, or every later Generate waits for a version that never comes (a whole remote run
    stood still at step 60 this way)."""
    worker = updating_worker(await make_engine(), version=3)
    group = ReceivedWeights(weights_dirs[1])
    group.let_go[2] = threading.Event()
    worker._weights_member = SimpleNamespace(thread=SerialThread("weights-test"), group=group)
    sent: list = []

    async def send(msg) -> None:
        sent.append(msg)

    worker.send = send
    loop = asyncio.create_task(worker._update_loop())
    try:
        worker._on_collective_update(UpdateWeights(version=4, mode="collective", generation=1))
        while worker._collective_hold:  # the first copy is received and now loads
            await asyncio.sleep(0)
        assert worker.generator.version == 3, "the first copy loaded before the second came"
        worker._on_collective_update(UpdateWeights(version=4, mode="collective", generation=2))
        assert worker._collective_hold  # the race: the second copy took the hold
        group.let_go[2].set()
        prompt = random_prompts(1, min_len=8, max_len=8, seed=5)[0]
        result = await asyncio.wait_for(
            worker.generator.generate("after", prompt, SamplingParams(max_new_tokens=6)), 60
        )
    finally:
        group.let_go[2].set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert [m.version for m in sent] == [4]  # one load, one WeightsUpdated
    assert result.versions == [4] * 6 and not worker._collective_hold


async def test_a_failed_broadcast_keeps_requests_waiting_for_its_version(make_engine, weights_dirs):
    """A receive that fails leaves the announced version to come (the controller re-forms
    the group and sends it again): requests wait for it instead of sampling old weights."""
    worker = updating_worker(await make_engine(), version=3)
    group = ReceivedWeights(weights_dirs[1])

    def receive(manifest, generation: int) -> dict:
        if generation == 1:
            raise RuntimeError("a member died in the broadcast")
        return group.tensors

    worker._weights_member = SimpleNamespace(
        thread=SerialThread("weights-test"), group=SimpleNamespace(receive=receive)
    )
    sent: list = []

    async def send(msg) -> None:
        sent.append(msg)

    worker.send = send
    loop = asyncio.create_task(worker._update_loop())
    prompt = random_prompts(1, min_len=8, max_len=8, seed=5)[0]
    try:
        worker._on_collective_update(UpdateWeights(version=4, mode="collective", generation=1))
        waiting = asyncio.create_task(
            worker.generator.generate("waits", prompt, SamplingParams(max_new_tokens=6))
        )
        while not any(isinstance(m, GroupStatus) for m in sent):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not waiting.done() and worker.generator.version == 3
        worker._on_collective_update(UpdateWeights(version=4, mode="collective", generation=2))
        result = await asyncio.wait_for(waiting, 60)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert result.versions == [4] * 6
    assert [type(m).__name__ for m in sent] == ["GroupStatus", "WeightsUpdated"]


VLLM_OVERRIDES = [
    "rollout.engine=vllm",
    "rollout.max_concurrent=8",
    "rollout.vllm.max_model_len=256",
    "rollout.vllm.cpu_kvcache_space_gb=0.25",
]


@pytest.mark.parametrize(
    ("engine", "mode"),
    [
        ("torch", "disk"),
        ("torch", "shm"),
        # On vLLM the slot is read in the worker's own process too (vllm_engine's
        # `_update_weights`), and a gone version directory is read as a slot (`path_source`):
        # one case stands for both modes. vLLM takes half a minute to start on CPU.
        pytest.param("vllm", "disk", marks=[pytest.mark.vllm, pytest.mark.slow]),
    ],
)
async def test_a_welcome_whose_weights_are_gone_leaves_the_worker_ready_at_version_0(
    weights_dirs, tmp_path, caplog, engine, mode
):
    """The trainer pruned (disk) or overwrote (shm) the version the Welcome named while the
    worker set up: it becomes ready at version 0, which the controller's `on_ready` answers
    with the newest weights, instead of failing its start (and being restarted, counted
    towards a crash loop). Its engine serves version 0 meanwhile: the failed load left it
    running on the model's weights."""
    overrides = VLLM_OVERRIDES if engine == "vllm" else []
    cfg = load_config(
        overrides=[f"model.path={weights_dirs[0]}", f"run_dir={tmp_path}", *overrides]
    )
    worker = RolloutWorker("tcp://127.0.0.1:1", "rollout-0", secret="")
    worker.config = cfg
    gone = tmp_path / "weights" / "v000003" if mode == "disk" else tmp_path / "slot-1.bin"
    welcome = Welcome(config={}, version=3, weights_path=str(gone))
    try:
        assert await worker.setup(welcome) == 0
        (prompt,) = random_prompts(1, min_len=4, max_len=8)
        result = await asyncio.wait_for(
            worker.generator.generate("after", prompt, SamplingParams(max_new_tokens=6)), 120
        )
    finally:
        await worker.close()
    (warning,) = [
        r.getMessage() for r in caplog.records if "named by the Welcome" in r.getMessage()
    ]
    assert "weights version 3 named by the Welcome are gone" in warning
    assert "ready at version 0" in warning
    assert result.versions == [0] * len(result.token_ids) and result.token_ids
