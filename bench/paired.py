"""The two comparisons that decide the method on this machine, paired by seed (issue 32):

    (a) decoupled PPO vs naive PPO, both asynchronous at staleness bound eta (default 4):
        a two-sided paired t-test on final held-out pass@1;
    (b) asynchronous (eta, decoupled) vs synchronous: an equivalence test, two one-sided
        tests (TOST) with margin --margin (default 0.03, 3 points).

    python bench/paired.py [--seeds N] [--eta 4] [--steps 20] [--arms sync decoupled naive]
                           [--max-runs K] [--resume] [--quick] [--out DIR] [key=value ...]

Every arm runs once per seed 1..N, seed by seed. The same seed gives the arms the same warm
start (built once, seed 1), the same prompts in the same order and the same sampling stream
for each sample (per-request seeds, areal.seeds), so the per-seed difference removes what
they share. The table gives each arm's mean and 95% t-interval, each comparison's mean
difference with its interval (95% for (a), 90% for the TOST of (b)) and verdict, and the
power calculation from the measured spread of the differences: the seeds needed to detect a
--delta difference in (a) and to show equivalence within the margin in (b), and what the
seeds run can detect. It also prints the mechanism (areal.algorithms.movement and the
loss's clip statistics, means over steps and seeds) of every arm, and plots the training
reward (mean over seeds with its 95% band) and the per-seed differences.

Results are saved after every run (cells.json); --resume keeps them and runs what is missing,
--max-runs stops after K new runs (so a sweep can run in chunks, between other jobs, and
across sessions). A full run into the default --out writes the results page
docs/results/paired.md (bench/results_page.py). --quick: 2 arms, 1 seed, 3 short steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import uvloop

from areal.intervals import (
    detectable_difference,
    paired_t_test,
    provable_margin,
    seeds_for_difference,
    seeds_for_equivalence,
    t_interval,
    tost,
)
from learning_runs import mechanism_table, reward_band, run_training, staleness_line, warm_model
from results_page import publish, write_results

ARMS = {
    "sync": ["mode=sync", "trainer.ppo.prox_logp=recompute"],
    "decoupled": ["mode=async", "trainer.ppo.prox_logp=recompute"],
    "naive": ["mode=async", "trainer.ppo.prox_logp=behav"],
}
"""Each arm's overrides; the async arms get staleness.eta=--eta."""
SETTING = [
    "trainer.lr=1e-4",
    "trainer.num_minibatches=4",
    "rollout.num_workers=3",
    "eval.temperature=1.0",
    "eval.num_samples=4",
    "trainer.measure_movement=true",
]
"""The staleness ablation's setting (bench/ablation.py, SETTING: why workers and a sampled
evaluation) with the paper's 4 PPO minibatches per step at a third of the ablation's lr,
and the step's movement measured (1-2 no-grad forwards per step, the same two for every
arm). At the ablation's lr 3e-4 with 2 minibatches every arm overshoots and staleness costs
the decoupled arm most (docs/concepts/decoupled-ppo.md has both settings' numbers); pass
`trainer.lr=3e-4 trainer.num_minibatches=2` to run that one."""
STEPS = 20
QUICK = [
    "trainer.batch_size=16",
    "task.group_size=4",
    "eval.max_prompts=16",
    "rollout.max_new_tokens=32",
    "model.warmstart.steps=40",
    "rollout.num_workers=1",
]
"""--quick: small batches, a short warm start and a small held-out set; a smoke test only."""
DEFAULT_OUT = Path("bench/results/paired")


def _overrides(args: argparse.Namespace, model_dir: Path, arm: str, seed: int) -> list[str]:
    eta = [] if arm == "sync" else [f"staleness.eta={args.eta}"]
    return [
        *args.setting,
        *ARMS[arm],
        *eta,
        f"model.path={model_dir}",
        f"seed={seed}",
        f"trainer.total_steps={args.steps}",
        "eval.every_steps=0",
        f"run_dir={args.out / 'runs' / f'{arm}-seed{seed}'}",
        "trainer.checkpoint_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *args.overrides,
    ]


