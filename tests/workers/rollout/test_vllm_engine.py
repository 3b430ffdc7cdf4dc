"""The vLLM engine on the real vLLM (CPU build here, no mocks): processed log-probs equal the
trainer's recomputation, weight updates from disk and from tensors reach vLLM's workers (and
the CPU repack is what makes them visible), pause/abort, interrupted sequences with two
versions, and misuse errors.

vLLM takes ~30-45 s to start on CPU, so one engine serves the whole module (built through
the factory, as the rollout worker does). Every test gets it running on weights v0 and
leaves it that way (the `engine` fixture restores it afterwards).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from rollout_helpers import (
    assert_close,
    check_pause_returns_tokens_so_far,
    check_sampled_stops,
    check_top_p_logprobs_are_of_the_nucleus,
    random_prompts,
    recompute_logprobs,
)

from areal.config import load_config
from areal.models.logprobs import packed_logprobs
from areal.models.weights import WeightMismatchError, named_tensors
from areal.workers.rollout import factory
from areal.workers.rollout.engine import (
    DiskWeights,
    EngineState,
    EngineStateError,
    FinishReason,
    SamplingParams,
    TensorWeights,
)
from areal.workers.rollout.interruptible import InterruptibleGenerator

# slow as well: the module's engine takes half a minute to start (out of the fast tier)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ATOL = 1e-4
"""fp32 engine vs fp32 trainer: measured max |diff| ~1e-5 (different kernels, same math)."""
MAX_CONCURRENT = 48
MAX_MODEL_LEN = 384


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_engine(weights_dirs: tuple[Path, Path]):
    cfg = load_config(
        None,
        [
            f"model.path={weights_dirs[0]}",
            "rollout.engine=vllm",
            f"rollout.max_concurrent={MAX_CONCURRENT}",
            f"rollout.vllm.max_model_len={MAX_MODEL_LEN}",
            "rollout.vllm.cpu_kvcache_space_gb=0.25",
        ],
    )
    engine = await factory.make_engine(cfg)
    yield engine
    await engine.close()


@pytest_asyncio.fixture(loop_scope="module")
async def engine(shared_engine, weights_dirs):
    """The module's engine, running on weights v0; restored to that after the test."""
    assert shared_engine.state is EngineState.RUNNING
    yield shared_engine
    if shared_engine.state is EngineState.RUNNING:
        await shared_engine.pause()
    await shared_engine.update_weights(DiskWeights(weights_dirs[0]))
    await shared_engine.resume()


def trainer_logprobs(model: torch.nn.Module, sequences: list[list[int]]) -> list[list[float]]:
    """Per-sequence log-probs from the trainer's packed forward (one pack, fp32)."""
    cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    with torch.no_grad():
        packed = packed_logprobs(model, torch.tensor([t for s in sequences for t in s]), cu)
    return [packed[a:b].tolist() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


async def engine_scores(engine, sequences: list[list[int]]) -> list[list[float]]:
    return list(await asyncio.gather(*(engine.score(s) for s in sequences)))


def flat(values: list[list[float]]) -> list[float]:
    return [v for row in values for v in row]


async def test_options_reach_vllm_through_the_factory(shared_engine):
    config = shared_engine._llm.vllm_config
    assert type(shared_engine).__name__ == "VllmEngine"
    assert config.scheduler_config.max_num_seqs == MAX_CONCURRENT
    assert config.model_config.max_model_len == MAX_MODEL_LEN == shared_engine.max_seq_len
    assert config.model_config.logprobs_mode == "processed_logprobs"
    assert config.model_config.enforce_eager
    if shared_engine._device == "cpu":  # rollout.vllm.cpu_kvcache_space_gb
        assert config.cache_config.kv_cache_memory_bytes == 1 << 28
    assert config.parallel_config.worker_extension_cls.endswith("WeightUpdateExtension")
    assert factory.resolve_engine_name("auto") == "vllm"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_equal_trainer_recomputation(engine, reference_models, temperature):
    prompts = random_prompts(24, min_len=1, max_len=90, seed=int(temperature * 10))
    params = SamplingParams(max_new_tokens=24, temperature=temperature)
    outs = await asyncio.gather(
        *(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts))
    )
    engine_lp, forward_lp = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 24
        engine_lp += out.logprobs
        forward_lp += recompute_logprobs(
            reference_models[0], prompt, out.token_ids, temperature=temperature
        ).tolist()
    assert_close(engine_lp, forward_lp, atol=ATOL, what=f"vLLM vs forward, T={temperature}")


