"""Helpers of the rollout-engine tests: recomputation, prompts, a max/mean-diff assertion,
and the engine-contract checks both engines' tests run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from areal.workers.rollout.engine import FinishReason, SamplingParams, processed_logprobs


def assert_close(
    actual: Sequence[float] | torch.Tensor,
    expected: Sequence[float] | torch.Tensor,
    *,
    atol: float,
    what: str,
) -> None:
    """Fail with the max and mean absolute difference when any entry is off by > atol."""
    a = torch.as_tensor(actual, dtype=torch.float64).flatten()
    e = torch.as_tensor(expected, dtype=torch.float64).flatten()
    assert a.shape == e.shape, f"{what}: {a.numel()} values, expected {e.numel()}"
    if a.numel() == 0:
        return
    diff = (a - e).abs()
    worst = int(diff.argmax())
    assert bool((diff <= atol).all()), (
        f"{what}: {int((diff > atol).sum())}/{diff.numel()} off by more than {atol}; max |diff| "
        f"{diff.max().item():.3e} at {worst} (got {a[worst].item():.6f}, want "
        f"{e[worst].item():.6f}); mean |diff| {diff.mean().item():.3e}"
    )


def recompute_logprobs(
    model: torch.nn.Module,
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    temperature: float,
    top_p: float = 1.0,
) -> torch.Tensor:
    """[T] log-probs of `completion` after `prompt` from one plain full forward (fp32)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
    return processed_logprobs(
        logits, torch.tensor(list(completion)), temperature=temperature, top_p=top_p
    )


def random_prompts(
    num: int, *, min_len: int, max_len: int, vocab: int = 90, seed: int = 0
) -> list[list[int]]:
    """Prompts of varied lengths over token ids 3..vocab-1 (0-2 are special tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- checks of the engine contract (engine.py) that every engine's tests run -------------


async def check_top_p_logprobs_are_of_the_nucleus(
    engine, model: torch.nn.Module, *, atol: float
) -> None:
    """With top_p < 1 the reported log-probs are those of the renormalised nucleus."""
    prompts = random_prompts(12, min_len=3, max_len=40, seed=3)
    params = SamplingParams(max_new_tokens=16, temperature=1.3, top_p=0.6)
    outs = await asyncio.gather(
        *(engine.generate(f"p{i}", p, params) for i, p in enumerate(prompts))
    )
    got, nucleus, full = [], [], []
    for prompt, out in zip(prompts, outs, strict=True):
        got += out.logprobs
        nucleus += recompute_logprobs(
            model, prompt, out.token_ids, temperature=1.3, top_p=0.6
        ).tolist()
        full += recompute_logprobs(model, prompt, out.token_ids, temperature=1.3).tolist()
    assert_close(got, nucleus, atol=atol, what="engine vs nucleus log-probs")
    # Every sampled token was inside the nucleus, and renormalising raised its log-prob.
    assert all(n > f for n, f in zip(nucleus, full, strict=True))


async def check_pause_returns_tokens_so_far(
    engine, model: torch.nn.Module, *, max_new_tokens: int, atol: float
) -> None:
    """pause(): running calls return their tokens so far as ABORT, with correct log-probs;
    paused, generate returns at once with nothing; resumed, it serves again."""
    prompts = random_prompts(8, min_len=5, max_len=30, seed=6)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    long = [asyncio.create_task(engine.generate(f"l{i}", p, params)) for i, p in enumerate(prompts)]
    # A short request decoded in the same batches: when it is done, the long ones have
    # about as many tokens (scheduling is by steps, not by time).
    short = await engine.generate("short", prompts[0], SamplingParams(max_new_tokens=8))
    assert len(short.token_ids) == 8
    await engine.pause()
    outs = await asyncio.gather(*long)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason is FinishReason.ABORT
        assert 1 <= len(out.token_ids) < max_new_tokens
        assert_close(
            out.logprobs,
            recompute_logprobs(model, prompt, out.token_ids, temperature=1.0),
            atol=atol,
            what="partial output log-probs",
        )
    out = await engine.generate("late", prompts[0], params)  # paused: at once, nothing
    assert (out.token_ids, out.finish_reason) == ([], FinishReason.ABORT)
    await engine.resume()
    again = await engine.generate("l0", prompts[0], SamplingParams(max_new_tokens=5))
    assert again.finish_reason is FinishReason.LENGTH and len(again.token_ids) == 5


async def check_sampled_stops(engine, prompt: list[int], stop: int) -> None:
    """Sampled requests end at their first stop token (STOP) or at their budget (LENGTH)."""
    sampled = await asyncio.gather(
        *(
            engine.generate(
                f"m{i}", prompt, SamplingParams(max_new_tokens=13, stop_token_ids=[stop])
            )
            for i in range(8)
        )
    )
    for out in sampled:
        assert len(out.token_ids) <= 13 and out.token_ids.count(stop) <= 1
        if out.finish_reason is FinishReason.STOP:
            assert out.token_ids[-1] == stop
        else:
            assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 13
