"""Shared fixtures for the model tests: tiny models of several architectures saved as HF dirs.

Everything is built locally from configs (nothing is downloaded) and saved once per session;
tests load their own copy with `load_model`, so a test that changes weights affects no other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from areal.models.tiny import save_tiny_model

VOCAB = 97


def _tiny_configs() -> dict[str, tuple[type, object]]:
    """Architectures beyond the embedded Qwen2: untied Llama, tied GPT-2 (learned absolute
    positions), and Gemma-2 (soft-capped logits, sliding-window layers with a window of 4)."""
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)),
        "gpt2": (GPT2LMHeadModel, GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=128,
            bos_token_id=0, eos_token_id=1)),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=4,
            final_logit_softcapping=5.0, attn_logit_softcapping=None,
            max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)),
    }


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> saved HF directory, for 'qwen2' (the embedded tiny model) and _tiny_configs."""
    dirs = {"qwen2": save_tiny_model(tmp_path_factory.mktemp("qwen2"))}
    for seed, (name, (model_cls, config)) in enumerate(_tiny_configs().items()):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = model_cls(config)
        dirs[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="session")
def tiny_dir(model_dirs: dict[str, Path]) -> Path:
    """The embedded tiny Qwen2 model (tied embeddings) with its character tokenizer."""
    return model_dirs["qwen2"]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 0.0,
                  what: str = "values") -> None:
    """Fail with the max and mean absolute difference (and where the max is) when not close."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    if actual.numel() == 0:
        return
    diff = (actual - expected).abs()
    worst = int(diff.argmax())
    assert bool((diff <= atol).all()), (
        f"{what}: {int((diff > atol).sum())}/{diff.numel()} entries off by more than "
        f"atol={atol}; max |diff| = {diff.max().item():.3e} at {worst} (got "
        f"{actual.flatten()[worst].item()!r}, want {expected.flatten()[worst].item()!r}), "
        f"mean |diff| = {diff.mean().item():.3e}"
    )


@pytest.fixture(scope="session")
def assert_close() -> Callable[..., None]:
    """`assert_close(actual, expected, atol=, what=)`; exact by default."""
    return _assert_close
