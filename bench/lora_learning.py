"""Does LoRA learn the default task, and how does it compare with full fine-tuning?

    python bench/lora_learning.py [--seeds 3] [--steps 60] [--arms full-torch lora-torch
                                  lora-vllm] [--resume] [--quick] [key=value ...]

Each arm is a real training run per seed of the default job (the embedded model, warm
started, on the arithmetic task; controller, rollout, reward and trainer processes): full
fine-tuning, or LoRA (`LORA` below) served by the built-in torch engine or by vLLM. A run
is scored by greedy held-out pass@1 on the task's held-out problems before its first and
after its last step (the default run's evaluation); the table shows, per arm, the mean and
95% Student t-interval over seeds (areal.intervals) of pass@1 after, of the gain over the
start, and the time per step (the trainer's step, its publication, and the run's wall
time per step).

Every run starts from the same warm-started model (built with seed=1). The LoRA arms get
their own learning rate (`LORA`): adapters need a larger one than full fine-tuning for the
same progress, as LoRA practice says (the trainer updates r(m + n) numbers per layer
instead of m * n); the full arm keeps the default run's settings. `--quick` runs one seed of
the lora-torch arm for 3 steps with small batches (a smoke test: numbers meaningless). Results:
cells.json and table.txt under --out, and (full runs only) the results page
docs/results/lora_learning.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).parent))
from results_page import publish, write_results

from areal.config import load_config
from areal.controller import Controller
from areal.intervals import t_interval
from areal.models.warmstart import ensure_warm_model

LORA = ["trainer.lora.rank=16", "trainer.lora.alpha=32", "trainer.lr=1e-3"]
"""The LoRA arms: rank 16 on every projection of the embedded model (hidden 128, MLP 512:
a rank that fits it, 12.5% of the width), alpha 2 * rank, and lr 1e-3 (10x the default)."""
ARMS = {
    "full-torch": ["rollout.engine=torch"],
    "lora-torch": [*LORA, "rollout.engine=torch"],
    "lora-vllm": [*LORA, "rollout.engine=vllm", "rollout.vllm.cpu_kvcache_space_gb=0.5"],
}
STEPS = 60
QUICK = [
    "trainer.batch_size=16",
    "task.group_size=4",
    "eval.max_prompts=16",
    "rollout.max_new_tokens=32",
    "model.warmstart.steps=40",
]
"""--quick: small batches, a short warm start, a small held-out set; a smoke test only."""
QUICK_ARMS = ["lora-torch"]


def _overrides(args: argparse.Namespace, model_dir: Path, arm: str, seed: int) -> list[str]:
    run_dir = args.out / "runs" / f"{arm}-seed{seed}"
    return [
        *args.setting,
        *ARMS[arm],
        f"model.path={model_dir}",
        f"seed={seed}",
        f"trainer.total_steps={args.steps}",
        "eval.every_steps=0",
        f"run_dir={run_dir}",
        "trainer.checkpoint_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *args.overrides,
    ]


async def _run(overrides: list[str]) -> dict[str, Any]:
    cfg = load_config(overrides=overrides)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a fresh run, never mixed with a stale one
    ctl = Controller(cfg)
    run = asyncio.create_task(ctl.run())
    step_s, publish_s, publish_bytes = [], [], []
    async for record in ctl.events():
        if record["kind"] == "step":
            step_s.append(record.get("train/step_s", 0.0))
            publish_s.append(record.get("train/publish_s", 0.0))
            publish_bytes.append(record.get("train/publish_bytes", 0.0))
    summary = await run
    steps = max(summary["steps"], 1)
    return {
        "pass@1": summary["eval_pass@1_after"],
        "pass@1_before": summary["eval_pass@1_before"],
        "gain": summary["eval_pass@1_gain"],
        "wall_per_step_s": summary["train_time_s"] / steps,
        "trainer_step_s": fmean(step_s) if step_s else 0.0,
        "publish_s": fmean(publish_s) if publish_s else 0.0,
        "publish_bytes": fmean(publish_bytes) if publish_bytes else 0.0,
        "steps": summary["steps"],
    }


def run_all(args: argparse.Namespace) -> dict[str, list[dict]]:
    """{arm: [result per seed]}; results already in cells.json are kept with --resume."""
    path = args.out / "cells.json"
    cells = json.loads(path.read_text()) if args.resume and path.exists() else {}
    cfg = load_config(overrides=[*args.setting, "seed=1", *args.overrides])
    model_dir = ensure_warm_model(cfg) if cfg.model.path is None else Path(cfg.model.path)
    for seed in range(1, args.seeds + 1):  # seed-major: every arm gets seed 1 first
        for arm in args.arms:
            done = cells.setdefault(arm, [])
            if any(r["seed"] == seed for r in done):
                continue
            start = time.monotonic()
            result = uvloop.run(_run(_overrides(args, model_dir, arm, seed)))
            result["seed"] = seed
            done.append(result)
            done.sort(key=lambda r: r["seed"])
            path.write_text(json.dumps(cells, indent=1))
            print(
                f"{arm} seed {seed}: pass@1 {result['pass@1_before']:.3f} -> "
                f"{result['pass@1']:.3f}, {time.monotonic() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return cells


def table(cells: dict[str, list[dict]]) -> str:
    head = (
        f"{'arm':<11} {'seeds':>5} {'pass@1 after':>22} {'gain (points)':>24} "
        f"{'trainer step':>13} {'publish':>9} {'MB/version':>11} {'wall/step':>10}"
    )
    lines = [head, "-" * len(head)]
    for arm, results in cells.items():
        if not results:
            continue
        after = t_interval([r["pass@1"] for r in results]).format()
        gain = t_interval([100 * r["gain"] for r in results]).format(1)
        lines.append(
            f"{arm:<11} {len(results):>5} {after:>22} {gain:>24} "
            f"{fmean(r['trainer_step_s'] for r in results):>12.2f}s "
            f"{1e3 * fmean(r['publish_s'] for r in results):>7.1f}ms "
            f"{fmean(r['publish_bytes'] for r in results) / 2**20:>11.3f} "
            f"{fmean(r['wall_per_step_s'] for r in results):>9.2f}s"
        )
    lines.append(
        "mean [95% t-interval] over seeds; pass@1: greedy, held-out; times: means "
        "over steps and seeds"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs (seeds 1..N) per arm")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: lora-torch, 1 seed, 3 small steps"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the results already in --out/cells.json, run the rest",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: bench/results/lora_learning (quick: a temporary one)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args(argv)
    args.publish = publish(args.quick or bool(args.overrides), args.out)
    args.setting = []
    if args.quick:
        args.seeds, args.steps, args.arms = 1, 3, QUICK_ARMS
        args.setting += QUICK
    if args.out is None:
        args.out = Path("bench/results/lora_learning")
        if args.quick:
            import tempfile

            args.out = Path(tempfile.mkdtemp(prefix="lora-learning-quick-"))
    if min(args.seeds, args.steps) < 1:
        parser.error("--seeds and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cells = run_all(args)
    text = table(cells)
    print(text)
    (args.out / "table.txt").write_text(text + "\n")
    if args.publish:
        page = write_results(
            "lora_learning",
            title="LoRA vs full fine-tuning on the default task",
            command="python " + " ".join(sys.argv),
            table=text,
            data={"arms": {a: ARMS[a] for a in cells}, "steps": args.steps, "cells": cells},
        )
        print(f"results page: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
