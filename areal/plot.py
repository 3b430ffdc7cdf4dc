"""`python -m areal.plot RUN_DIR [RUN_DIR ...]`: a run's curves from metrics.jsonl, as PNG.

    python -m areal.plot runs/x                  # -> runs/x/plots/{overview,reward,...}.png
    python -m areal.plot runs/sync runs/async --out cmp --x time   # runs overlaid

Panels (a panel is drawn when at least one run has one of its keys):

    reward         rollout/reward_mean, eval/reward_mean
    accuracy       rollout/accuracy (training samples), eval/pass@1 (held-out)
    staleness      staleness/mean, staleness/max
    throughput     perf/gen_tokens_per_s, perf/train_tokens_per_s, perf/trained_tokens_per_s
    interruptions  rollout/interruptions
    loss           train/loss
    length         rollout/completion_len_mean
    tool use       episode/tool_use_fraction, eval/tool_use_fraction, episode/tool_error_rate
    turns          episode/turns_mean, episode/tool_calls_mean (multi-turn episodes)
    episode tokens episode/model_tokens_mean, episode/observation_tokens_mean
    tool time      episode/tool_s_mean
    agent          episode/calls_mean, episode/segments_mean, episode/retries_coalesced
                   (agent episodes, agent.function)
    endpoint       episode/endpoint_queue_s_mean, episode/endpoint_decode_s_mean: seconds
                   per chat call before and in the engine
    drift          train/logprob_diff_{fresh,stale}: mean |log pi_prox - log pi_behav| on
                   tokens sampled by the proximal version (engine numerics) and older ones
    drift_max      train/logprob_diff_{fresh,stale}_max
    drift_kl       train/behav_kl_{fresh,stale}: k3 estimate of KL(pi_behav || pi_prox)
    corrections    fraction of tokens masked / clamped by the behaviour-weight bounds and
                   clipped by the surrogate, fresh and stale (areal.algorithms.drift)

The x axis is the training step (eval records are filed under the policy version they
evaluated, which is the step that produced it) or, with `--x time`, wall-clock seconds
(`perf/elapsed_s`; eval points then sit at the time of the step with the same number).
Standalone `areal.eval` records without a step are not drawn, nor are the records a
`--resume` superseded (areal.records). Rendering uses matplotlib's
Agg backend (no display). This module reads files and draws; it computes no metric.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal.records import read_records

PANELS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    # name: (y label, [(record kind, key, legend label)])
    "reward": (
        "mean reward",
        [
            ("step", "rollout/reward_mean", "train samples"),
            ("eval", "eval/reward_mean", "held-out"),
        ],
    ),
    "accuracy": (
        "accuracy",
        [("step", "rollout/accuracy", "train samples"), ("eval", "eval/pass@1", "held-out pass@1")],
    ),
    "staleness": (
        "policy versions behind",
        [("step", "staleness/mean", "mean"), ("step", "staleness/max", "max")],
    ),
    "throughput": (
        "tokens / s",
        [
            ("step", "perf/gen_tokens_per_s", "generated"),
            ("step", "perf/train_tokens_per_s", "trainer (in step)"),
            ("step", "perf/trained_tokens_per_s", "trained (end to end)"),
        ],
    ),
    "interruptions": ("interrupted sequences / step", [("step", "rollout/interruptions", "")]),
    "loss": ("loss", [("step", "train/loss", "")]),
    "length": ("completion tokens", [("step", "rollout/completion_len_mean", "mean")]),
    "tool_use": (
        "fraction",
        [
            ("step", "episode/tool_use_fraction", "episodes calling a tool"),
            ("eval", "eval/tool_use_fraction", "held-out, calling a tool"),
            ("step", "episode/tool_error_rate", "failed tool calls"),
        ],
    ),
    "turns": (
        "per episode",
        [
            ("step", "episode/turns_mean", "model turns"),
            ("step", "episode/tool_calls_mean", "tool calls"),
        ],
    ),
    "episode_tokens": (
        "tokens per episode",
        [
            ("step", "episode/model_tokens_mean", "model (trained)"),
            ("step", "episode/observation_tokens_mean", "observation (context only)"),
        ],
    ),
    "tool_time": ("seconds per episode", [("step", "episode/tool_s_mean", "environment")]),
    "agent": (
        "per agent episode",
        [
            ("step", "episode/calls_mean", "chat calls"),
            ("step", "episode/segments_mean", "training segments"),
            ("step", "episode/retries_coalesced", "retries coalesced (per step)"),
        ],
    ),
    "endpoint": (
        "seconds per chat call",
        [
            ("step", "episode/endpoint_queue_s_mean", "queueing (render, tokenize, weights)"),
            ("step", "episode/endpoint_decode_s_mean", "generation"),
        ],
    ),
    "drift": (
        "|log pi_prox - log pi_behav|",
        [
            ("step", "train/logprob_diff_fresh", "fresh tokens (engine numerics)"),
            ("step", "train/logprob_diff_stale", "stale tokens (+ policy change)"),
        ],
    ),
    "drift_max": (
        "max |log pi_prox - log pi_behav|",
        [
            ("step", "train/logprob_diff_fresh_max", "fresh"),
            ("step", "train/logprob_diff_stale_max", "stale"),
        ],
    ),
    "drift_kl": (
        "k3 KL(pi_behav || pi_prox)",
        [("step", "train/behav_kl_fresh", "fresh"), ("step", "train/behav_kl_stale", "stale")],
    ),
    "corrections": (
        "fraction of loss tokens",
        [
            ("step", f"train/{what}_frac_{split}", f"{what.replace('_', ' ')}, {split}")
            for what in ("behav_masked", "behav_clamped", "clipped")
            for split in ("fresh", "stale")
        ],
    ),
}


@dataclass
class Run:
    label: str
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]


def read_run(run_dir: Path) -> Run:
    """The step and eval records of `run_dir/metrics.jsonl`, without those a resume
    superseded (areal.records; a torn last line is ignored)."""
    steps, evals = [], []
    for record in read_records(run_dir):
        if record.get("kind") == "step" and "step" in record:
            steps.append(record)
        elif record.get("kind") == "eval" and "step" in record:
            evals.append(record)
    if not steps and not evals:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no step or eval records yet")
    return Run(label=run_dir.name, steps=steps, evals=evals)


def series(run: Run, kind: str, key: str, x_axis: str) -> tuple[list[float], list[float]]:
    """(x, y) of `key` in the run's records of `kind`, finite values only, by x."""
    records = run.steps if kind == "step" else run.evals
    time_of = {r["step"]: r.get("perf/elapsed_s") for r in run.steps}
    points = []
    for record in records:
        value = record.get(key)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            continue
        x = (
            record["step"]
            if x_axis == "step"
            else (0.0 if record["step"] == 0 else time_of.get(record["step"]))
        )
        if x is not None:
            points.append((float(x), float(value)))
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def draw_panel(ax: Any, name: str, runs: list[Run], x_axis: str) -> bool:
    """Draw one panel on `ax`; False when no run has any of its keys."""
    ylabel, lines = PANELS[name]
    drawn = False
    for run in runs:
        for kind, key, label in lines:
            xs, ys = series(run, kind, key, x_axis)
            if not xs:
                continue
            parts = [p for p in (run.label if len(runs) > 1 else "", label or key) if p]
            style = (
                dict(marker="o", linestyle="--")
                if kind == "eval"
                else dict(marker="." if len(xs) < 50 else None)
            )
            ax.plot(xs, ys, label=": ".join(parts), **style)
            drawn = True
    ax.set_title(name)
    ax.set_xlabel("training step" if x_axis == "step" else "wall-clock seconds")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize="small")
    return drawn


