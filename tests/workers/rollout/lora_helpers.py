"""Adapters for the LoRA serving tests: random PEFT adapters of the rollout tests' tiny model
(weights v0 of `weights_dirs`) and the trainer-side models that apply them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from rollout_helpers import assert_close, recompute_logprobs

from areal.config import LoraConfig
from areal.models.hf import load_model
from areal.models.lora import add_adapters, adapter_tensors, copy_adapters
from areal.workers.rollout.engine import SamplingParams

LORA = LoraConfig(rank=8, alpha=16.0)


def random_adapters(model_dir: Path, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Adapter tensors (PEFT names) with A and B drawn from N(0, scale^2): a version far
    enough from the base that log-probs move by more than 1 somewhere."""
    model = add_adapters(load_model(model_dir), LORA, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(t.shape, generator=generator) * scale
        for name, t in adapter_tensors(model)
    }


def adapted_model(model_dir: Path, tensors: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """The trainer's view of a version: the base with PEFT adapters holding `tensors`
    (None: the zero-B adapters of version 0), in eval mode."""
    model = add_adapters(load_model(model_dir), LORA, seed=0)
    if tensors is not None:
        copy_adapters(model, tensors)
    return model.eval()


async def assert_interrupted_onto_new_adapter(
    generator, prompts, new_adapter, models, *, max_new_tokens: int, atol: float
) -> None:
    """Generate `prompts` on `generator` (which holds version `new_adapter.version - 1`),
    load `new_adapter` while all of them run, and check each was interrupted once and
    continued on it: every token's version, and its log-prob against the trainer-side model
    of that version (`models[version]`)."""
    old, new = new_adapter.version - 1, new_adapter.version
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    tasks = [
        asyncio.create_task(generator.generate(f"i{i}", p, params)) for i, p in enumerate(prompts)
    ]
    probe = await generator.generate("probe", prompts[0], SamplingParams(max_new_tokens=6))
    assert len(probe.token_ids) == 6 and generator.num_in_engine == len(prompts)
    assert await generator.update_weights(new_adapter, new) == len(prompts)
    for prompt, result in zip(prompts, await asyncio.gather(*tasks), strict=True):
        assert result.num_interruptions == 1 and len(result.token_ids) == max_new_tokens
        switch = result.versions.index(new)
        assert switch > 0
        assert result.versions == [old] * switch + [new] * (max_new_tokens - switch)
        for version in (old, new):
            at = [i for i, v in enumerate(result.versions) if v == version]
            recomputed = recompute_logprobs(
                models[version], prompt, result.token_ids, temperature=1.0
            )
            assert_close(
                [result.logprobs[i] for i in at],
                recomputed[at],
                atol=atol,
                what=f"tokens of adapter v{version}",
            )
