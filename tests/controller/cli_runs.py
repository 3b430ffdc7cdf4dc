"""Helpers for tests that run `python -m areal.controller` as a real process and hurt it.

The runs use the letter task (letter_task.py, learnt by a random tiny model in a few steps)
with a short heartbeat, so that faults are noticed in a second or two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable

import psutil

HERE = Path(__file__).parent


def letter_overrides(run_dir: Path, model_dir: str, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"run_dir={run_dir}",
        "task.name=letter_task:LetterTask",
        "trainer.batch_size=8",
        "task.group_size=4",
        "trainer.lr=1e-2",
        "rollout.max_new_tokens=16",
        "eval.every_steps=0",
        "eval.max_prompts=4",
        "logging.progress=false",
        "logging.tensorboard=false",
        "controller.heartbeat_interval_s=0.5",
        "controller.heartbeat_timeout_s=5",
        *extra,
    ]


def start(args: list[str], log: Path) -> subprocess.Popen:
    """The controller CLI with `args`, this folder importable (the task), output to `log`."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "areal.controller", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir) if r["kind"] == "step"), default=0)


def wait_for(
    condition: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the controller exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def workers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The controller's workers: its children, or its fork server's (worker_start)."""
    workers = []
    for child in psutil.Process(proc.pid).children():
        if "areal.controller.fork_server" in " ".join(child.cmdline()):
            workers += child.children()
        else:
            workers.append(child)
    return workers


def process_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process under the controller: workers, the fork server, their children."""
    return psutil.Process(proc.pid).children(recursive=True)


def kill_hard(proc: subprocess.Popen) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """kill -9 the controller; returns its workers and every process under it (they should
    all die with it)."""
    workers, tree = workers_of(proc), process_tree(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return workers, tree


def running(process: psutil.Process) -> bool:
    """Still running: neither gone nor a zombie. A zombie has exited and awaits only its
    reaping, by whatever init its parent's death handed it to (this machine's reaps every
    second or two)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def all_gone(processes: list[psutil.Process], timeout_s: float) -> bool:
    """Every one of `processes` exited within `timeout_s`; those still running then are
    killed (not left behind when the test fails)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in processes if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in alive:
        p.kill()
    return not alive


def run_to_end(args: list[str], log: Path, timeout_s: float = 300) -> int:
    proc = start(args, log)
    try:
        return proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            for p in process_tree(proc):
                p.kill()
            proc.kill()


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
