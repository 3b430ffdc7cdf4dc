"""Loading a tokenizer directory (areal.models.tokenizer): pad token, clear errors, and the
remembered class giving exactly the tokenizer AutoTokenizer gives, without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from areal.models.tiny import build_char_tokenizer
from areal.models.tokenizer import load_tokenizer

TEXTS = ["Q: 17 + 25 =\n\tA: 42 !", "", "<|endoftext|>x<pad>", "ünïcödé 1/2 \\frac{1}{2}"]


def _tokenizer_dir(tmp_path: Path, tiny_dir: Path, model_type: str) -> Path:
    """The embedded character tokenizer next to a config.json of `model_type`: AutoTokenizer
    decides the class from the model type, so each gives another class."""
    target = tmp_path / model_type
    shutil.copytree(tiny_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return target


def _behaviour(tokenizer) -> dict:
    """Everything a run uses of a tokenizer, and its settings."""
    ids = [list(range(len(tokenizer))), [5, 0, 1, 2, 3, 7, 7]]
    return {
        "class": type(tokenizer),
        "vocab": tokenizer.get_vocab(),
        "len": len(tokenizer),
        "special": tokenizer.all_special_tokens,
        "pad": tokenizer.pad_token_id,
        "eos": tokenizer.eos_token_id,
        "side": tokenizer.padding_side,
        "template": tokenizer.chat_template,
        "init": tokenizer.init_kwargs,
        "encode": [tokenizer.encode(t) for t in TEXTS]
        + [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS],
        "decode": [
            tokenizer.decode(i, skip_special_tokens=skip) for i in ids for skip in (False, True)
        ],
    }


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gpt2", "gemma2"])
def test_the_remembered_class_gives_the_tokenizer_autotokenizer_gives(
    tiny_dir, tmp_path, monkeypatch, model_type
):
    directory = _tokenizer_dir(tmp_path, tiny_dir, model_type)
    cache = tmp_path / "cache"
    expected = _behaviour(transformers.AutoTokenizer.from_pretrained(directory))
    first = load_tokenizer(directory, cache_dir=cache)  # decided by AutoTokenizer, remembered
    (memo,) = (cache / "tokenizer-classes").iterdir()
    assert json.loads(memo.read_text())["class"] == expected["class"].__name__
    with monkeypatch.context() as patch:
        patch.setattr(
            transformers.AutoTokenizer,
            "from_pretrained",
            lambda *a, **k: pytest.fail("AutoTokenizer asked again"),
        )
        second = load_tokenizer(directory, cache_dir=cache)
        left = load_tokenizer(directory, cache_dir=cache, padding_side="left")
    assert _behaviour(first) == _behaviour(second) == expected
    assert left.padding_side == "left"


def test_a_changed_directory_is_decided_again(tiny_dir, tmp_path):
    directory = _tokenizer_dir(tmp_path, tiny_dir, "qwen2")
    cache = tmp_path / "cache"
    load_tokenizer(directory, cache_dir=cache)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    assert type(load_tokenizer(directory, cache_dir=cache)) is type(
        transformers.AutoTokenizer.from_pretrained(directory)
    )
    assert len(list((cache / "tokenizer-classes").iterdir())) == 2


@pytest.mark.parametrize(
    "entry, warned",
    [
        ("{not json", True),
        ('{"module": "transformers.nope", "class": "X"}', True),
        ('{"module": "transformers.models.qwen2.tokenization_qwen2", "class": "Nope"}', True),
        ('{"module": "os", "class": "system"}', False),  # not a transformers class: never imported
    ],
)
def test_an_unusable_entry_is_ignored_and_rewritten(tiny_dir, tmp_path, entry, warned, caplog):
    cache = tmp_path / "cache"
    load_tokenizer(tiny_dir, cache_dir=cache)
    (memo,) = (cache / "tokenizer-classes").iterdir()
    memo.write_text(entry)
    loaded = load_tokenizer(tiny_dir, cache_dir=cache)
    assert type(loaded) is type(transformers.AutoTokenizer.from_pretrained(tiny_dir))
    assert json.loads(memo.read_text())["class"] == type(loaded).__name__
    assert ("ignoring the remembered tokenizer class" in caplog.text) is warned


def test_remote_code_and_no_cache_dir_remember_nothing(tiny_dir, tmp_path):
    cache = tmp_path / "cache"
    load_tokenizer(tiny_dir, cache_dir=cache, trust_remote_code=True)
    load_tokenizer(tiny_dir)
    assert not cache.exists()


def test_an_unwritable_cache_only_costs_time(tiny_dir, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory would be")
    assert type(load_tokenizer(tiny_dir, cache_dir=blocker)) is type(
        transformers.AutoTokenizer.from_pretrained(tiny_dir)
    )


@pytest.mark.slow
def test_a_remembered_load_imports_neither_torch_nor_the_auto_classes(tiny_dir, tmp_path):
    """Why the class is remembered: the reward worker's start-up (module docstring)."""
    cache = tmp_path / "cache"
    load_tokenizer(tiny_dir, cache_dir=cache)
    code = (
        "import sys; import areal.workers.reward.worker; "
        "from areal.models.tokenizer import load_tokenizer; "
        f"tok = load_tokenizer({str(tiny_dir)!r}, cache_dir={str(cache)!r}); "
        "print(type(tok).__name__, 'torch' in sys.modules, "
        "'transformers.models.auto.tokenization_auto' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [type(load_tokenizer(tiny_dir)).__name__, "False", "False"]


def test_load_tokenizer_keeps_its_pad_token_and_round_trips_text(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_dir)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<pad>", "<|endoftext|>")
    text = "Q: 17 + 25 =\n\tA: 42 !"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text), "the character tokenizer is one token per character"
    assert tokenizer.decode(ids) == text


def test_load_tokenizer_reuses_eos_as_pad_when_missing(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path, padding_side="left")
    assert loaded.pad_token == loaded.eos_token == "<|endoftext|>"
    assert loaded.pad_token_id == tokenizer.eos_token_id
    assert len(loaded) == len(tokenizer), "no token was added"
    assert loaded.padding_side == "left"


def test_load_tokenizer_refuses_one_without_pad_or_eos(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path}.*neither a pad nor an EOS token"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_names_a_missing_or_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'nope'}.*does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*not a Hugging Face tokenizer"):
        load_tokenizer(tmp_path)
