"""The embedded default model: a tiny Qwen2-architecture LM with a character-level tokenizer.

Built by the project itself (no download), saved as a normal Hugging Face directory
(`config.json`, `model.safetensors`, `tokenizer.json`) so that transformers, the trainer and
vLLM all load it like any other model. head_dim is kept >= 32 because vLLM's attention
backends refuse smaller heads. This module builds a randomly initialised model; the
supervised warm start lives in `areal.models.warmstart`.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from areal.config import TinyModelConfig

PAD, EOS, UNK = "<pad>", "<|endoftext|>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
CHARACTERS = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
"""Printable ASCII, space, tab and newline: one token each."""


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, as a byte-level BPE without merges.

    Byte-level BPE is what Qwen2's tokenizer class is: transformers' AutoTokenizer forces
    that class on any `model_type: qwen2` directory and rebuilds the pre-tokenizer, so a
    plain word-level vocabulary would lose its whitespace there. Without merges, the
    byte-level BPE is exactly a character tokenizer, whichever class loads it.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        ((symbol, _),) = byte_level.pre_tokenize_str(ch)
        vocab.setdefault(symbol, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    shape: TinyModelConfig, vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 model of the given shape, fp32."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.float().eval()


def save_tiny_model(
    directory: str | Path, shape: TinyModelConfig | None = None, seed: int = 0
) -> Path:
    """Build the tokenizer and a random tiny model and save both as an HF directory."""
    directory = Path(directory)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        shape or TinyModelConfig(),
        len(tokenizer),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        seed,
    )
    return save_model_dir(model, tokenizer, directory)


def save_model_dir(model: Any, tokenizer: Any, directory: str | Path) -> Path:
    """`model` and `tokenizer` as one HF directory; generation stops at the tokenizer's EOS."""
    directory = Path(directory)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