async def test_top_p_logprobs_are_of_the_renormalised_nucleus(engine, reference_models):
    await check_top_p_logprobs_are_of_the_nucleus(engine, reference_models[0], atol=ATOL)


async def test_greedy_equals_argmax_with_zero_logprobs(engine, reference_models):
    prompts = random_prompts(6, min_len=2, max_len=30, seed=4)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    outs = await asyncio.gather(
        *(engine.generate(f"g{i}", p, params) for i, p in enumerate(prompts))
    )
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ids = reference_models[0].generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=20,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.token_ids == ids[0, len(prompt) :].tolist()
        assert out.logprobs == [0.0] * 20


async def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batches(engine):
    """SamplingParams.seed reaches vLLM's per-request generator: alone or among others, the
    same seed draws the same tokens; another seed other tokens."""
    prompts = random_prompts(12, min_len=2, max_len=60, seed=23)
    params = [
        SamplingParams(max_new_tokens=24, temperature=1.0, seed=300 + i)
        for i in range(len(prompts))
    ]
    alone = [await engine.generate(f"a{i}", p, params[i]) for i, p in enumerate(prompts[:3])]
    crowd = await asyncio.gather(
        *(engine.generate(f"b{i}", p, params[i]) for i, p in enumerate(prompts))
    )
    for single, batched in zip(alone, crowd, strict=False):
        assert single.token_ids == batched.token_ids
        assert_close(single.logprobs, batched.logprobs, atol=ATOL, what="alone vs batched")
    other = await engine.generate("c", prompts[0], SamplingParams(max_new_tokens=24, seed=9))
    assert other.token_ids != alone[0].token_ids


async def test_a_seeded_request_whose_prefill_is_split_samples_as_it_does_alone(engine):
    """Prompts longer together than vLLM's token budget per step: some prefills are split
    over steps, and the token sampled at the end of each partial chunk is discarded. vLLM
    rewinds a seeded request's generator by a CUDA offset there, which a CPU generator does
    not have (RuntimeError, engine dead); the plugin restores the generator's state instead
    (vllm_plugin.py), so a split request draws what it draws alone."""
    prompts = random_prompts(MAX_CONCURRENT, min_len=300, max_len=360, seed=24)
    assert sum(map(len, prompts)) > 3 * 4096  # over the CPU backend's budget per step
    params = [
        SamplingParams(max_new_tokens=8, temperature=1.0, seed=500 + i) for i in range(len(prompts))
    ]
    crowd = await asyncio.gather(
        *(engine.generate(f"s{i}", p, params[i]) for i, p in enumerate(prompts))
    )
    for i in (len(prompts) - 2, len(prompts) - 1):  # the last admitted: split if any is
        alone = await engine.generate(f"t{i}", prompts[i], params[i])
        assert alone.token_ids == crowd[i].token_ids
        assert_close(alone.logprobs, crowd[i].logprobs, atol=ATOL, what="alone vs split")


