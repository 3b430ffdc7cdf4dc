"""Loading HF model directories: weights, dtype, mode, attention implementation, clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from areal.config import TinyModelConfig
from areal.models.hf import load_model
from areal.models.tiny import build_char_tokenizer, build_tiny_model


def test_load_model_restores_the_saved_weights(tiny_dir: Path, assert_close) -> None:
    tokenizer = build_char_tokenizer()
    built = build_tiny_model(
        TinyModelConfig(), len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0
    )
    loaded = load_model(tiny_dir)
    ids = torch.tensor([tokenizer.encode("12+30=42\n")])
    with torch.no_grad():
        assert_close(loaded(ids).logits, built(ids).logits, what="loaded vs built logits")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight, "tied embeddings untied"


def test_load_model_defaults_to_eval_fp32_sdpa_on_cpu(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    assert (model.training, model.dtype, model.device.type) == (False, torch.float32, "cpu")
    assert model.config._attn_implementation == "sdpa"
    assert not any(m.training for m in model.modules())


def test_load_model_honours_dtype_train_and_attention(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, dtype="bfloat16", train=True, attn_implementation="eager")
    assert model.training and all(m.training for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"


def test_load_model_rejects_unknown_dtype(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype='fp8' is not one of float32, bfloat16, float16"):
        load_model(tiny_dir, dtype="fp8")


def test_load_model_names_a_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=rf"{missing}.*does not exist"):
        load_model(missing)


def test_load_model_names_a_file_given_as_directory(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"{path}.*is not a directory"):
        load_model(path)


def test_load_model_names_a_directory_without_config(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_dir / "model.safetensors", tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*has no config.json"):
        load_model(tmp_path)


def test_load_model_names_a_directory_without_safetensors(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_dir / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*has no \*.safetensors weights$"):
        load_model(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin.*convert it to safetensors"):
        load_model(tmp_path)
