"""Where a run's numbers go: metrics.jsonl, TensorBoard, W&B, the console, and subscribers.

Every record is a flat dict with a `kind` ('step', 'eval', 'event', 'summary') and
namespaced keys (`rollout/`, `train/`, `reward/`, `perf/`, `staleness/`, `eval/`). JSONL is
always written (one line per record, flushed, so a crashed run keeps its history);
TensorBoard when `logging.tensorboard`; W&B when `logging.wandb_project` is set and wandb is
installed. Embedding applications receive the same records through `Controller.events()`,
whose queues the sink is given.
Writes are a line of text or a queue put; TensorBoard and W&B write from their own threads.

Progress goes to the console as a live tqdm bar when stdout and stderr are terminals, and
otherwise (a log file, a pipe, a batch job) as a plain line every `logging.progress_every`
steps and at the last one: a bar redrawn into a file repeats itself before every line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from areal.config import RunConfig

log = logging.getLogger(__name__)

_CLOSED = object()


class MetricsSink:
    def __init__(
        self, cfg: RunConfig, run_dir: Path, total_steps: int, subscribers: list[asyncio.Queue]
    ) -> None:
        """subscribers: the owner's list of queues; every record is put into each queue
        in it, including queues appended later."""
        self.run_dir = run_dir
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._subscribers = subscribers
        self._tb = self._open_tensorboard(cfg, run_dir)
        self._wandb = self._open_wandb(cfg, run_dir)
        self._progress = ConsoleProgress(
            total_steps, enabled=cfg.logging.progress, every=cfg.logging.progress_every
        )

    @staticmethod
    def _open_tensorboard(cfg: RunConfig, run_dir: Path) -> Any:
        if not cfg.logging.tensorboard:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    @staticmethod
    def _open_wandb(cfg: RunConfig, run_dir: Path) -> Any:
        if not cfg.logging.wandb_project:
            return None
        try:
            import wandb
        except ImportError:
            log.warning(
                "logging.wandb_project is set but wandb is not installed "
                "(pip install wandb); logging to JSONL and TensorBoard only"
            )
            return None
        from areal.config import config_to_dict

        return wandb.init(
            project=cfg.logging.wandb_project,
            dir=str(run_dir),
            name=run_dir.name,
            config=config_to_dict(cfg),
        )

    def record(self, kind: str, values: dict[str, Any], step: int | None = None) -> None:
        record = {"kind": kind, **({"step": step} if step is not None else {}), **values}
        self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        for queue in self._subscribers:
            queue.put_nowait(record)
        if step is None:
            return
        scalars = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def progress(self, step: int, postfix: dict[str, float]) -> None:
        self._progress.update(step, postfix)

    def console(self, text: str) -> None:
        """A line on the console that does not tear the progress bar."""
        self._progress.write(text)

    def close(self) -> None:
        self._progress.close()
        for queue in self._subscribers:
            queue.put_nowait(_CLOSED)
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl.close()


class ConsoleProgress:
    """Training progress on the console: a tqdm bar on a terminal, plain lines elsewhere.

    `interactive` None: a terminal when both stdout (lines) and stderr (the bar) are one."""

    def __init__(
        self, total_steps: int, *, enabled: bool, every: int, interactive: bool | None = None
    ) -> None:
        if interactive is None:
            interactive = sys.stdout.isatty() and sys.stderr.isatty()
        self.total_steps = total_steps
        self.enabled = enabled
        self.every = every
        self._bar = tqdm(
            total=total_steps,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not (enabled and interactive),
        )
        self._plain = enabled and not interactive
        self._started = time.monotonic()

    def update(self, step: int, postfix: dict[str, float]) -> None:
        shown = {k: f"{v:.3g}" for k, v in postfix.items()}
        if self._plain:
            if step % self.every == 0 or step == self.total_steps:
                values = "".join(f"  {k} {v}" for k, v in shown.items())
                print(
                    f"train step {step}/{self.total_steps}{values}  "
                    f"({time.monotonic() - self._started:.0f} s)",
                    flush=True,
                )
            return
        self._bar.n = step
        self._bar.set_postfix(shown, refresh=False)
        self._bar.refresh()

    def write(self, text: str) -> None:
        if self._bar.disable:
            print(text, flush=True)
        else:
            self._bar.write(text)

    def close(self) -> None:
        self._bar.close()


def closed_marker() -> Any:
    """What a subscriber queue receives when the run is over."""
    return _CLOSED


def is_closed(record: Any) -> bool:
    return record is _CLOSED


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
