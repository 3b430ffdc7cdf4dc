"""Start-up time of the default job and time to replace a lost rollout worker, with the
local launcher and with launcher=ray, in one run, as ratios.

    python bench/launchers.py [--quick] [--repeats 3] [--out DIR]

Each trial drives a real run through the embedding API (`Controller(cfg, runtime=...)`,
the runtime `make_runtime` picks for cfg.launcher) and watches its worker pool:

- start-up:     from `run()` until every worker (rollout, reward, trainer) is ready: the
                run's set-up (task, tokenizer, held-out prompts; the embedded model comes
                from its cache, built once before the trials), and for Ray the placement
                groups and actors, then each worker's own start (imports, model load);
- first step:   from `run()` to the first step record (the initial evaluation included);
- replace:      from `kill -9` of the rollout worker's process (the same fault for both
                launchers: the worker process dies) until its replacement is ready again
                (the loss noticed, the work re-queued, a new process started and loaded).

Each local trial starts with no fork server, as a fresh `python -m areal.controller` does
(the server outlives a run in its process: a second trial would find it warm and skip the
seconds of its imports). The Ray trials join a cluster of this machine
(controller/launch/local_cluster.py: a head and two worker nodes as separate raylets),
started once and not timed, as a user's runs join a running cluster. `--quick` runs one
trial each with a random tiny model (a smoke test); the full run uses the default job (the
warm-started embedded model and the arithmetic task, evaluated on 32 held-out problems
instead of 256 to keep the final evaluation short) and reports the median of `--repeats`
trials. Full runs write docs/results/launchers.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_page import publish, write_results

from areal.config import load_config
from areal.controller import preload
from areal.messages import WorkerKind

POLL_S = 0.02
TIMEOUT_S = 600.0


async def _until(condition, what: str, run_task: asyncio.Task) -> float:
    """Seconds until `condition()` holds (the run must not end meanwhile)."""
    start = time.monotonic()
    while not condition():
        if run_task.done():
            run_task.result()
            raise RuntimeError(f"the run ended before {what}")
        if time.monotonic() - start > TIMEOUT_S:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)
    return time.monotonic() - start


def _all_ready(controller) -> bool:
    core = controller.core  # None until the run is set up
    return core is not None and all(core.pool.ready(kind) for kind in WorkerKind)


async def trial(overrides: list[str]) -> dict[str, float]:
    """One run: its start-up, first step and rollout replacement times (seconds)."""
    from areal.controller import Controller
    from areal.controller.launch import make_runtime

    cfg = load_config(overrides=overrides)
    controller = Controller(cfg, runtime=make_runtime(cfg))
    steps: list[float] = []

    async def watch() -> None:
        async for record in controller.events():
            if record.get("kind") == "step":
                steps.append(time.monotonic())

    start = time.monotonic()
    watcher = asyncio.create_task(watch())
    run = asyncio.create_task(controller.run())
    try:
        startup = await _until(lambda: _all_ready(controller), "the workers' start", run)
        await _until(lambda: steps, "the first step", run)
        first_step = steps[0] - start
        (rollout,) = controller.core.pool.ready(WorkerKind.ROLLOUT)
        old_pid = rollout.pid
        os.kill(old_pid, signal.SIGKILL)
        replace = await _until(
            lambda: any(h.pid != old_pid for h in controller.core.pool.ready(WorkerKind.ROLLOUT)),
            "the replacement rollout worker",
            run,
        )
        controller.stop()
        await run
    finally:
        if not run.done():
            run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        watcher.cancel()
    return {"startup_s": startup, "first_step_s": first_step, "replace_s": replace}


def job_overrides(run_dir: Path, model: str | None, quick: bool) -> list[str]:
    out = [
        f"run_dir={run_dir}",
        "trainer.total_steps=1000",
        "eval.every_steps=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"eval.max_prompts={4 if quick else 32}",
    ]
    if model:
        out.append(f"model.path={model}")
    if quick:
        out += ["trainer.batch_size=16", "rollout.max_new_tokens=16"]
    return out


def measure(args: argparse.Namespace, work: Path) -> dict[str, list[dict[str, float]]]:
    from areal.controller.launch.local_cluster import local_cluster

    model = None
    if args.quick:
        from areal.models.tiny import save_tiny_model

        model = str(save_tiny_model(work / "model"))
    else:
        from areal.models.warmstart import ensure_warm_model

        ensure_warm_model(load_config())  # built once, cached: not part of any trial
    results: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    with local_cluster([{"num_cpus": 2}] * 2) as cluster:
        for repeat in range(args.repeats):
            for launcher in ("local", "ray"):
                run_dir = work / f"{launcher}-{repeat}"
                overrides = job_overrides(run_dir, model, args.quick) + [f"launcher={launcher}"]
                if launcher == "ray":
                    overrides.append(f"ray.address={cluster.address}")
                else:
                    preload.close()  # the CLI's start: the run starts its own server
                times = asyncio.run(trial(overrides))
                print(
                    f"{launcher} trial {repeat + 1}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in times.items()),
                    flush=True,
                )
                results[launcher].append(times)
    return results


def table(results: dict[str, list[dict[str, float]]]) -> tuple[str, dict[str, Any]]:
    medians = {
        launcher: {key: statistics.median(t[key] for t in trials) for key in trials[0]}
        for launcher, trials in results.items()
    }
    rows = [
        ("start-up (workers ready)", "startup_s"),
        ("first step", "first_step_s"),
        ("replace a lost rollout worker", "replace_s"),
    ]
    lines = [
        f"{'seconds (median of ' + str(len(results['local'])) + ')':32} {'local':>8} "
        f"{'ray':>8} {'ray/local':>10}",
        "-" * 62,
    ]
    for label, key in rows:
        local, ray = medians["local"][key], medians["ray"][key]
        lines.append(f"{label:32} {local:8.1f} {ray:8.1f} {ray / local:9.2f}x")
    return "\n".join(lines), {"medians": medians, "trials": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one trial each, tiny model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="areal-launchers-") as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = measure(args, work)
    text, data = table(results)
    print(text)
    if publish(args.quick, args.out):
        page = write_results(
            "launchers",
            title="Launchers: local processes and Ray actors",
            command="python bench/launchers.py " + " ".join(argv or sys.argv[1:]),
            table=text,
            data=data,
            notes="Ray trials join a running cluster of this machine (a head and two worker "
            "nodes, started once, not timed); each local trial starts without a fork server, "
            "as a fresh `python -m areal.controller` does. Start-up: from run() until every "
            "worker is ready; replace: from kill -9 of the rollout worker's process until "
            "its replacement is ready.",
        )
        print(f"results: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
