"""Synchronous vs asynchronous RL on the same machine, model, task and number of samples.

    python bench/speedup.py [--steps N] [--eta E] [--target ACC] [--out DIR] [key=value ...]

Both runs use the same code (the synchronous baseline is `mode=sync`: eta = 0, the whole
batch is generated before training, no interruption), the same warm-started model, the same
long-tailed task setting (completion lengths from a power law, as reasoning traces have) and
the same `steps x batch_size` samples. Prints, for each mode, the effective training
throughput (trained tokens per second of training wall time) and their ratio, and the
training time to reach a target held-out accuracy; saves a plot of held-out accuracy and
reward against wall time. Extra key=value overrides apply to both runs.

Held-out accuracy is measured after each run, on the weight versions it published
(every `--eval-every` steps, greedy, `areal.eval`), not during it: evaluation requests
would share the rollout worker with training generation and slow the two modes unequally
(measured here: with 256 held-out prompts every 5 steps, async lost 59% of its training
throughput and sync 26%), so the timed runs carry training traffic only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from areal.config import load_config
from areal.controller import Controller
from areal.tasks.arithmetic import ArithmeticTask

LONG_TAIL = {key: ArithmeticTask.long_tail().params()[key] for key in ("min_k", "max_k", "k_alpha")}
LONG_TAIL_TASK = [*(f"task.params.{key}={value}" for key, value in LONG_TAIL.items()),
                  "rollout.max_new_tokens=384"]
"""The arithmetic task with a long tail of trace lengths (ArithmeticTask.long_tail(): most
completions short, a few ~15x longer), and a token budget that fits the longest."""


def _overrides(args: argparse.Namespace, out: Path, mode: str) -> list[str]:
    return [
        *LONG_TAIL_TASK,
        f"mode={mode}", f"staleness.eta={args.eta}", f"trainer.total_steps={args.steps}",
        "eval.every_steps=0", f"weight_sync.keep_versions={args.steps + 1}",
        f"run_dir={out / mode}",
        "logging.progress=false", "logging.tensorboard=false", *args.overrides,
    ]


async def _run(overrides: list[str]) -> tuple[dict, list[dict]]:
    ctl = Controller(load_config(overrides=overrides))
    run = asyncio.create_task(ctl.run())
    records = [r async for r in ctl.events() if r["kind"] in ("step", "eval")]
    return await run, records


def _evaluate_versions(run_dir: Path, step_records: list[dict], every: int) -> list[dict]:
    """Greedy held-out pass@1 of every `every`-th version a run published, each as an eval
    record stamped with the training time at which that version existed."""
    from areal.eval import evaluate
    from areal.workers.trainer.publish import version_dir

    base = Path(load_config(run_dir / "config.yaml").model.path).resolve()
    stamps = {r["version"]: r["perf/train_elapsed_s"] for r in step_records}
    records = []
    for version in sorted(v for v in stamps if v % every == 0):
        weights = (version_dir(run_dir, version) / "model.safetensors").resolve()
        with tempfile.TemporaryDirectory() as tmp:
            for item in base.iterdir():  # config and tokenizer of the run's model
                if item.name != "model.safetensors":
                    (Path(tmp) / item.name).symlink_to(item)
            (Path(tmp) / "model.safetensors").symlink_to(weights)
            record = evaluate(load_config(run_dir / "config.yaml", [f"model.path={tmp}"]),
                              step=version).record
        record.update(kind="eval", version=version, **{"perf/train_elapsed_s": stamps[version]})
        print(f"  {run_dir.name} version {version}: pass@1 {record['eval/pass@1']:.3f}",
              file=sys.stderr, flush=True)
        records.append(record)
    return records


def _time_to_target(records: list[dict], target: float) -> float | None:
    for r in records:
        if r["kind"] == "eval" and r["eval/pass@1"] >= target:
            return r["perf/train_elapsed_s"]
    return None


def _table(results: dict[str, tuple[dict, list[dict]]], target: float) -> str:
    head = (f"{'mode':<6} {'steps':>5} {'trained tok':>11} {'train s':>8} {'tok/s':>8} "
            f"{'pass@1 0->end':>14} {'s to ' + format(target, '.0%'):>9}")
    lines = [head, "-" * len(head)]
    for mode, (summary, records) in results.items():
        reach = _time_to_target(records, target)
        lines.append(
            f"{mode:<6} {summary['steps']:>5} {summary['trained_tokens']:>11} "
            f"{summary['train_time_s']:>8.1f} {summary['trained_tokens_per_s']:>8.0f} "
            f"{summary['eval_pass@1_before']:>6.3f}->{summary['eval_pass@1_after']:<6.3f} "
            f"{'never' if reach is None else format(reach, '.1f'):>9}")
    sync, async_ = results["sync"][0], results["async"][0]
    ratio = async_["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
    lines.append(f"async / sync effective training throughput: {ratio:.2f}x")
    reach_s = _time_to_target(results["sync"][1], target)
    reach_a = _time_to_target(results["async"][1], target)
    if reach_s is not None and reach_a is not None:
        lines.append(f"time to {target:.0%} held-out accuracy: sync / async = "
                     f"{reach_s / reach_a:.2f}x")
    return "\n".join(lines)


def _plot(results: dict[str, tuple[dict, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, (_, records) in results.items():
        evals = [r for r in records if r["kind"] == "eval"]
        steps = [r for r in records if r["kind"] == "step"]
        acc.plot([r["perf/train_elapsed_s"] for r in evals], [r["eval/pass@1"] for r in evals],
                 marker="o", label=mode)
        rew.plot([r["perf/train_elapsed_s"] for r in steps],
                 [r["rollout/reward_mean"] for r in steps], label=mode)
    acc.set(xlabel="training wall time (s)", ylabel="held-out pass@1", title="accuracy")
    rew.set(xlabel="training wall time (s)", ylabel="mean reward", title="training reward")
    for ax in (acc, rew):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    parser.add_argument("--eta", type=int, default=2, help="staleness bound of the async run")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out eval interval")
    parser.add_argument("--target", type=float, default=0.6, help="held-out pass@1 target")
    parser.add_argument("--out", type=Path, default=Path("bench/results/speedup"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to both runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in ("sync", "async"):
        start = time.monotonic()
        summary, records = uvloop.run(_run(_overrides(args, args.out, mode)))
        print(f"{mode} run finished in {time.monotonic() - start:.0f} s", file=sys.stderr)
        before = [r for r in records if r["kind"] == "eval"][:1]  # version 0, before training
        steps = [r for r in records if r["kind"] == "step"]
        records = steps + before + _evaluate_versions(args.out / mode, steps, args.eval_every)
        results[mode] = (summary, sorted(records, key=lambda r: r["perf/train_elapsed_s"]))
    table = _table(results, args.target)
    print(table)
    (args.out / "table.txt").write_text(table + "\n")
    (args.out / "summaries.json").write_text(json.dumps({m: r[0] for m, r in results.items()},
                                                        indent=2))
    _plot(results, args.out / "speedup.png")
    print(f"plot: {args.out / 'speedup.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