def run_missing(args: argparse.Namespace) -> dict[str, list[dict]]:
    """{arm: [result per seed]}; results in cells.json are kept (--resume)."""
    path = args.out / "cells.json"
    cells = json.loads(path.read_text()) if args.resume and path.exists() else {}
    model_dir = warm_model(args.setting, args.overrides)
    todo = [
        (arm, seed)
        for seed in range(1, args.seeds + 1)
        for arm in args.arms
        if seed not in {r["seed"] for r in cells.get(arm, [])}
    ]
    for arm, seed in todo[: args.max_runs]:
        start = time.monotonic()
        result = uvloop.run(run_training(_overrides(args, model_dir, arm, seed)))
        result["seed"] = seed
        cells.setdefault(arm, []).append(result)
        cells[arm].sort(key=lambda r: r["seed"])
        path.write_text(json.dumps(cells, indent=1))
        print(
            f"{arm} seed {seed}: pass@1 {result['pass@1_before']:.3f} -> {result['pass@1']:.3f}"
            f", {time.monotonic() - start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return cells


def _paired(cells: dict[str, list[dict]], a: str, b: str) -> tuple[list[float], list[float]]:
    """Final pass@1 of arms a and b on the seeds both have, in seed order."""
    by_seed = {arm: {r["seed"]: r["pass@1"] for r in cells.get(arm, [])} for arm in (a, b)}
    seeds = sorted(set(by_seed[a]) & set(by_seed[b]))
    return [by_seed[a][s] for s in seeds], [by_seed[b][s] for s in seeds]


def comparisons(cells: dict[str, list[dict]], margin: float, delta: float) -> list[dict]:
    """Each comparison's test, verdict and power calculation (plain data)."""
    out = []
    for a, b, kind in (("decoupled", "naive", "difference"), ("decoupled", "sync", "equivalence")):
        xa, xb = _paired(cells, a, b)
        entry = {"a": a, "b": b, "kind": kind, "seeds": len(xa)}
        if len(xa) >= 2:
            test = paired_t_test(xa, xb) if kind == "difference" else tost(xa, xb, margin)
            entry.update(
                mean=test.difference.mean,
                low=test.difference.low,
                high=test.difference.high,
                sd=test.sd,
                p=test.p_value,
                verdict=test.verdict,
                level="95%" if kind == "difference" else "90%",
            )
            if test.sd > 0:
                entry.update(
                    seeds_needed=(
                        seeds_for_difference(test.sd, delta)
                        if kind == "difference"
                        else seeds_for_equivalence(test.sd, margin)
                    ),
                    detectable=detectable_difference(test.sd, len(xa)),
                    provable_margin=provable_margin(test.sd, len(xa)),
                )
        out.append(entry)
    return out


def table(cells: dict[str, list[dict]], tests: list[dict], args: argparse.Namespace) -> str:
    head = f"{'arm':<10} {'seeds':>5} {'pass@1 before':>14} {'pass@1 after':>24} {'train s':>9}"
    lines = [head, "-" * len(head)]
    for arm in [a for a in ARMS if cells.get(a)]:
        results = cells[arm]
        after = t_interval([r["pass@1"] for r in results])
        before = sum(r["pass@1_before"] for r in results) / len(results)
        train_s = sum(r["train_time_s"] for r in results) / len(results)
        lines.append(
            f"{arm:<10} {len(results):>5} {before:>14.3f} {after.format():>24} {train_s:>9.0f}"
        )
    lines.append(
        f"held-out pass@1 after {args.steps} steps: mean [95% t-interval] over seeds; "
        f"async arms at eta={args.eta}"
    )
    lines += ["", "paired by seed (a - b):"]
    for t in tests:
        name = f"({'a' if t['kind'] == 'difference' else 'b'}) {t['a']} - {t['b']}"
        if "mean" not in t:
            lines.append(f"  {name}: {t['seeds']} paired seeds, too few")
            continue
        lines.append(
            f"  {name}: {t['mean']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}] "
            f"({t['level']}), sd {t['sd']:.3f}, {t['seeds']} seeds: {t['verdict']}"
        )
        if "seeds_needed" in t:
            goal = (
                f"detect a {args.delta:g} difference"
                if t["kind"] == "difference"
                else f"show equivalence within +-{args.margin:g} (true difference 0)"
            )
            lines.append(
                f"      power 0.8, alpha 0.05: {t['seeds_needed']} seeds to {goal}; "
                f"these {t['seeds']} detect {t['detectable']:.3f}, prove a margin of "
                f"{t['provable_margin']:.3f}"
            )
    lines += ["", "realised staleness (trained version - oldest token version): trajectories"]
    lines += [f"  {arm:<10} {staleness_line(cells[arm])}" for arm in ARMS if cells.get(arm)]
    lines += [
        "",
        "mechanism: means over steps, then seeds (train/... step-record keys)",
        mechanism_table({arm: cells[arm] for arm in ARMS if cells.get(arm)}),
    ]
    return "\n".join(lines)


def plot(cells: dict[str, list[dict]], tests: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, diffs) = plt.subplots(1, 2, figsize=(11, 4))
    for index, arm in enumerate(a for a in ARMS if cells.get(a)):
        steps, mean, low, high = reward_band(cells[arm])
        curve.plot(steps, mean, color=f"C{index}", label=f"{arm} ({len(cells[arm])} seeds)")
        curve.fill_between(steps, low, high, color=f"C{index}", alpha=0.2)
    curve.set(xlabel="training step", ylabel="training reward", title="mean over seeds, 95% band")
    curve.legend()
    for x, t in enumerate(tests):
        xa, xb = _paired(cells, t["a"], t["b"])
        per_seed = [p - q for p, q in zip(xa, xb, strict=True)]
        diffs.scatter([x] * len(per_seed), per_seed, s=10, alpha=0.5, color="gray")
        if "mean" in t:
            diffs.errorbar(
                [x],
                [t["mean"]],
                yerr=[[t["mean"] - t["low"]], [t["high"] - t["mean"]]],
                marker="o",
                capsize=4,
                color="C3",
            )
    diffs.axhline(0, color="black", lw=0.8)
    diffs.set_xticks(range(len(tests)), [f"{t['a']} - {t['b']}" for t in tests])
    diffs.set(
        ylabel="final pass@1 difference (per seed)", title="paired by seed: mean and interval"
    )
    for ax in (curve, diffs):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8, help="runs (seeds 1..N) per arm")
    parser.add_argument("--eta", type=int, default=4, help="staleness bound of the async arms")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--margin", type=float, default=0.03, help="equivalence margin of (b)")
    parser.add_argument(
        "--delta",
        type=float,
        default=0.05,
        help="difference (a) should detect, for the power calculation",
    )
    parser.add_argument(
        "--max-runs",
        type=int,
        default=10**6,
        help="stop after this many new runs (a chunk of a sweep)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the results already in --out/cells.json, run the rest",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: arms decoupled and naive, 1 seed, 3 short steps",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results directory (default {DEFAULT_OUT}; only that one publishes the results page)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args(argv)
    args.publish = publish(args.quick, args.out)
    args.out = args.out or DEFAULT_OUT
    args.setting = list(SETTING)
    if args.quick:
        args.seeds, args.steps, args.arms = 1, 3, ["decoupled", "naive"]
        args.setting += QUICK
    if min(args.seeds, args.steps, args.max_runs) < 1 or args.eta < 0:
        parser.error("--seeds, --steps and --max-runs must be >= 1, --eta >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cells = run_missing(args)
    tests = comparisons(cells, args.margin, args.delta)
    text = table(cells, tests, args)
    print(text)
    (args.out / "table.txt").write_text(text + "\n")
    (args.out / "tests.json").write_text(json.dumps(tests, indent=1))
    plot(cells, tests, args.out / "paired.png")
    print(f"plot: {args.out / 'paired.png'}")
    if args.publish:
        command = "python bench/paired.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_results(
            "paired",
            title="Decoupled vs naive PPO, async vs sync: paired by seed",
            command=command.strip(),
            table=text,
            data={
                "tests": tests,
                "per_seed": {
                    arm: [{k: r[k] for k in r if k != "per_step"} for r in results]
                    for arm, results in cells.items()
                },
            },
            notes="Setting, power calculation and reading: "
            "[decoupled PPO](../concepts/decoupled-ppo.md).",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