@pytest.mark.parametrize("kind", ["disk", "tensors"])
async def test_update_matches_trainer_under_new_weights_and_differs_from_before(
    engine, weights_dirs, reference_models, kind
):
    sequences = random_prompts(6, min_len=40, max_len=120, seed=21)
    before = await engine_scores(engine, sequences)
    expected = [trainer_logprobs(m, sequences) for m in reference_models]
    assert_close(flat(before), flat(expected[0]), atol=ATOL, what="vLLM vs trainer, v0")
    if kind == "disk":
        source = DiskWeights(weights_dirs[1])
    else:  # what the trainer publishes in stream mode: its parameters, tied head left out
        source = TensorWeights({n: t.clone() for n, t in named_tensors(reference_models[1])})
    await engine.pause()
    await engine.update_weights(source)
    await engine.resume()
    after = await engine_scores(engine, sequences)
    assert_close(flat(after), flat(expected[1]), atol=ATOL, what=f"vLLM vs trainer, v1 ({kind})")
    change = (torch.tensor(flat(after)) - torch.tensor(flat(before))).abs()
    assert change.max() > 1.0, f"log-probs barely moved (max |diff| {change.max():.3e})"
    # Sampling (T=0.7) follows the new weights too: the KV and prefix caches were dropped.
    prompts = sequences[:4]
    params = SamplingParams(max_new_tokens=16, temperature=0.7)
    outs = await asyncio.gather(
        *(engine.generate(f"n{i}", p, params) for i, p in enumerate(prompts))
    )
    assert_close(
        flat([o.logprobs for o in outs]),
        flat(
            [
                recompute_logprobs(reference_models[1], p, o.token_ids, temperature=0.7).tolist()
                for p, o in zip(prompts, outs, strict=True)
            ]
        ),
        atol=ATOL,
        what=f"sampled log-probs after the {kind} update",
    )
    assert not list(Path("/dev/shm").glob("areal-weights-*"))


async def test_cpu_load_without_repack_serves_stale_weights(engine, weights_dirs, reference_models):
    """Why the plugin exists: vLLM's CPU GEMM kernels compute with prepacked copies of the
    linear weights. Loading new parameters without repacking them leaves a model whose
    embeddings and norms are new but whose linear layers are old: it matches neither weight
    set. The same load followed by the repack (the engine's update) matches the new one."""
    if engine._device != "cpu":
        pytest.skip("only vLLM's CPU backend prepacks weights")
    sequences = random_prompts(3, min_len=30, max_len=60, seed=22)
    expected = [torch.tensor(flat(trainer_logprobs(m, sequences))) for m in reference_models]
    await engine.pause()
    await engine._llm.collective_rpc(
        "areal_load_weights", args=({"disk": str(weights_dirs[1])}, False)
    )
    await engine.resume()
    stale = torch.tensor(flat(await engine_scores(engine, sequences)))
    off = [float((stale - e).abs().max()) for e in expected]
    assert min(off) > 1.0, f"without the repack, max |diff| to v0, v1: {off}"
    await engine.pause()
    await engine.update_weights(DiskWeights(weights_dirs[1]))
    await engine.resume()
    assert_close(
        flat(await engine_scores(engine, sequences)),
        expected[1],
        atol=ATOL,
        what="the same weights loaded with the repack",
    )


async def test_invalid_updates_are_refused_and_keep_the_weights(engine, reference_models):
    sequences = random_prompts(2, min_len=20, max_len=40, seed=23)
    good = {n: t.clone() for n, t in named_tensors(reference_models[1])}
    renamed = dict(good)
    renamed["model.norm.scale"] = renamed.pop("model.norm.weight")
    reshaped = dict(good, **{"model.norm.weight": torch.ones(64)})
    missing = {n: t for n, t in good.items() if n != "model.norm.weight"}
    await engine.pause()
    for tensors, match in (
        (renamed, "'model.norm.scale' is not in"),
        (reshaped, r"shape \(64,\)"),
        (missing, "no tensor for"),
    ):
        with pytest.raises(WeightMismatchError, match=match):
            await engine.update_weights(TensorWeights(tensors))
    await engine.resume()
    assert_close(
        flat(await engine_scores(engine, sequences)),
        flat(trainer_logprobs(reference_models[0], sequences)),
        atol=ATOL,
        what="weights after refused updates",
    )


