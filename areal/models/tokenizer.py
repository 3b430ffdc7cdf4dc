"""Load a Hugging Face tokenizer directory, without importing torch when it can be avoided.

Why: every worker process of a run loads the tokenizer, and `AutoTokenizer` costs 5-7 s of
CPU to import on a 2-core machine (transformers' auto machinery pulls in torch, its
compiler stack and the model registry), while the tokenizer class it picks costs 1.5-2 s.
The reward worker needs nothing else from transformers; a run's start-up is mostly imports.

How, without changing which tokenizer a run gets: `AutoTokenizer.from_pretrained` decides a
class from the directory's files, then calls `<class>.from_pretrained(path, _from_auto=True,
**kwargs)`. The class it decided is remembered under `cache_dir` (one small JSON file per
key), keyed by the transformers version, the directory's path, its file names and the
bytes of its `tokenizer_config.json` and `config.json` (everything the decision reads); a
later load with the same key imports only that class and makes the same call. A miss, an
unreadable entry, `trust_remote_code` (the class is the directory's own code) or no
`cache_dir` takes `AutoTokenizer`, as before. Tests: tests/areal/models/test_tokenizer.py.

Not here: models and weights (`areal.models.hf`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)
"""A directory with none of these is not a Hugging Face tokenizer directory."""

_DECISION_FILES = ("tokenizer_config.json", "config.json")
"""The files whose contents `AutoTokenizer` reads to decide the class."""


def load_tokenizer(
    path: str | Path,
    *,
    trust_remote_code: bool = False,
    padding_side: str | None = None,
    cache_dir: str | Path | None = None,
) -> Any:
    """The tokenizer in `path`, with a pad token guaranteed.

    Pad token: kept if the tokenizer has one; otherwise the EOS token is reused as padding
    (no new token is added, so the vocabulary still matches the model's embedding). Padding
    only matters for padded batches (generation); packed training never pads. A tokenizer
    with neither pad nor EOS token is refused. `padding_side` ('left' for batched generation)
    overrides the tokenizer's own when given. `cache_dir`: where the class `AutoTokenizer`
    picks for this directory is remembered (module docstring); None: not remembered.
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(f"tokenizer path {str(directory)!r} {what}")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"tokenizer path {str(directory)!r} has none of {', '.join(TOKENIZER_FILES)}; "
            "it is not a Hugging Face tokenizer directory"
        )
    options = {} if padding_side is None else {"padding_side": padding_side}
    memo = None if trust_remote_code or cache_dir is None else _memo_path(directory, cache_dir)
    known = _remembered_class(memo) if memo is not None else None
    if known is not None:
        # what AutoTokenizer calls once it has decided the class (transformers 5.x)
        tokenizer = known.from_pretrained(directory, _from_auto=True, **options)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            directory, trust_remote_code=trust_remote_code, **options
        )
        if memo is not None:
            _remember_class(memo, type(tokenizer))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer in {str(directory)!r} has neither a pad nor an EOS token; add a "
                "pad_token to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _memo_path(directory: Path, cache_dir: str | Path) -> Path:
    from transformers import __version__ as transformers_version  # the light top module

    key = hashlib.sha256()
    resolved = directory.resolve()
    for part in (transformers_version, str(resolved), *sorted(p.name for p in resolved.iterdir())):
        key.update(part.encode() + b"\0")
    for name in _DECISION_FILES:
        file = resolved / name
        key.update(file.read_bytes() if file.is_file() else b"<absent>")
        key.update(b"\0")
    return Path(cache_dir).expanduser() / "tokenizer-classes" / f"{key.hexdigest()}.json"


def _remembered_class(memo: Path) -> type | None:
    """The class remembered at `memo`; None if there is none or it cannot be imported."""
    try:
        entry = json.loads(memo.read_text())
        module, name = entry["module"], entry["class"]
        if not module.startswith("transformers."):
            return None
        return getattr(importlib.import_module(module), name)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError) as err:
        log.warning(
            "ignoring the remembered tokenizer class %s (%s); asking AutoTokenizer", memo, err
        )
        return None


def _remember_class(memo: Path, cls: type) -> None:
    """Written whole or not at all (a temporary file renamed): processes of a run load the
    same tokenizer at the same time. A cache that cannot be written only costs time."""
    if not cls.__module__.startswith("transformers."):
        return
    written = None
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=memo.parent, suffix=".tmp", delete=False) as out:
            written = out.name
            json.dump({"module": cls.__module__, "class": cls.__qualname__}, out)
        os.replace(written, memo)
    except OSError as err:
        log.warning("could not remember the tokenizer class in %s: %s", memo.parent, err)
        if written is not None:
            Path(written).unlink(missing_ok=True)
