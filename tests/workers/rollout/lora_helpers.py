"""Adapters for the LoRA serving tests: random PEFT adapters of the rollout tests' tiny model
(weights v0 of `weights_dirs`) and the trainer-side models that apply them."""

from __future__ import annotations

from pathlib import Path

import torch

from areal.config import LoraConfig
from areal.models.hf import load_model
from areal.models.lora import add_adapters, adapter_tensors, copy_adapters

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
