"""Everything a run needs before its first message: directory, model, task, tokenized prompts.

`prepare_run` is blocking (it may warm-start the embedded model, which trains for a minute)
and is called in a thread. It resolves `model.path` (the embedded default is built and
cached on first use), writes the resolved config to `<run_dir>/config.yaml`, loads the task
and tokenizer, and tokenizes the held-out prompts. Training prompts are tokenized lazily,
one group at a time, off the event loop (`next_train_prompt`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np
import torch

from areal.config import RunConfig, config_to_dict, config_to_yaml
from areal.models.tokenizer import load_tokenizer
from areal.tasks import Prompt, Task, load_task
from areal.tasks.environment import Environment, load_environment
from areal.types import PackedBatch

SAVED_BATCH_FIELDS = (
    "token_ids",
    "logprobs",
    "versions",
    "loss_mask",
    "cu_seqlens",
    "rewards",
    "group_ids",
)
"""The fields of a PackedBatch that `logging.save_batches` writes."""


def saved_batch_path(run_dir: str | Path, step: int) -> Path:
    """Where a run with `logging.save_batches` keeps the batch it trained at `step`."""
    return Path(run_dir) / "batches" / f"step_{step:06d}.npz"


def load_saved_batch(run_dir: str | Path, step: int) -> PackedBatch:
    """The batch a run trained at `step`, as `RunSetup.save_batch` wrote it."""
    data = np.load(saved_batch_path(run_dir, step))
    return PackedBatch(**{name: torch.from_numpy(data[name]) for name in SAVED_BATCH_FIELDS})


@dataclass(kw_only=True)
class RunSetup:
    cfg: RunConfig
    run_dir: Path
    task: Task
    tokenizer: Any
    eval_prompts: list[tuple[Prompt, np.ndarray]]
    stop_token_ids: list[int]
    config_dict: dict[str, Any] = field(default_factory=dict)
    environment: Environment | None = None
    """episode.environment, not started (stop strings and tools only; the rollout workers
    run it)."""
    num_drawn: int = 0
    """Training prompts drawn so far: the next one's position in the task's prompt stream."""
    _train_iter: Iterator[Prompt] | None = None
    _requeued: collections.deque[tuple[int, Prompt]] = field(default_factory=collections.deque)

    def tokenize(self, prompt: Prompt) -> np.ndarray:
        ids = self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {prompt.prompt_id!r} tokenizes to nothing")
        return np.asarray(ids, dtype=np.int32)

    def _draw(self) -> tuple[Prompt, np.ndarray]:
        assert self._train_iter is not None, "prepare_run sets the prompt stream"
        prompt = next(self._train_iter)
        return prompt, self.tokenize(prompt)

    def _next_train_prompt_sync(self) -> tuple[int, Prompt, np.ndarray]:
        """`next_train_prompt` in the caller's thread (the simulation's, tests')."""
        if self._requeued:
            position, prompt = self._requeued.popleft()
            return position, prompt, self.tokenize(prompt)
        prompt, ids = self._draw()
        self.num_drawn += 1
        return self.num_drawn - 1, prompt, ids

    async def next_train_prompt(self) -> tuple[int, Prompt, np.ndarray]:
        """(draw position, prompt, token ids) of the next training prompt. The draw is
        counted (`num_drawn`, the re-queued positions) only once it is done, after the last
        await: the caller admits the group without awaiting, so a resume state written
        meanwhile never counts a position that is neither in the ledger nor still queued
        (one drawn in the thread while a checkpoint was written was lost on resume)."""
        if self._requeued:
            position, prompt = self._requeued[0]
            ids = await asyncio.to_thread(self.tokenize, prompt)
            self._requeued.popleft()
            return position, prompt, ids
        prompt, ids = await asyncio.to_thread(self._draw)
        position = self.num_drawn
        self.num_drawn += 1
        return position, prompt, ids

    def requeued_positions(self) -> list[int]:
        """Positions queued again by `redraw` and not admitted yet."""
        return [position for position, _ in self._requeued]

    def redraw(self, drawn: int, untrained: list[int]) -> None:
        """Resume the prompt stream where a checkpoint left it: the same prompts, those at
        `untrained` positions first (their groups were not trained), then from `drawn` on."""
        wanted = set(untrained)
        assert self._train_iter is not None, "prepare_run sets the prompt stream"
        for position in range(drawn):
            prompt = next(self._train_iter)
            if position in wanted:
                self._requeued.append((position, prompt))
        self.num_drawn = drawn

    def save_batch(self, step: int, version: int, batch: PackedBatch) -> None:
        """`<run_dir>/batches/step_<n>.npz`: the packed batch as trained, for inspection."""
        path = saved_batch_path(self.run_dir, step)
        path.parent.mkdir(exist_ok=True)
        np.savez(
            path,
            version=version,
            **{name: getattr(batch, name).numpy() for name in SAVED_BATCH_FIELDS},
        )

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


