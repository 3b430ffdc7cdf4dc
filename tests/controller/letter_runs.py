"""In-process runs of the letter task (letter_task.py) for tests: one config and one runner
that records every event, shared by the tests that train a few steps, checkpoint every 2
and resume."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from areal.config import RunConfig, load_config
from areal.controller import Controller

HERE = Path(__file__).parent
BATCH, GROUP = 8, 4


def letter_config(run_dir: Path, model_dir: str, steps: int, *extra: str) -> RunConfig:
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "task.name=letter_task:LetterTask",
            f"trainer.total_steps={steps}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            "trainer.checkpoint_every=2",
            "trainer.lr=1e-2",
            "rollout.max_new_tokens=16",
            "eval.every_steps=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "controller.heartbeat_interval_s=0.5",
            *extra,
        ]
    )


async def recorded_run(cfg: RunConfig, resume: bool = False) -> dict:
    """Run `cfg` to its end: the controller, every event record, the run's summary, and
    the verdicts of each training group's samples once all were scored, by group id
    ("completed": a group filter that drops nothing sees each)."""
    ctl = Controller(cfg, resume=resume)
    completed: dict[int, list] = {}

    def remember(group) -> None:
        completed[group.group_id] = [s.verdict for s in group.samples]

    ctl.group_filters.append(remember)
    run = asyncio.create_task(ctl.run())
    records = [record async for record in ctl.events()]
    return {"ctl": ctl, "records": records, "summary": await run, "completed": completed}


@contextmanager
def letter_task_importable() -> Iterator[None]:
    """The task importable here and in the worker processes the runs start."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        yield
