"""Helpers of the rollout-engine tests: recomputation, prompts, a max/mean-diff assertion."""

from __future__ import annotations

from typing import Sequence

import torch

from areal.workers.rollout.engine import processed_logprobs


def assert_close(actual: Sequence[float] | torch.Tensor, expected: Sequence[float] | torch.Tensor,
                 *, atol: float, what: str) -> None:
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
        f"{e[worst].item():.6f}); mean |diff| {diff.mean().item():.3e}")


def recompute_logprobs(model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int],
                       *, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """[T] log-probs of `completion` after `prompt` from one plain full forward (fp32)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
    return processed_logprobs(logits, torch.tensor(list(completion)), temperature=temperature,
                              top_p=top_p)


def random_prompts(num: int, *, min_len: int, max_len: int, vocab: int = 90,
                   seed: int = 0) -> list[list[int]]:
    """Prompts of varied lengths over token ids 3..vocab-1 (0-2 are special tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