def _endless(task: Task, seed: int) -> Iterator[Prompt]:
    """The task's training prompts; a finite split is cycled, reshuffled by the task's seed."""
    for epoch in itertools.count():
        yielded = False
        for prompt in task.train_prompts(seed + epoch):
            yielded = True
            yield prompt
        if not yielded:
            raise ValueError(f"task {task.name!r} has no training prompts")


def resolve_run_dir(cfg: RunConfig) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir).expanduser()
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def writable_run_dir(cfg: RunConfig) -> Path:
    """The run directory, created; ValueError naming it when it cannot be written (read-only,
    not a directory, no permission), before anything else is done."""
    run_dir = resolve_run_dir(cfg)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        raise ValueError(
            f"run_dir={str(run_dir)!r} cannot be written ({err.strerror or err}); "
            "give a writable directory (run_dir=...)"
        ) from None
    return run_dir


def prepare_run(cfg: RunConfig) -> RunSetup:
    run_dir = writable_run_dir(cfg)
    if cfg.model.path is None:
        from areal.models.warmstart import ensure_warm_model

        model = dataclasses.replace(cfg.model, path=str(ensure_warm_model(cfg)))
        cfg = dataclasses.replace(cfg, model=model)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    task = load_task(cfg.task.name, cfg.task.params)
    tokenizer = load_tokenizer(
        cfg.model.tokenizer_dir(),
        trust_remote_code=cfg.model.trust_remote_code,
        cache_dir=cfg.cache_dir,
    )
    task.use_tokenizer(tokenizer)
    environment = episode_environment(cfg, task, tokenizer)
    setup = RunSetup(
        cfg=cfg,
        run_dir=run_dir,
        task=task,
        tokenizer=tokenizer,
        eval_prompts=[],
        stop_token_ids=stop_token_ids(task, tokenizer, environment),
        config_dict=config_to_dict(cfg),
        environment=environment,
    )
    prompts = task.eval_prompts()
    if cfg.eval.max_prompts is not None:
        prompts = prompts[: cfg.eval.max_prompts]
    if not prompts:
        raise ValueError(f"task {task.name!r} has no held-out prompts to evaluate on")
    setup.eval_prompts = [(p, setup.tokenize(p)) for p in prompts]
    setup._train_iter = _endless(task, cfg.seed)
    return setup


def episode_environment(cfg: RunConfig, task: Task, tokenizer: Any) -> Environment | None:
    """episode.environment built (not started), its tools given to the task's prompts."""
    if cfg.episode.environment is None:
        return None
    environment = load_environment(
        cfg.episode.environment, cfg.episode.params, task=task, tokenizer=tokenizer
    )
    if environment.tools():
        task.use_tools(environment.tools())
    return environment


def stop_token_ids(task: Task, tokenizer: Any, environment: Environment | None = None) -> list[int]:
    """EOS plus the task's (and the environment's) stop strings, each a single token."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    texts = task.stop_strings() + (environment.stop_strings() if environment else [])
    for text in texts:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise ValueError(
                f"task {task.name!r}: stop string {text!r} is {len(tokens)} tokens for this "
                "tokenizer; only single-token stop strings are supported"
            )
        ids.append(int(tokens[0]))
    return sorted(set(ids))
