"""Synchronous vs asynchronous RL on the same machine, model, task and number of samples.

    python bench/speedup.py [--seeds N] [--steps N] [--eta E] [--modes sync async strict]
                            [--target ACC] [--out DIR] [key=value ...]

All runs use the same code (the synchronous baseline is `mode=sync`: eta = 0, the whole
batch is generated before training, no interruption; `strict` is async with
`staleness.strict=true`), the same warm-started model (built once with seed 1), the same
long-tailed task setting (completion lengths from a power law, as reasoning traces have) and
the same `steps x batch_size` samples. Each mode runs once per seed (1..N; the seed changes
sampling, data order and the trainer's randomness), one after the other. Prints, for each
mode, the effective training throughput (trained tokens per second of training wall time),
the held-out accuracy at the end and the training time to reach a target accuracy, each as
the mean and 95% Student t-interval over seeds (areal.intervals), and the ratio of each
mode's throughput to sync's (per seed, then the interval); saves a plot of held-out
accuracy and reward against wall time. Extra key=value overrides apply to every run.

Held-out accuracy is measured after each run, on the weight versions it published
(every `--eval-every` steps, greedy, `areal.eval`), not during it: evaluation requests
would share the rollout worker with training generation and slow the two modes unequally
(with 256 held-out prompts every 5 steps, async loses far more of its training throughput
than sync), so the timed runs carry training traffic only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from areal.config import load_config
from areal.controller import Controller
from areal.intervals import t_interval
from areal.models.warmstart import ensure_warm_model
from areal.tasks.arithmetic import ArithmeticTask

sys.path.insert(0, str(Path(__file__).parent))
from results_page import publish, write_results

DEFAULT_OUT = Path("bench/results/speedup")

LONG_TAIL = {key: ArithmeticTask.long_tail().params()[key] for key in ("min_k", "max_k", "k_alpha")}
LONG_TAIL_TASK = [
    *(f"task.params.{key}={value}" for key, value in LONG_TAIL.items()),
    "rollout.max_new_tokens=384",
]
"""The arithmetic task with a long tail of trace lengths (ArithmeticTask.long_tail(): most
completions short, a few ~15x longer), and a token budget that fits the longest."""


MODES = {
    "sync": ["mode=sync"],
    "async": ["mode=async"],
    "strict": ["mode=async", "staleness.strict=true"],
}


def _overrides(
    args: argparse.Namespace, model_dir: Path, run_dir: Path, mode: str, seed: int
) -> list[str]:
    return [
        *LONG_TAIL_TASK,
        *MODES[mode],
        f"model.path={model_dir}",
        f"seed={seed}",
        f"staleness.eta={args.eta}",
        f"trainer.total_steps={args.steps}",
        "eval.every_steps=0",
        f"weight_sync.keep_versions={args.steps + 1}",
        f"run_dir={run_dir}",
        "logging.progress=false",
        "logging.tensorboard=false",
        *args.overrides,
    ]


def _warm_model(args: argparse.Namespace) -> Path:
    """The warm-started model every run starts from (the run seed does not change it)."""
    cfg = load_config(overrides=[*LONG_TAIL_TASK, "seed=1", *args.overrides])
    return ensure_warm_model(cfg) if cfg.model.path is None else Path(cfg.model.path)


async def _run(overrides: list[str]) -> tuple[dict, list[dict]]:
    """One real run from scratch (a run directory a previous bench left is removed first: a
    new run refuses one that holds another run); its summary and step and eval records."""
    cfg = load_config(overrides=overrides)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    ctl = Controller(cfg)
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
            record = evaluate(
                load_config(run_dir / "config.yaml", [f"model.path={tmp}"]), step=version
            ).record
        record.update(kind="eval", version=version, **{"perf/train_elapsed_s": stamps[version]})
        print(
            f"  {run_dir.name} version {version}: pass@1 {record['eval/pass@1']:.3f}",
            file=sys.stderr,
            flush=True,
        )
        records.append(record)
    return records


def _time_to_target(records: list[dict], target: float) -> float | None:
    for r in records:
        if r["kind"] == "eval" and r["eval/pass@1"] >= target:
            return r["perf/train_elapsed_s"]
    return None


Runs = dict[str, list[tuple[dict, list[dict]]]]
"""Per mode, per seed: (summary, step and eval records sorted by training time)."""


def _table(results: Runs, target: float) -> str:
    reach_head = "s to " + format(target, ".0%")
    head = (
        f"{'mode':<6} {'seeds':>5} {'steps':>5} {'trained tok':>11} {'train s':>22} "
        f"{'tok/s':>20} {'pass@1 end':>22} {reach_head:>22}"
    )
    lines = [head, "-" * len(head)]
    for mode, runs in results.items():
        summaries = [summary for summary, _ in runs]
        reached = [_time_to_target(records, target) for _, records in runs]
        reach = (
            "n/a"
            if not any(r["kind"] == "eval" and r["version"] > 0 for r in runs[0][1])
            else "never"
            if None in reached
            else t_interval(reached).format(1)
        )
        lines.append(
            f"{mode:<6} {len(runs):>5} {summaries[0]['steps']:>5} "
            f"{round(sum(s['trained_tokens'] for s in summaries) / len(runs)):>11} "
            f"{t_interval([s['train_time_s'] for s in summaries]).format(1):>22} "
            f"{t_interval([s['trained_tokens_per_s'] for s in summaries]).format(0):>20} "
            f"{t_interval([s['eval_pass@1_after'] for s in summaries]).format():>22} "
            f"{reach:>22}"
        )
    before = {s["eval_pass@1_before"] for runs in results.values() for s, _ in runs}
    lines.append(
        f"mean [95% t-interval] over seeds; held-out pass@1 before training: "
        f"{', '.join(f'{b:.3f}' for b in sorted(before))}"
    )
    if "sync" in results:
        sync = [s["trained_tokens_per_s"] for s, _ in results["sync"]]
        for mode, runs in results.items():
            if mode != "sync":
                ratios = [
                    s["trained_tokens_per_s"] / base
                    for (s, _), base in zip(runs, sync, strict=True)
                ]
                lines.append(
                    f"{mode} / sync effective training throughput (per seed): "
                    f"{t_interval(ratios).format(2)}x"
                )
    return "\n".join(lines)


def _mean_band(series: list[list[tuple[float, float]]]) -> tuple[list[float], ...]:
    """Per index (step or evaluation), over seeds: mean x, mean y and the 95% t-interval of
    y; indices that not every seed has are left out."""
    num = min(len(s) for s in series)
    xs, mean, low, high = [], [], [], []
    for i in range(num):
        ci = t_interval([s[i][1] for s in series])
        xs.append(sum(s[i][0] for s in series) / len(series))
        mean.append(ci.mean)
        low.append(ci.low if ci.n > 1 else ci.mean)
        high.append(ci.high if ci.n > 1 else ci.mean)
    return xs, mean, low, high


def _plot(results: Runs, path: Path) -> Any:
    """(The figure of) each mode's mean over seeds with its 95% band: training reward
    against training wall time, and held-out accuracy against it when versions were
    evaluated (--eval-every > 0), else held-out accuracy before and after training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(11, 4))
    curves = any(
        r["kind"] == "eval" and r["version"] > 0
        for runs in results.values()
        for _, records in runs
        for r in records
    )
    for index, (mode, runs) in enumerate(results.items()):
        color, label = f"C{index}", f"{mode} ({len(runs)} seeds)"
        steps = [
            [
                (r["perf/train_elapsed_s"], r["rollout/reward_mean"])
                for r in records
                if r["kind"] == "step"
            ]
            for _, records in runs
        ]
        xs, mean, low, high = _mean_band(steps)
        rew.plot(xs, mean, color=color, label=label)
        rew.fill_between(xs, low, high, color=color, alpha=0.2)
        if curves:
            evals = [
                [
                    (r["perf/train_elapsed_s"], r["eval/pass@1"])
                    for r in records
                    if r["kind"] == "eval"
                ]
                for _, records in runs
            ]
            xs, mean, low, high = _mean_band(evals)
            acc.plot(xs, mean, marker="o", ms=3, color=color, label=label)
            acc.fill_between(xs, low, high, color=color, alpha=0.2)
            continue
        for offset, key in enumerate(("eval_pass@1_before", "eval_pass@1_after")):
            ci = t_interval([summary[key] for summary, _ in runs])
            error = [[ci.mean - ci.low], [ci.high - ci.mean]] if ci.n > 1 else None
            acc.bar(
                offset + (index - (len(results) - 1) / 2) * 0.35,
                ci.mean,
                width=0.35,
                yerr=error,
                capsize=4,
                color=color,
                label=label if offset else None,
            )
    if curves:
        acc.set(
            xlabel="training wall time (s)",
            ylabel="held-out pass@1",
            title="accuracy: mean over seeds, 95% band",
        )
    else:
        acc.set_xticks([0, 1], ["before training", "after training"])
        acc.set(ylabel="held-out pass@1", title="accuracy: mean over seeds, 95% interval")
    rew.set(
        xlabel="training wall time (s)",
        ylabel="mean reward",
        title="training reward: mean over seeds, 95% band",
    )
    for ax in (acc, rew):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def _run_and_evaluate(
    args: argparse.Namespace, model_dir: Path, mode: str, seed: int
) -> tuple[dict, list[dict]]:
    """One timed run, then the held-out accuracy of its published versions."""
    run_dir = args.out / (mode if args.seeds == 1 else f"{mode}-seed{seed}")
    start = time.monotonic()
    summary, records = uvloop.run(_run(_overrides(args, model_dir, run_dir, mode, seed)))
    print(f"{mode} seed {seed} run finished in {time.monotonic() - start:.0f} s", file=sys.stderr)
    before = [r for r in records if r["kind"] == "eval"][:1]  # version 0, before training
    steps = [r for r in records if r["kind"] == "step"]
    if args.eval_every > 0:
        before += _evaluate_versions(run_dir, steps, args.eval_every)
    records = steps + before
    return summary, sorted(records, key=lambda r: r["perf/train_elapsed_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1, help="runs (seeds 1..N) per mode")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "async"],
        choices=list(MODES),
        help="strict: async with staleness.strict=true",
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    parser.add_argument("--eta", type=int, default=2, help="staleness bound of the async run")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=5,
        help="held-out eval interval (after the runs, for the time to the "
        "target); 0: none, the table then has only the final accuracy",
    )
    parser.add_argument("--target", type=float, default=0.6, help="held-out pass@1 target")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results folder (default {DEFAULT_OUT}; only a run there writes "
        "the docs' results page, docs/results/speedup.md)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value applied to both runs")
    args = parser.parse_args()
    if args.seeds < 1 or args.eval_every < 0:
        parser.error("--seeds must be >= 1 and --eval-every >= 0")
    page = publish(quick=False, out=args.out) and not args.overrides
    args.out = args.out or DEFAULT_OUT
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = _warm_model(args)
    results: Runs = {mode: [] for mode in args.modes}
    for seed in range(1, args.seeds + 1):
        for mode in args.modes:
            results[mode].append(_run_and_evaluate(args, model_dir, mode, seed))
    table = _table(results, args.target)
    print(table)
    (args.out / "table.txt").write_text(table + "\n")
    summaries = {m: [summary for summary, _ in runs] for m, runs in results.items()}
    (args.out / "summaries.json").write_text(json.dumps(summaries, indent=2))
    if page:
        written = write_results(
            "speedup",
            title="Synchronous vs asynchronous training (bench/speedup.py)",
            command=" ".join(["python", *sys.argv]),
            table=table,
            data={"args": {k: str(v) for k, v in vars(args).items()}, "summaries": summaries},
            notes="Both modes run the same task and model on the same machine; the ratio is "
            "of effective training throughput (trained tokens per second).",
        )
        print(f"results page: {written}")
    _plot(results, args.out / "speedup.png")
    print(f"plot: {args.out / 'speedup.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
