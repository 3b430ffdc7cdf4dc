"""The built-in engine on the real tiny model: log-prob parity, weight updates without stale
caches, pause/abort semantics, stop tokens and budgets, and errors for misuse."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_helpers import (
    assert_close,
    check_pause_returns_tokens_so_far,
    check_sampled_stops,
    check_top_p_logprobs_are_of_the_nucleus,
    random_prompts,
    recompute_logprobs,
)

from areal.models.logprobs import packed_logprobs
from areal.models.weights import WeightMismatchError, load_tensors
from areal.workers.rollout.engine import (
    DiskWeights,
    EngineState,
    EngineStateError,
    FinishReason,
    SamplingParams,
    TensorWeights,
)
from areal.workers.rollout.torch_engine import TorchEngine

ATOL = 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_equal_full_forward_recomputation(
    make_engine, reference_models, temperature
):
    engine = await make_engine()
    prompts = random_prompts(32, min_len=1, max_len=90, seed=int(temperature * 10))
    params = SamplingParams(max_new_tokens=24, temperature=temperature)
    outs = await asyncio.gather(
        *(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts))
    )
    model = reference_models[0]
    engine_lp, forward_lp, trainer_lp = [], [], []
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 24
        engine_lp += out.logprobs
        forward_lp += recompute_logprobs(
            model, prompt, out.token_ids, temperature=temperature
        ).tolist()
    # The trainer's packed recomputation of the same sequences, in one forward.
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    with torch.no_grad():
        packed = packed_logprobs(
            model, torch.tensor([t for s in seqs for t in s]), cu, temperature=temperature
        )
    for start, prompt, out in zip(cu[:-1].tolist(), prompts, outs, strict=True):
        trainer_lp += packed[
            start + len(prompt) : start + len(prompt) + len(out.token_ids)
        ].tolist()
    assert_close(engine_lp, forward_lp, atol=ATOL, what=f"engine vs forward, T={temperature}")
    assert_close(engine_lp, trainer_lp, atol=ATOL, what=f"engine vs trainer, T={temperature}")


async def test_top_p_logprobs_are_of_the_renormalised_nucleus(make_engine, reference_models):
    await check_top_p_logprobs_are_of_the_nucleus(
        await make_engine(), reference_models[0], atol=ATOL
    )


async def test_greedy_equals_transformers_generate_with_zero_logprobs(
    make_engine, reference_models
):
    engine = await make_engine()
    prompts = random_prompts(6, min_len=2, max_len=30, seed=4)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    outs = await asyncio.gather(
        *(engine.generate(f"g{i}", p, params) for i, p in enumerate(prompts))
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _hf_greedy(reference_models[0], prompt, 20)
        assert out.logprobs == [0.0] * 20


def _hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=num_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )  # None: no EOS stop
    return ids[0, len(prompt) :].tolist()


@pytest.mark.slow
async def test_outputs_follow_new_weights_after_update(make_engine, weights_dirs, reference_models):
    """No stale KV or prefix cache: prompts longer than a cache page (64) are cached as
    shareable prefix blocks; after the update the same prompts must be recomputed."""
    engine = await make_engine()
    prompts = random_prompts(4, min_len=140, max_len=200, seed=5)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)

    async def greedy_all() -> list[list[int]]:
        outs = await asyncio.gather(
            *(engine.generate(f"u{i}", p, params) for i, p in enumerate(prompts))
        )
        return [o.token_ids for o in outs]

    expected = [[_hf_greedy(m, p, 16) for p in prompts] for m in reference_models]
    assert expected[0] != expected[1], "the two weight sets must disagree for this test"
    assert await greedy_all() == expected[0]
    await engine.pause()
    await engine.update_weights(DiskWeights(weights_dirs[1]))
    await engine.resume()
    assert await greedy_all() == expected[1]
    await engine.pause()
    await engine.update_weights(TensorWeights(load_tensors(weights_dirs[0])))
    await engine.resume()
    assert await greedy_all() == expected[0]


async def test_pause_returns_tokens_so_far_as_abort(make_engine, reference_models):
    await check_pause_returns_tokens_so_far(
        await make_engine(), reference_models[0], max_new_tokens=400, atol=ATOL
    )


async def test_life_cycle_errors_are_clear(make_engine, weights_dirs):
    idle = TorchEngine(weights_dirs[0])
    with pytest.raises(EngineStateError, match=r"generate\(\) on a created engine"):
        await idle.generate("x", [5], SamplingParams(max_new_tokens=1))
    engine = await make_engine()
    with pytest.raises(
        EngineStateError,
        match=r"update_weights\(\) needs a paused engine.*"
        r"call pause\(\) first",
    ):
        await engine.update_weights(DiskWeights(weights_dirs[1]))
    with pytest.raises(EngineStateError, match=r"resume\(\) needs a paused engine"):
        await engine.resume()
    await engine.pause()  # nothing in flight
    assert engine.state is EngineState.PAUSED
    with pytest.raises(
        EngineStateError,
        match=r"pause\(\) needs a running engine, but it is "
        r"paused; call resume\(\)",
    ):
        await engine.pause()
    with pytest.raises(WeightMismatchError):
        await engine.update_weights(TensorWeights({"model.norm.weight": torch.ones(128)}))
    await engine.resume()
    await engine.close()
    await engine.close()  # idempotent
    with pytest.raises(EngineStateError, match="closed"):
        await engine.generate("x", [5], SamplingParams(max_new_tokens=1))


async def test_stop_tokens_and_budget_are_respected(make_engine, reference_models):
    engine = await make_engine()
    prompt = random_prompts(1, min_len=10, max_len=10, seed=7)[0]
    free = _hf_greedy(reference_models[0], prompt, 30)
    stop = free[9]
    first = free.index(stop)
    out = await engine.generate(
        "s", prompt, SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[stop, 2])
    )
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == free[: first + 1]
    budget = await engine.generate("b", prompt, SamplingParams(max_new_tokens=7, temperature=0.0))
    assert budget.finish_reason is FinishReason.LENGTH and budget.token_ids == free[:7]
    await check_sampled_stops(engine, prompt, stop)


async def test_cancelled_request_leaves_the_engine_serving(make_engine):
    engine = await make_engine()
    task = asyncio.create_task(engine.generate("c", [5, 6, 7], SamplingParams(max_new_tokens=400)))
    done = await engine.generate("d", [5, 6, 7], SamplingParams(max_new_tokens=4))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(done.token_ids) == 4
    again = await engine.generate("c", [5, 6, 7], SamplingParams(max_new_tokens=4))
    assert again.finish_reason is FinishReason.LENGTH


async def test_invalid_requests_are_refused_before_reaching_the_loop(make_engine):
    engine = await make_engine()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate("v", [5, 10_000], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="prompt is empty"):
        await engine.generate("e", [], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len=512"):
        await engine.generate("t", [5] * 500, SamplingParams(max_new_tokens=13))
    task = asyncio.create_task(engine.generate("dup", [5], SamplingParams(max_new_tokens=50)))
    await asyncio.sleep(0)  # let it register
    with pytest.raises(ValueError, match="already running"):
        await engine.generate("dup", [5], SamplingParams(max_new_tokens=1))
    assert (await task).finish_reason is FinishReason.LENGTH
    # The loop survived all of it.
    assert len((await engine.generate("ok", [5], SamplingParams(max_new_tokens=3))).token_ids) == 3


async def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batches(
    make_engine, reference_models
):
    """SamplingParams.seed: the tokens depend on the seed, the prompt and the weights only.
    Batch neighbours change the forward's numerics in the last bits (the log-probs agree to
    ATOL), not the draws. Unseeded requests still sample from the engine's own stream."""
    engine = await make_engine()
    prompts = random_prompts(16, min_len=2, max_len=60, seed=21)
    seeded = [
        SamplingParams(max_new_tokens=24, temperature=1.0, seed=100 + i)
        for i in range(len(prompts))
    ]
    alone = [await engine.generate(f"a{i}", p, seeded[i]) for i, p in enumerate(prompts[:4])]
    unseeded = SamplingParams(max_new_tokens=24, temperature=1.0)
    crowd = await asyncio.gather(
        *(engine.generate(f"b{i}", p, seeded[i]) for i, p in enumerate(prompts)),
        *(engine.generate(f"c{i}", p, unseeded) for i, p in enumerate(prompts)),
    )
    for prompt, single, batched in zip(prompts, alone, crowd, strict=False):
        assert single.token_ids == batched.token_ids
        assert_close(single.logprobs, batched.logprobs, atol=ATOL, what="alone vs batched")
        assert_close(
            batched.logprobs,
            recompute_logprobs(reference_models[0], prompt, batched.token_ids, temperature=1.0),
            atol=ATOL,
            what="seeded draws vs forward",
        )
    other = await engine.generate("d", prompts[0], SamplingParams(max_new_tokens=24, seed=7))
    assert other.token_ids != alone[0].token_ids
    assert crowd[len(prompts)].token_ids != crowd[0].token_ids  # the unseeded draw of prompt 0


