"""Shared fixtures for the model tests: tiny models of several architectures saved as HF dirs.

Everything is built locally from configs (nothing is downloaded) and saved once per session;
tests load their own copy with `load_model`, so a test that changes weights affects no other.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable, Iterator

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

from areal.models.hf import load_model
from areal.models.tiny import save_tiny_model

VOCAB = 97


def _tiny_configs() -> dict[str, tuple[type, object]]:
    """Architectures beyond the embedded Qwen2: untied Llama, tied GPT-2 (learned absolute
    positions), and Gemma-2 (soft-capped logits, sliding-window layers with a window of 4)."""
    return {
        "llama": (
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=128,
                tie_word_embeddings=False,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=2,
            ),
        ),
        "gpt2": (
            GPT2LMHeadModel,
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=64,
                n_layer=2,
                n_head=2,
                n_positions=128,
                bos_token_id=0,
                eos_token_id=1,
            ),
        ),
        "gemma2": (
            Gemma2ForCausalLM,
            Gemma2Config(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=32,
                sliding_window=4,
                final_logit_softcapping=5.0,
                attn_logit_softcapping=None,
                max_position_embeddings=128,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=2,
            ),
        ),
    }


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Run these tests on one intra-op thread, restoring the setting afterwards.

    The models are tiny, so threads buy nothing; on a busy 2-core machine they spin against
    other processes and the gradient tests ran ~10x slower with 2 threads than with 1.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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


@pytest.fixture(scope="session")
def shared_model(model_dirs: dict[str, Path]) -> Callable[..., torch.nn.Module]:
    """`shared_model(name, attn="sdpa")`: one fp32 eval model per (name, attn) per session.

    For tests that only read the model (forwards, autograd.grad); never change its weights
    or mode. Tests that do, load their own with `load_model`.
    """
    cache: dict[tuple[str, str], torch.nn.Module] = {}

    def get(name: str, attn: str = "sdpa") -> torch.nn.Module:
        if (name, attn) not in cache:
            cache[name, attn] = load_model(model_dirs[name], attn_implementation=attn)
        return cache[name, attn]

    return get


def _assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 0.0, what: str = "values"
) -> None:
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
