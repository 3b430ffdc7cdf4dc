"""Where a run's numbers go: metrics.jsonl, TensorBoard, W&B, the console, and subscribers.

Every record is a flat dict with a `kind` ('step', 'eval', 'event', 'summary') and
namespaced keys (`rollout/`, `train/`, `reward/`, `perf/`, `staleness/`, `eval/`). JSONL is
always written (one line per record, flushed, so a crashed run keeps its history);
TensorBoard when `logging.tensorboard`; W&B when `logging.wandb_project` is set and wandb is
installed. Embedding applications receive the same records through `Controller.events()`,
whose queues the sink is given.
Writes are a line of text or a queue put; TensorBoard and W&B write from their own threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from areal.config import RunConfig

log = logging.getLogger(__name__)

_CLOSED = object()


class MetricsSink:
    def __init__(self, cfg: RunConfig, run_dir: Path, total_steps: int,
                 subscribers: list[asyncio.Queue]) -> None:
        """subscribers: the owner's list of queues; every record is put into each queue
        in it, including queues appended later."""
        self.run_dir = run_dir
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._subscribers = subscribers
        self._tb = self._open_tensorboard(cfg, run_dir)
        self._wandb = self._open_wandb(cfg, run_dir)
        self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True,
                         disable=not cfg.logging.progress)

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
            log.warning("logging.wandb_project is set but wandb is not installed "
                        "(pip install wandb); logging to JSONL and TensorBoard only")
            return None
        from areal.config import config_to_dict

        return wandb.init(project=cfg.logging.wandb_project, dir=str(run_dir),
                          name=run_dir.name, config=config_to_dict(cfg))

    def record(self, kind: str, values: dict[str, Any], step: int | None = None) -> None:
        record = {"kind": kind, **({"step": step} if step is not None else {}), **values}
        self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        for queue in self._subscribers:
            queue.put_nowait(record)
        if step is None:
            return
        scalars = {k: float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def progress(self, step: int, postfix: dict[str, float]) -> None:
        self._bar.n = step
        self._bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items()}, refresh=False)
        self._bar.refresh()

    def console(self, text: str) -> None:
        """A line on the console that does not tear the progress bar."""
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()
        for queue in self._subscribers:
            queue.put_nowait(_CLOSED)
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl.close()


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
