"""The warm-started embedded model: build the tiny model, fine-tune it briefly, cache it.

`ensure_warm_model(cfg)` returns a Hugging Face model directory for `model.path=null` runs:
the tiny Qwen2 of `model.tiny`, fine-tuned for `model.warmstart.steps` AdamW steps on the
task's own supervised examples (`task.sft_examples(seed, num)`; loss on completion tokens and
EOS only, never on the prompt), so that RL starts from a policy that writes the task's format
and is right part of the time. The result is cached under `<cache_dir>/warmstart/<key>/`,
where the key hashes everything that determines the weights (model shape, warm-start
settings, task name and params, run seed, `WARMSTART_VERSION`); later runs with the same
inputs reuse it without training. A build happens in a temporary directory that is renamed
into place, and under a per-key file lock, so concurrent processes neither see half a model
nor train the same one twice.

It does not evaluate the model (the controller does that at step 0) and does not touch
user-supplied models (`model.path`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import inspect
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

import torch

from areal.config import RunConfig, WarmStartConfig
from areal.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir
from areal.tasks import BUILTIN_TASKS, load_task

logger = logging.getLogger(__name__)

WARMSTART_VERSION = 1
"""Bump whenever the code that builds or trains the warm model changes its weights."""
num_builds = 0
"""Warm models this process has built (trained and published); tests read it."""
METADATA_FILE = "warmstart.json"
"""Written last into a finished warm-model directory: the key's inputs and the SFT curve."""
_BETAS = (0.9, 0.98)
_GRAD_CLIP = 1.0
_FINAL_LR_FRACTION = 0.1
"""Cosine decay ends at this fraction of `warmstart.lr`."""


def warm_key_inputs(cfg: RunConfig) -> dict[str, Any]:
    """Everything that determines the warm model's weights, as plain data."""
    return {
        "version": WARMSTART_VERSION,
        "tiny": dataclasses.asdict(cfg.model.tiny),
        "warmstart": dataclasses.asdict(cfg.model.warmstart),
        "task": {
            "name": cfg.task.name,
            "params": dict(cfg.task.params),
            "source": task_source_digest(cfg.task.name),
        },
        "seed": cfg.seed,
    }


def task_source_digest(name: str) -> str:
    """Digest of the task module's source: editing how a task makes its SFT data (a user's
    task, or ours) must not reuse a warm model built from the old data."""
    module_name = BUILTIN_TASKS.get(name, name).partition(":")[0]
    try:
        # a module without a source file gives Path(None): the TypeError caught below
        source = Path(inspect.getsourcefile(importlib.import_module(module_name))).read_bytes()
    except (ImportError, OSError, TypeError):  # load_task reports a bad name with context
        return ""
    return hashlib.sha256(source).hexdigest()[:16]


def warm_key(cfg: RunConfig) -> str:
    """A short hex digest of `warm_key_inputs(cfg)`: the cache directory's name."""
    return _digest(warm_key_inputs(cfg))


def _digest(inputs: dict[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def warm_model_dir(cfg: RunConfig) -> Path:
    """Where the warm model for `cfg` lives (whether or not it exists yet)."""
    return Path(cfg.cache_dir).expanduser() / "warmstart" / warm_key(cfg)


def is_complete(directory: Path) -> bool:
    """True for a finished warm-model directory (its metadata file is written last)."""
    return (directory / METADATA_FILE).is_file()


def ensure_warm_model(cfg: RunConfig, *, threads: int | None = 1) -> Path:
    """The warm-started embedded model's directory for `cfg`, built on first use.

    `threads`: torch intra-op threads while building (restored afterwards); None keeps the
    caller's setting. One is the default because the tiny model gains little from a second
    thread (~1.4x when the machine is idle) and loses a lot when another process competes
    for the cores (OpenMP threads then wait on each other: 100 steps went from 4 s to 160 s
    on a busy 2-core machine, against 6 s on one thread either way).
    """
    global num_builds
    final = warm_model_dir(cfg)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f"{final.name}.lock"):
        if is_complete(final):  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            with _torch_threads(threads):
                build_warm_model(cfg, tmp)
            if final.exists():  # a leftover without metadata: never published, safe to drop
                shutil.rmtree(final)
            os.rename(tmp, final)
            num_builds += 1
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_warm_model(cfg: RunConfig, directory: Path) -> dict[str, Any]:
    """Build, fine-tune and save the warm model into `directory`; returns its metadata."""
    start, start_cpu = time.perf_counter(), time.process_time()
    task = load_task(cfg.task.name, cfg.task.params)
    ws = cfg.model.warmstart
    sft_examples = getattr(task, "sft_examples", None)
    if ws.steps and sft_examples is None:
        raise ValueError(
            f"task.name={cfg.task.name!r} has no sft_examples(seed, num) to warm-start the "
            "embedded model on; give model.path (a Hugging Face model directory) or set "
            "model.warmstart.steps=0 to start RL from the random model"
        )
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        cfg.model.tiny,
        len(tokenizer),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        seed=cfg.seed,
    )
    losses: list[float] = []
    if ws.steps:
        assert sft_examples is not None  # refused above
        examples = sft_examples(cfg.seed, ws.steps * ws.batch_size)
        prompts = [ex.prompt.text for ex in examples]
        # An episode (areal.tasks.environment.SFTEpisode) comes as (text, trained) segments.
        completions = [getattr(ex, "segments", None) or ex.completion for ex in examples]
        sequences = encode_sft(tokenizer, prompts, completions)
        losses = sft(model, sequences, ws, pad_token_id=tokenizer.pad_token_id, seed=cfg.seed)
    save_model_dir(model, tokenizer, directory)
    inputs = warm_key_inputs(cfg)
    metadata = {
        "key": _digest(inputs),
        "inputs": inputs,
        "num_examples": ws.steps * ws.batch_size,
        "loss_first": losses[0] if losses else None,
        "loss_last": _tail_mean(losses),
        "losses": [round(x, 5) for x in losses],
        "seconds": round(time.perf_counter() - start, 2),
        "cpu_seconds": round(time.process_time() - start_cpu, 2),
        "threads": torch.get_num_threads(),
    }
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
    logger.info(
        "warm start %s: %d SFT steps, loss %.3f -> %.3f, %.1f s",
        metadata["key"],
        ws.steps,
        metadata["loss_first"] or float("nan"),
        metadata["loss_last"] or float("nan"),
        metadata["seconds"],
    )
    return metadata


