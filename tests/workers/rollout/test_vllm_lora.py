"""vLLM serving LoRA adapters (the real vLLM, its CPU build here): each published version is
a new adapter under its own name; per version, vLLM's log-probs (scored and sampled) equal
the trainer's recomputation under that adapter; an interrupted sequence continues on the
new adapter with each token's log-prob matching its own version; without interruption,
running sequences finish on the adapter they started on; adapters nobody uses any more are
removed with their files; bad adapters are refused and the served one stays.

One LoRA engine serves the module (vLLM takes ~45 s to start on CPU); tests leave it
serving some adapter, and each test names the versions it loads, higher than any before.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from lora_helpers import (
    LORA,
    adapted_model,
    assert_interrupted_onto_new_adapter,
    random_adapters,
)
from rollout_helpers import assert_close, random_prompts, recompute_logprobs

from areal.config import load_config
from areal.models.lora import save_adapter_dir
from areal.models.logprobs import packed_logprobs
from areal.models.weights import WeightMismatchError
from areal.workers.rollout import factory
from areal.workers.rollout.engine import (
    AdapterWeights,
    DiskWeights,
    EngineState,
    FinishReason,
    SamplingParams,
)
from areal.workers.rollout.interruptible import InterruptibleGenerator

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ATOL = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(weights_dirs: tuple[Path, Path]):
    cfg = load_config(
        None,
        [
            f"model.path={weights_dirs[0]}",
            "rollout.engine=vllm",
            "rollout.max_concurrent=32",
            "rollout.vllm.max_model_len=384",
            "rollout.vllm.cpu_kvcache_space_gb=0.25",
            f"trainer.lora.rank={LORA.rank}",
            f"trainer.lora.alpha={LORA.alpha}",
        ],
    )
    engine = await factory.make_engine(cfg)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def versions(weights_dirs):
    """Adapters of versions 1-4 and the trainer-side model of each (0: zero B)."""
    tensors = {v: random_adapters(weights_dirs[0], seed=v) for v in (1, 2, 3, 4)}
    models = {v: adapted_model(weights_dirs[0], tensors.get(v)) for v in (0, 1, 2, 3, 4)}
    return tensors, models


async def load(engine, source) -> None:
    await engine.pause()
    try:
        await engine.update_weights(source)
    finally:
        await engine.resume()


def trainer_logprobs(model, sequences: list[list[int]]) -> list[float]:
    cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    with torch.no_grad():
        packed = packed_logprobs(model, torch.tensor([t for s in sequences for t in s]), cu)
    return [
        v
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
        for v in [0.0] + packed[a + 1 : b].tolist()
    ]


async def scores(engine, sequences):
    return [v for s in await asyncio.gather(*(engine.score(s) for s in sequences)) for v in s]


async def test_each_version_is_a_new_adapter_matching_the_trainer(
    engine, weights_dirs, versions, tmp_path
):
    tensors, models = versions
    assert engine.adapters.current_name is None  # version 0: the base, no adapter
    sequences = random_prompts(6, min_len=30, max_len=90, seed=41)
    assert_close(
        await scores(engine, sequences),
        trainer_logprobs(models[0], sequences),
        atol=ATOL,
        what="vLLM base vs trainer adapter v0 (B = 0)",
    )
    v2_dir = save_adapter_dir(
        tmp_path / "v2", tensors[2].items(), LORA, base_model=str(weights_dirs[0])
    )
    for version, source in (
        (1, AdapterWeights(1, tensors=tensors[1])),
        (2, AdapterWeights(2, path=v2_dir)),
    ):
        await load(engine, source)
        assert engine.adapters.current_name == f"v{version}"
        assert engine.adapters.registered_names == [f"v{version}"]  # the older one removed
        got = await scores(engine, sequences)
        assert_close(
            got,
            trainer_logprobs(models[version], sequences),
            atol=ATOL,
            what=f"vLLM vs trainer under adapter v{version}",
        )
        moved = (torch.tensor(got) - torch.tensor(trainer_logprobs(models[0], sequences))).abs()
        assert moved.max() > 1.0, f"adapter v{version} barely moved log-probs"
        prompts = sequences[:4]
        outs = await asyncio.gather(
            *(
                engine.generate(
                    f"s{version}-{i}", p, SamplingParams(max_new_tokens=16, temperature=0.7)
                )
                for i, p in enumerate(prompts)
            )
        )
        assert_close(
            [lp for o in outs for lp in o.logprobs],
            torch.cat(
                [
                    recompute_logprobs(models[version], p, o.token_ids, temperature=0.7)
                    for p, o in zip(prompts, outs, strict=True)
                ]
            ),
            atol=ATOL,
            what=f"sampled log-probs under adapter v{version}",
        )
    # The adapter written from tensors (v1) lived in /dev/shm and went with its adapter.
    assert not list(Path("/dev/shm").glob("areal-adapter-v1-*"))


async def test_interrupted_sequences_continue_on_the_new_adapter(engine, versions):
    tensors, models = versions
    await load(engine, AdapterWeights(2, tensors=tensors[2]))
    generator = InterruptibleGenerator(engine, version=2)
    prompts = random_prompts(6, min_len=4, max_len=50, seed=42)
    await assert_interrupted_onto_new_adapter(
        generator,
        prompts,
        AdapterWeights(3, tensors=tensors[3]),
        models,
        max_new_tokens=120,
        atol=ATOL,
    )
    assert engine.adapters.registered_names == ["v3"]


async def test_without_interruption_sequences_finish_on_their_adapter(engine, versions):
    tensors, models = versions
    generator = InterruptibleGenerator(engine, version=3)
    prompts = random_prompts(4, min_len=4, max_len=30, seed=43)
    params = SamplingParams(max_new_tokens=60, temperature=1.0)
    tasks = [
        asyncio.create_task(generator.generate(f"d{i}", p, params)) for i, p in enumerate(prompts)
    ]
    await generator.generate("probe", prompts[0], SamplingParams(max_new_tokens=4))
    update = asyncio.create_task(
        generator.update_weights(AdapterWeights(4, tensors=tensors[4]), 4, interrupt=False)
    )
    late = asyncio.create_task(generator.generate("late", prompts[1], params))
    results = await asyncio.gather(*tasks)
    assert await update == 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.versions == [3] * 60 and result.num_interruptions == 0
        assert_close(
            result.logprobs,
            recompute_logprobs(models[3], prompt, result.token_ids, temperature=1.0),
            atol=ATOL,
            what="tokens finished on the adapter they started on",
        )
    late_result = await late
    assert late_result.versions == [4] * 60
    assert_close(
        late_result.logprobs,
        recompute_logprobs(models[4], prompts[1], late_result.token_ids, temperature=1.0),
        atol=ATOL,
        what="a request held during the update runs on the new adapter",
    )
    assert engine.adapters.registered_names == ["v4"]


async def test_bad_adapters_are_refused_and_the_served_one_stays(engine, weights_dirs, versions):
    tensors, models = versions
    first = next(iter(tensors[4]))
    wrong_rank = dict(tensors[4], **{first: torch.zeros(4, tensors[4][first].shape[1])})
    missing = {n: t for n, t in tensors[4].items() if n != first}
    await engine.pause()
    for bad, match in ((wrong_rank, "has shape"), (missing, "no tensor for")):
        with pytest.raises(WeightMismatchError, match=match):
            await engine.update_weights(AdapterWeights(5, tensors=bad))
    with pytest.raises(TypeError, match="cannot load full weights"):
        await engine.update_weights(DiskWeights(weights_dirs[1]))
    await engine.resume()
    assert engine.state is EngineState.RUNNING and engine.adapters.current_name == "v4"
    sequences = random_prompts(3, min_len=20, max_len=40, seed=44)
    assert_close(
        await scores(engine, sequences),
        trainer_logprobs(models[4], sequences),
        atol=ATOL,
        what="adapter v4 after refused updates",
    )
    out = await engine.generate("x", sequences[0], SamplingParams(max_new_tokens=5))
    assert out.finish_reason is FinishReason.LENGTH
