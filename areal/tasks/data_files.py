"""Reading a task's rows from local JSONL or Parquet files, and where each row came from.

    rows = read_rows(["data/train.jsonl"])        # -> list[Row]; Row.data is a plain dict

Files are read with the Hugging Face `datasets` library (`load_dataset("json"|"parquet",
data_files=...)`, local files only: nothing is downloaded). A JSONL file that Arrow cannot
read (a line that is not JSON, or values of one field whose types cannot be unified) is
read again line by line with `json` so that the error names the file and the line. Every
row keeps its file and 0-based row index, so that a row that is later found unusable can be
reported precisely (`RowError`).

Also here: the bad-row policy (`BadRows`: `on_bad_row='error'` raises at the first bad row,
'skip' counts and logs every skipped row) and the held-out split by seed
(`split_by_seed`). What a usable row is depends on the format (`areal.tasks.formats`).
This module does not render prompts or compute rewards.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Sequence

log = logging.getLogger(__name__)

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffixes and the `datasets` builder that reads them."""
ON_BAD_ROW = ("error", "skip")
_NUM_LOGGED_SKIPS = 10
"""Skipped rows named one by one in the log; the rest are counted."""


class DataFileError(ValueError):
    """A data file is missing, of an unknown kind, or not readable as rows."""


class RowError(ValueError):
    """One row has no usable question or answer. Names the file and the 0-based row."""

    def __init__(self, path: str, row: int, reason: str) -> None:
        self.path, self.row, self.reason = path, row, reason
        super().__init__(f"{path} row {row}: {reason}")


@dataclass(frozen=True)
class Row:
    path: str
    index: int
    """0-based row index within its file (the line number minus one in a JSONL file
    without blank lines)."""
    data: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{Path(self.path).name}#{self.index}"


def as_paths(value: str | Sequence[str] | None, key: str) -> list[str]:
    """A task param naming one file or a list of files, as a list of existing file paths."""
    if value is None:
        return []
    paths = [value] if isinstance(value, (str, Path)) else list(value)
    out = []
    for raw in paths:
        path = Path(str(raw)).expanduser()
        if path.suffix not in SUFFIXES:
            raise DataFileError(
                f"task.params.{key}={str(raw)!r}: unknown file kind "
                f"{path.suffix!r}; give a {', '.join(SUFFIXES)} file"
            )
        if not path.is_file():
            raise DataFileError(
                f"task.params.{key}={str(raw)!r} does not exist (paths are "
                f"relative to the working directory {Path.cwd()})"
            )
        out.append(str(path))
    return out


def read_rows(paths: Sequence[str], *, cache_dir: str | None = None) -> list[Row]:
    """Every row of every file, in file order."""
    rows: list[Row] = []
    for path in paths:
        records = _read_file(path, cache_dir)
        rows.extend(Row(path, i, record) for i, record in enumerate(records))
    return rows


def _read_file(path: str, cache_dir: str | None) -> list[dict[str, Any]]:
    import datasets

    builder = SUFFIXES[Path(path).suffix]
    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # they would tear the controller's progress bar
    try:
        records = datasets.load_dataset(
            builder, data_files=path, split="train", cache_dir=cache_dir
        ).to_list()
    # DatasetGenerationError: Arrow failed on the content; ValueError (ArrowInvalid is one):
    # a broken or empty file; StopIteration: an empty JSON file (datasets 5.2).
    except (datasets.exceptions.DatasetGenerationError, ValueError, StopIteration) as err:
        if builder != "json":
            raise DataFileError(
                f"{path}: cannot be read as Parquet: {err.__cause__ or err}"
            ) from err
        records = _read_jsonl_plainly(path, err)
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
    if not records:
        raise DataFileError(f"{path} holds no rows")
    return records


def _read_jsonl_plainly(path: str, arrow_error: Exception) -> list[dict[str, Any]]:
    """Arrow refused the file: find the bad line, or read it without Arrow's typing (a field
    holding different types in different rows, as code test cases often do, is fine)."""
    records: list[Any] = []
    with open(path, encoding="utf-8") as f:
        if f.read(4096).lstrip().startswith("["):  # a .json file holding one array
            f.seek(0)
            return _json_array(path, f.read())
        f.seek(0)
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError(
                    f"{path} row {len(records)} (line {line_number}): not valid JSON: {err}"
                ) from None
            if not isinstance(record, dict):
                raise DataFileError(
                    f"{path} row {len(records)} (line {line_number}): a JSON "
                    f"{type(record).__name__}, not an object"
                )
            records.append(record)
    log.info(
        "%s: read line by line (Arrow could not read it: %r)",
        path,
        arrow_error.__cause__ or arrow_error,
    )
    return records


def _json_array(path: str, text: str) -> list[dict[str, Any]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataFileError(f"{path}: not valid JSON: {err}") from None
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataFileError(f"{path} row {i}: a JSON {type(record).__name__}, not an object")
    return records


@dataclass
class BadRows:
    """The bad-row policy of one load, and the rows it skipped."""

    policy: str
    skipped: list[RowError] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy not in ON_BAD_ROW:
            raise ValueError(
                f"task.params.on_bad_row={self.policy!r} is not one of {', '.join(ON_BAD_ROW)}"
            )

    def handle(self, error: RowError) -> None:
        if self.policy == "error":
            raise RowError(
                error.path,
                error.row,
                f"{error.reason} (set task.params."
                "on_bad_row=skip to skip such rows; they are counted and logged)",
            )
        self.skipped.append(error)

    def log_summary(self, num_rows: int, what: str) -> None:
        if not self.skipped:
            return
        named = "; ".join(str(e) for e in self.skipped[:_NUM_LOGGED_SKIPS])
        more = len(self.skipped) - _NUM_LOGGED_SKIPS
        log.warning(
            "%s: skipped %d of %d rows without a usable question or answer (on_bad_row=skip): %s%s",
            what,
            len(self.skipped),
            num_rows,
            named,
            f"; and {more} more" if more > 0 else "",
        )


def split_by_seed(items: Sequence[Any], fraction: float, seed: int) -> tuple[list, list]:
    """(train, held_out): round(fraction * n) items, at least 1, drawn by `seed`; both keep
    file order. Fails if nothing would be left to train on."""
    if not 0 < fraction < 1:
        raise ValueError(f"task.params.eval_fraction={fraction!r} must be in (0, 1)")
    num_eval = max(1, round(fraction * len(items)))
    if num_eval >= len(items):
        raise ValueError(
            f"task.params.eval_fraction={fraction!r} of {len(items)} rows leaves "
            "no training rows; lower it or give a separate eval_path"
        )
    held = set(random.Random(f"heldout/{seed}").sample(range(len(items)), num_eval))
    train = [x for i, x in enumerate(items) if i not in held]
    return train, [x for i, x in enumerate(items) if i in held]