async def test_seeded_draws_follow_the_sampled_distribution(make_engine, reference_models):
    """Inverting the CDF at u(seed, 0) over many seeds draws the first token with the model's
    probabilities (temperature 0.7, top-p 0.9: the processed distribution)."""
    engine = await make_engine()
    prompt = random_prompts(1, min_len=5, max_len=6, seed=22)[0]
    num = 3000
    outs = await asyncio.gather(
        *(
            engine.generate(
                f"s{i}",
                prompt,
                SamplingParams(max_new_tokens=1, temperature=0.7, top_p=0.9, seed=i),
            )
            for i in range(num)
        )
    )
    with torch.no_grad():
        logits = reference_models[0](torch.tensor([prompt])).logits[0, -1].float() / 0.7
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    keep = order[: int((probs[order].cumsum(0) < 0.9).sum()) + 1]
    nucleus = torch.zeros_like(probs)
    nucleus[keep] = probs[keep] / probs[keep].sum()
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=len(probs))
    assert int(counts[nucleus == 0].sum()) == 0  # nothing outside the nucleus
    expected = nucleus * num
    frequent = expected > 5
    chi2 = float((((counts - expected) ** 2)[frequent] / expected[frequent]).sum())
    dof = int(frequent.sum()) - 1
    assert dof >= 3, "the distribution should spread over several tokens"
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~5 sigma of a chi-square
