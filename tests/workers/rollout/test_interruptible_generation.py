"""Interruptible generation over the real torch engine: sequences cut by a weight update
finish with tokens of two versions whose log-probs match their own weights; interrupt=False
lets running sequences finish first; held or late requests get the new version."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_helpers import assert_close, random_prompts, recompute_logprobs

from areal.models.weights import WeightMismatchError
from areal.seeds import continuation_seed
from areal.workers.rollout.engine import DiskWeights, FinishReason, SamplingParams, TensorWeights
from areal.workers.rollout.interruptible import GenerationResult, InterruptibleGenerator

ATOL = 1e-4


def assert_logprobs_per_version(
    prompt: list[int],
    result: GenerationResult,
    models: tuple[torch.nn.Module, ...],
    temperature: float,
) -> None:
    """Each token's log-prob equals a full forward of the weights of that token's version."""
    for version, model in enumerate(models):
        positions = [i for i, v in enumerate(result.versions) if v == version]
        if not positions:
            continue
        recomputed = recompute_logprobs(model, prompt, result.token_ids, temperature=temperature)
        assert_close(
            [result.logprobs[i] for i in positions],
            recomputed[positions],
            atol=ATOL,
            what=f"log-probs of version-{version} tokens",
        )


async def _wait_for_progress(generator: InterruptibleGenerator, prompt: list[int]) -> None:
    """Return once the engine has decoded a few steps of everything running with it.

    A short request is decoded in the same batches as the running ones, so when it is done
    they have about as many tokens (it counts engine steps, not seconds).
    """
    done = await generator.generate("probe", prompt, SamplingParams(max_new_tokens=6))
    assert len(done.token_ids) == 6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_interrupted_sequences_mix_versions_with_matching_logprobs(
    make_engine, weights_dirs, reference_models, temperature
):
    generator = InterruptibleGenerator(await make_engine(), version=0)
    prompts = random_prompts(8, min_len=4, max_len=60, seed=11)
    params = SamplingParams(max_new_tokens=120, temperature=temperature)
    tasks = [
        asyncio.create_task(generator.generate(f"i{i}", p, params)) for i, p in enumerate(prompts)
    ]
    await _wait_for_progress(generator, prompts[0])
    assert generator.num_in_engine == len(prompts)
    num_interrupted = await generator.update_weights(DiskWeights(weights_dirs[1]), 1)
    assert num_interrupted == len(prompts)
    assert generator.version == 1
    for prompt, result in zip(prompts, await asyncio.gather(*tasks), strict=True):
        assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 120
        assert result.num_interruptions == 1
        switch = result.versions.index(1)  # raises if no token has version 1
        assert switch > 0 and result.versions == [0] * switch + [1] * (120 - switch)
        assert_logprobs_per_version(prompt, result, reference_models, temperature)


async def test_interrupt_false_lets_running_sequences_finish_first(
    make_engine, weights_dirs, reference_models
):
    generator = InterruptibleGenerator(await make_engine(), version=0)
    prompts = random_prompts(4, min_len=4, max_len=30, seed=12)
    params = SamplingParams(max_new_tokens=60)
    running = [
        asyncio.create_task(generator.generate(f"r{i}", p, params)) for i, p in enumerate(prompts)
    ]
    await _wait_for_progress(generator, prompts[0])
    update = asyncio.create_task(
        generator.update_weights(DiskWeights(weights_dirs[1]), 1, interrupt=False)
    )
    await asyncio.sleep(0)  # the update closes the gate; a new request must wait for it
    late = asyncio.create_task(generator.generate("late", prompts[1], params))
    assert await update == 0
    for prompt, result in zip(prompts, await asyncio.gather(*running), strict=True):
        assert result.versions == [0] * 60 and result.num_interruptions == 0
        assert_logprobs_per_version(prompt, result, reference_models, 1.0)
    result = await late
    assert result.versions == [1] * 60
    assert_logprobs_per_version(prompts[1], result, reference_models, 1.0)


async def test_held_requests_wait_for_the_update_and_get_its_version(
    make_engine, weights_dirs, reference_models
):
    generator = InterruptibleGenerator(await make_engine(), version=3)
    prompt = random_prompts(1, min_len=8, max_len=8, seed=13)[0]
    generator.hold_new_requests()
    held = asyncio.create_task(generator.generate("h", prompt, SamplingParams(max_new_tokens=20)))
    for _ in range(3):
        await asyncio.sleep(0)
    assert generator.num_in_engine == 0 and not held.done()
    assert await generator.update_weights(DiskWeights(weights_dirs[1]), 4) == 0
    result = await held
    assert result.versions == [4] * 20
    assert_logprobs_per_version(
        prompt,
        GenerationResult(
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            versions=[1] * 20,
            finish_reason=result.finish_reason,
            num_interruptions=0,
        ),
        reference_models,
        1.0,
    )


async def test_failed_updates_keep_the_old_weights_and_serve_on(
    make_engine, weights_dirs, reference_models
):
    generator = InterruptibleGenerator(await make_engine(), version=2)
    prompt = [7, 8, 9, 10]
    with pytest.raises(ValueError, match="version 2 is not newer than the served version 2"):
        await generator.update_weights(DiskWeights(weights_dirs[1]), 2)
    with pytest.raises(WeightMismatchError):
        await generator.update_weights(TensorWeights({"lm_head.bias": torch.zeros(3)}), 3)
    assert generator.version == 2
    result = await generator.generate("a", prompt, SamplingParams(max_new_tokens=10))
    assert result.versions == [2] * 10
    assert_close(
        result.logprobs,
        recompute_logprobs(reference_models[0], prompt, result.token_ids, temperature=1.0),
        atol=ATOL,
        what="log-probs under the unchanged weights",
    )


async def test_updates_back_to_back_interrupt_sequences_twice(
    make_engine, weights_dirs, reference_models
):
    generator = InterruptibleGenerator(await make_engine(), version=0)
    prompt = random_prompts(1, min_len=12, max_len=12, seed=14)[0]
    task = asyncio.create_task(
        generator.generate("t", prompt, SamplingParams(max_new_tokens=150, temperature=0.7))
    )
    await _wait_for_progress(generator, prompt)
    await generator.update_weights(DiskWeights(weights_dirs[1]), 1)
    await _wait_for_progress(generator, prompt)
    await generator.update_weights(DiskWeights(weights_dirs[0]), 2)
    result = await task
    assert result.num_interruptions == 2 and len(result.token_ids) == 150
    assert result.versions == sorted(result.versions) and set(result.versions) == {0, 1, 2}
    # Version 2 carries the weights of version 0.
    as_weights = [v % 2 for v in result.versions]
    assert_logprobs_per_version(
        prompt,
        GenerationResult(
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            versions=as_weights,
            finish_reason=result.finish_reason,
            num_interruptions=2,
        ),
        reference_models,
        0.7,
    )


async def test_an_abort_not_caused_by_an_update_is_an_error(make_engine):
    engine = await make_engine()
    generator = InterruptibleGenerator(engine, version=0)
    await engine.pause()  # behind the generator's back
    with pytest.raises(
        RuntimeError, match="only InterruptibleGenerator.update_weights may pause the engine"
    ):
        await generator.generate("x", [5, 6], SamplingParams(max_new_tokens=4))


async def test_a_cancelled_update_leaves_the_generator_serving_consistently(
    make_engine, weights_dirs, reference_models
):
    generator = InterruptibleGenerator(await make_engine(), version=0)
    prompt = [9, 8, 7, 6]
    running = asyncio.create_task(
        generator.generate("r", prompt, SamplingParams(max_new_tokens=100))
    )
    await _wait_for_progress(generator, prompt)
    update = asyncio.create_task(generator.update_weights(DiskWeights(weights_dirs[1]), 1))
    await asyncio.sleep(0)  # the update has closed the gate and is pausing the engine
    update.cancel()
    with pytest.raises(asyncio.CancelledError):
        await update
    # The pause happened, the load did not: the sequence continues on version 0 weights.
    result = await running
    assert generator.version == 0 and result.num_interruptions == 1
    assert result.versions == [0] * 100
    assert_logprobs_per_version(prompt, result, reference_models, 1.0)


async def test_an_interrupted_seeded_sequence_continues_on_its_derived_stream(
    make_engine, weights_dirs
):
    """The continuation after k tokens samples with continuation_seed(seed, k): the same
    tokens as a fresh request of prompt + those k tokens with that seed, under the new
    weights; the first segment is the uninterrupted sequence's beginning."""
    engine = await make_engine()
    generator = InterruptibleGenerator(engine, version=0)
    prompt = random_prompts(1, min_len=4, max_len=30, seed=12)[0]
    params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=2024)
    uninterrupted = await generator.generate("whole", prompt, params)
    task = asyncio.create_task(generator.generate("cut", prompt, params))
    await _wait_for_progress(generator, prompt)
    await generator.update_weights(DiskWeights(weights_dirs[1]), 1)
    cut = await task
    k = cut.versions.index(1)
    assert 0 < k < 120 and cut.token_ids[:k] == uninterrupted.token_ids[:k]
    rest = await engine.generate(
        "rest",
        prompt + cut.token_ids[:k],
        SamplingParams(max_new_tokens=120 - k, temperature=1.0, seed=continuation_seed(2024, k)),
    )
    assert cut.token_ids[k:] == rest.token_ids