def plot_runs(run_dirs: list[Path], out_dir: Path, x_axis: str = "step") -> list[Path]:
    """Write overview.png and one PNG per drawable panel to `out_dir`; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(d) for d in run_dirs]
    out_dir.mkdir(parents=True, exist_ok=True)
    written, names = [], []
    for name in PANELS:
        fig, ax = plt.subplots(figsize=(6, 4))
        if draw_panel(ax, name, runs, x_axis):
            fig.tight_layout()
            fig.savefig(out_dir / f"{name}.png", dpi=100)
            written.append(out_dir / f"{name}.png")
            names.append(name)
        plt.close(fig)
    if not names:
        raise ValueError(f"no plottable metrics in {', '.join(map(str, run_dirs))}")
    cols = 2
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        draw_panel(ax, name, runs, x_axis)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(" vs ".join(r.label for r in runs))
    fig.tight_layout()
    fig.savefig(out_dir / "overview.png", dpi=100)
    plt.close(fig)
    return [out_dir / "overview.png", *written]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.plot", description="Training curves of runs, from metrics.jsonl."
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "--out",
        type=Path,
        help="output directory (default: RUN_DIR/plots for one run; required for several)",
    )
    parser.add_argument("--x", choices=("step", "time"), default="step", help="x axis")
    args = parser.parse_args(argv)
    if args.out is None and len(args.run_dirs) > 1:
        parser.error("--out is required when plotting several runs")
    out = args.out or args.run_dirs[0] / "plots"
    try:
        paths = plot_runs(args.run_dirs, out, args.x)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
