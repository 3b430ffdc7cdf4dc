"""The built-in engine serving LoRA adapters (applied, unmerged): per version, its behaviour
log-probs equal the trainer's recomputation under the same adapter; version 0 (B = 0) is
the base exactly; an interrupted sequence continues on the new adapter with each token's
log-prob matching its own version; bad updates are refused and keep the adapter."""

from __future__ import annotations

import asyncio

import pytest
import torch
from lora_helpers import (
    LORA,
    adapted_model,
    assert_interrupted_onto_new_adapter,
    random_adapters,
)
from rollout_helpers import assert_close, random_prompts

from areal.models.lora import AdapterMismatchError, save_adapter_dir
from areal.models.logprobs import packed_logprobs
from areal.workers.rollout.engine import (
    AdapterWeights,
    DiskWeights,
    FinishReason,
    SamplingParams,
)
from areal.workers.rollout.interruptible import InterruptibleGenerator

ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(weights_dirs, tmp_path_factory):
    """Versions 1 and 2 as tensors, version 2 also as a PEFT directory."""
    v1, v2 = random_adapters(weights_dirs[0], seed=1), random_adapters(weights_dirs[0], seed=2)
    v2_dir = save_adapter_dir(
        tmp_path_factory.mktemp("adapter-v2"), v2.items(), LORA, base_model=str(weights_dirs[0])
    )
    return {1: v1, 2: v2}, v2_dir


@pytest.fixture(scope="module")
def lora_models(weights_dirs, adapters):
    tensors, _ = adapters
    return {v: adapted_model(weights_dirs[0], tensors.get(v)) for v in (0, 1, 2)}


def trainer_logprobs(model, prompts, outs, temperature):
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    with torch.no_grad():
        packed = packed_logprobs(
            model, torch.tensor([t for s in seqs for t in s]), cu, temperature=temperature
        )
    return torch.cat(
        [
            packed[s + len(p) : s + len(p) + len(o.token_ids)]
            for s, p, o in zip(cu[:-1].tolist(), prompts, outs, strict=True)
        ]
    )


async def test_each_adapter_version_matches_the_trainer(
    make_engine, weights_dirs, adapters, lora_models, reference_models
):
    tensors, v2_dir = adapters
    engine = await make_engine(lora=LORA)
    prompts = random_prompts(16, min_len=2, max_len=60, seed=31)
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    sources = {1: AdapterWeights(1, tensors=tensors[1]), 2: AdapterWeights(2, path=v2_dir)}
    served = {}
    for version in (0, 1, 2):
        if version:
            await engine.pause()
            await engine.update_weights(sources[version])
            await engine.resume()
        outs = await asyncio.gather(
            *(engine.generate(f"v{version}-{i}", p, params) for i, p in enumerate(prompts))
        )
        assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
        got = [lp for o in outs for lp in o.logprobs]
        assert_close(
            got,
            trainer_logprobs(lora_models[version], prompts, outs, 1.0),
            atol=ATOL,
            what=f"engine vs trainer under adapter v{version}",
        )
        served[version] = (outs, got)
    # Version 0 is the base model: its zero-B adapters add exactly nothing.
    outs0, got0 = served[0]
    assert_close(
        trainer_logprobs(lora_models[0], prompts, outs0, 1.0),
        trainer_logprobs(reference_models[0], prompts, outs0, 1.0),
        atol=0.0,
        what="adapter v0 vs the base model (trainer forward)",
    )
    assert_close(
        got0,
        trainer_logprobs(reference_models[0], prompts, outs0, 1.0),
        atol=ATOL,
        what="engine at adapter v0 vs the base model",
    )
    # The adapters matter: v2's tokens are unlikely under v0.
    outs2, got2 = served[2]
    moved = (torch.tensor(got2) - trainer_logprobs(lora_models[0], prompts, outs2, 1.0)).abs()
    assert moved.max() > 1.0, f"adapter v2 barely changed log-probs ({moved.max():.3f})"


async def test_interrupted_sequence_continues_on_the_new_adapter(
    make_engine, adapters, lora_models
):
    tensors, _ = adapters
    generator = InterruptibleGenerator(await make_engine(lora=LORA), version=0)
    prompts = random_prompts(6, min_len=4, max_len=40, seed=32)
    await assert_interrupted_onto_new_adapter(
        generator,
        prompts,
        AdapterWeights(1, tensors=tensors[1]),
        lora_models,
        max_new_tokens=100,
        atol=ATOL,
    )


async def test_bad_updates_are_refused_and_keep_the_adapter(
    make_engine, weights_dirs, adapters, lora_models
):
    tensors, _ = adapters
    engine = await make_engine(lora=LORA)
    await engine.pause()
    await engine.update_weights(AdapterWeights(1, tensors=tensors[1]))
    first = next(iter(tensors[1]))
    wrong_rank = dict(tensors[1], **{first: torch.zeros(4, tensors[1][first].shape[1])})
    missing = {n: t for n, t in tensors[1].items() if n != first}
    unknown = dict(tensors[1], **{"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 128)})
    for bad, match in (
        (wrong_rank, "has shape"),
        (missing, "no tensor for adapter weight"),
        (unknown, "no counterpart"),
    ):
        with pytest.raises(AdapterMismatchError, match=match):
            await engine.update_weights(AdapterWeights(2, tensors=bad))
    with pytest.raises(TypeError, match="cannot load full weights"):
        await engine.update_weights(DiskWeights(weights_dirs[1]))
    await engine.resume()
    prompts = random_prompts(4, min_len=5, max_len=20, seed=33)
    outs = await asyncio.gather(
        *(
            engine.generate(f"k{i}", p, SamplingParams(max_new_tokens=10))
            for i, p in enumerate(prompts)
        )
    )
    assert_close(
        [lp for o in outs for lp in o.logprobs],
        trainer_logprobs(lora_models[1], prompts, outs, 1.0),
        atol=ATOL,
        what="adapter v1 after refused updates",
    )
