"""A real run whose every Completions goes through the controller's intake thread (its
threshold lowered to one byte): the thread, not the event loop, decodes each message, checks
its parts and reads its tokens, the run trains as it would, and the step records count the
thread's CPU."""

from __future__ import annotations

import asyncio
import threading

import pytest

from areal.controller import checks
from letter_runs import letter_config, letter_task_importable, recorded_run

pytestmark = pytest.mark.slow

STEPS = 2


def test_every_completions_is_read_on_the_intake_thread_and_the_run_trains(
    tmp_path, tiny_model_dir, monkeypatch
):
    threads: list[str] = []
    read = checks.read_completions

    def read_and_note(msg) -> None:
        threads.append(threading.current_thread().name)
        read(msg)

    monkeypatch.setattr(checks, "INTAKE_MIN_BYTES", 1)
    monkeypatch.setattr(checks, "read_completions", read_and_note)
    on_loop: list[int] = []
    fit = checks.completions_fit

    def fit_and_note(msg, **kwargs) -> bool:
        # None: the loop would read the tokens; not True: it would check the parts
        on_loop.append(msg.token_bounds is None or msg.parts_fit is not True)
        return fit(msg, **kwargs)

    monkeypatch.setattr("areal.controller.core.completions_fit", fit_and_note)
    cfg = letter_config(tmp_path / "run", tiny_model_dir, STEPS, "trainer.checkpoint_every=0")
    with letter_task_importable():
        run = asyncio.run(recorded_run(cfg))
    assert run["summary"]["steps"] == STEPS
    assert threads and set(threads) == {"intake"}
    assert on_loop and not any(on_loop)  # every Completions judged came checked, with its bounds
    steps = [r for r in run["records"] if r["kind"] == "step"]
    assert len(steps) == STEPS
    assert all(r["perf/intake_cpu_s"] >= 0 for r in steps)
    assert sum(r["perf/intake_cpu_s"] for r in steps) > 0