async def test_pause_returns_tokens_so_far_as_abort(engine, reference_models):
    await check_pause_returns_tokens_so_far(
        engine, reference_models[0], max_new_tokens=300, atol=ATOL
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_interrupted_sequences_mix_versions_with_matching_logprobs(
    engine, weights_dirs, reference_models, temperature
):
    generator = InterruptibleGenerator(engine, version=0)
    prompts = random_prompts(8, min_len=4, max_len=60, seed=11)
    params = SamplingParams(max_new_tokens=120, temperature=temperature)
    tasks = [
        asyncio.create_task(generator.generate(f"i{i}", p, params)) for i, p in enumerate(prompts)
    ]
    probe = await generator.generate("probe", prompts[0], SamplingParams(max_new_tokens=6))
    assert len(probe.token_ids) == 6 and generator.num_in_engine == len(prompts)
    assert await generator.update_weights(DiskWeights(weights_dirs[1]), 1) == len(prompts)
    for prompt, result in zip(prompts, await asyncio.gather(*tasks), strict=True):
        assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 120
        assert result.num_interruptions == 1
        switch = result.versions.index(1)
        assert switch > 0 and result.versions == [0] * switch + [1] * (120 - switch)
        for version, model in enumerate(reference_models):
            positions = [i for i, v in enumerate(result.versions) if v == version]
            recomputed = recompute_logprobs(
                model, prompt, result.token_ids, temperature=temperature
            )
            assert_close(
                [result.logprobs[i] for i in positions],
                recomputed[positions],
                atol=ATOL,
                what=f"log-probs of version-{version} tokens",
            )


async def test_stop_tokens_and_budget_are_respected(engine):
    prompt = random_prompts(1, min_len=10, max_len=10, seed=7)[0]
    free = (
        await engine.generate("f", prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
    ).token_ids
    stop = free[9]
    out = await engine.generate(
        "s", prompt, SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[stop, 2])
    )
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == free[: free.index(stop) + 1]
    await check_sampled_stops(engine, prompt, stop)


async def test_cancelled_request_is_aborted_in_vllm(engine):
    task = asyncio.create_task(engine.generate("c", [5, 6, 7], SamplingParams(max_new_tokens=300)))
    done = await engine.generate("d", [5, 6, 7], SamplingParams(max_new_tokens=4))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(done.token_ids) == 4
    assert engine._llm.get_num_unfinished_requests() == 0
    again = await engine.generate("c", [5, 6, 7], SamplingParams(max_new_tokens=4))
    assert again.finish_reason is FinishReason.LENGTH


async def test_misuse_is_refused_with_clear_errors(engine, weights_dirs):
    with pytest.raises(EngineStateError, match=r"update_weights\(\) needs a paused engine"):
        await engine.update_weights(DiskWeights(weights_dirs[1]))
    with pytest.raises(EngineStateError, match=r"resume\(\) needs a paused engine"):
        await engine.resume()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate("v", [5, 10_000], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="prompt is empty"):
        await engine.generate("e", [], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match=f"exceeds the engine's max_seq_len={MAX_MODEL_LEN}"):
        await engine.generate("t", [5] * 380, SamplingParams(max_new_tokens=13))
    task = asyncio.create_task(engine.generate("dup", [5], SamplingParams(max_new_tokens=50)))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="already running"):
        await engine.generate("dup", [5], SamplingParams(max_new_tokens=1))
    assert (await task).finish_reason is FinishReason.LENGTH
    await engine.pause()
    with pytest.raises(EngineStateError, match=r"pause\(\) needs a running engine"):
        await engine.pause()
    with pytest.raises(FileNotFoundError):
        await engine.update_weights(DiskWeights(weights_dirs[0] / "missing"))


async def test_an_episode_keeps_provenance_across_an_update_in_its_second_turn(
    engine, weights_dirs, reference_models
):
    from episode_helpers import DONE, ScriptedEnvironment, check_update_in_turn_two

    from areal.models.tokenizer import load_tokenizer
    from areal.workers.rollout.episode import EpisodeLimits, EpisodeRunner

    env = ScriptedEnvironment(["obs one\n", "obs two\n", DONE])
    runner = EpisodeRunner(
        InterruptibleGenerator(engine, version=0),
        env,
        load_tokenizer(weights_dirs[0]),
        EpisodeLimits(max_turns=4, max_turn_tokens=60),
    )
    await check_update_in_turn_two(runner, env, weights_dirs[1], reference_models)