def _tail_mean(values: Sequence[float], n: int = 10) -> float | None:
    tail = list(values[-n:])
    return sum(tail) / len(tail) if tail else None


SFTSequence = tuple[list[int], list[bool]]
"""One SFT sequence: token ids (prompt + completion + EOS) and, per token, whether it is a
trained target (completion tokens the model writes, and EOS; not the prompt, not an
episode's observations)."""


def encode_sft(
    tokenizer: Any, prompts: Sequence[str], completions: Sequence[str | Sequence[tuple[str, bool]]]
) -> list[SFTSequence]:
    """(prompt + completion + EOS token ids, trained-target flags) per example. A completion
    is its text, or (text, trained) segments tokenized one by one (an episode, whose
    observations are context, not targets)."""
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    texts = [c for c in completions if isinstance(c, str)]
    text_ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    eos = tokenizer.eos_token_id
    out = []
    for p, completion in zip(prompt_ids, completions, strict=True):
        ids, targets = list(p), [False] * len(p)
        pieces = (
            [(next(text_ids), True)]
            if isinstance(completion, str)
            else [
                (tokenizer(text, add_special_tokens=False)["input_ids"], trained)
                for text, trained in completion
            ]
        )
        for piece, trained in pieces:
            ids += piece
            targets += [trained] * len(piece)
        out.append((ids + [eos], targets + [True]))
    return out


def collate(
    sequences: Sequence[SFTSequence], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, T], attention mask [B, T], and loss mask [B, T-1] that is
    1 where the next token is a trained target."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    loss_mask = torch.zeros((len(sequences), width - 1))
    for row, (ids, targets) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        loss_mask[row, : len(ids) - 1] = torch.tensor(targets[1:], dtype=torch.float32)
    return input_ids, attention, loss_mask


def completion_nll(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """Summed negative log-likelihood of the completion tokens (scalar)."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), input_ids[:, 1:], reduction="none"
    )
    return (nll * loss_mask).sum()


def length_buckets(sequences: Sequence[SFTSequence]) -> list[list[SFTSequence]]:
    """Split a batch into micro-batches of similar length (longest first; a new one starts
    where a sequence is at most half the micro-batch's longest), so short sequences (bare
    answers) are not padded to the longest trace. Padding costs ~1.5x compute otherwise."""
    buckets: list[list[SFTSequence]] = []
    for seq in sorted(sequences, key=lambda s: len(s[0]), reverse=True):
        if not buckets or 2 * len(seq[0]) <= len(buckets[-1][0][0]):
            buckets.append([])
        buckets[-1].append(seq)
    return buckets


def batch_loss(
    model: torch.nn.Module, batch: Sequence[SFTSequence], pad_token_id: int
) -> torch.Tensor:
    """Mean NLL per completion token over the whole batch, accumulated over length buckets
    (backward is called per bucket to free activations early); returns the detached loss."""
    num_tokens = sum(sum(targets) for _, targets in batch)
    total = torch.zeros(())
    for bucket in length_buckets(batch):
        nll = completion_nll(model, *collate(bucket, pad_token_id)) / max(num_tokens, 1)
        nll.backward()
        total += nll.detach()
    return total


def lr_factor(step: int, num_steps: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, num_steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return _FINAL_LR_FRACTION + (1 - _FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def sft(
    model: torch.nn.Module,
    sequences: Sequence[SFTSequence],
    ws: WarmStartConfig,
    *,
    pad_token_id: int,
    seed: int,
    log_every: int = 50,
) -> list[float]:
    """`ws.steps` AdamW steps over consecutive batches of `sequences`; the loss per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=_BETAS, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, ws.steps))
    losses = []
    model.train()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for step in range(ws.steps):
            batch = sequences[step * ws.batch_size : (step + 1) * ws.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(model, batch, pad_token_id)
            torch.nn.utils.clip_grad_norm_(model.parameters(), _GRAD_CLIP)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if log_every and (step + 1) % log_every == 0:
                logger.info(
                    "warm start step %d/%d: loss %.4f",
                    step + 1,
                    ws.steps,
                    _tail_mean(losses, log_every),
                )
    model.eval()
    return losses
