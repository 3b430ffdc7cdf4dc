"""The paper's staleness ablation on this machine: naive PPO against the decoupled objective
as the staleness bound eta grows (AReaL, arXiv 2505.24298, Table 2: naive PPO falls to 23.3
AIME24 at eta=4 where the decoupled objective keeps 42.2).

    python bench/ablation.py [--seeds 3] [--steps N] [--etas 0 1 2 4 8 unbounded]
                             [--columns naive recompute loglinear] [--quick] [key=value ...]

Rows are eta (`staleness.eta`; 'unbounded' is eta = steps, which never binds within a run);
columns are the PPO anchor (`trainer.ppo.prox_logp`): 'naive' clips around the behaviour
policy (no proximal policy), 'recompute' is the decoupled objective with a recomputed
proximal policy, 'loglinear' the decoupled objective with its log-linear approximation.
Each cell is a real training run per seed (the controller, rollout, reward and trainer
processes), scored by held-out pass@1 after the last step, alone on the final weights
(sampled as `SETTING` says); a cell shows the mean over seeds and its 95% Student t-interval (areal.intervals),
the mean training time, and the realised staleness (trained version - oldest token version)
of every trained trajectory, summed over steps and seeds; then the mechanism of each cell
(bench/learning_runs.py: the step's policy movement, the behaviour weights, what the clip
and the cap did, the gradient norm; means over steps, then seeds).

Every cell starts from the same warm-started model (built once with `seed=1`); the run seed
changes sampling, data order and the trainer's randomness. The setting (`SETTING`) is chosen
so that staleness matters here; its docstring says why. `--quick` runs a few short cells
with one seed for smoke tests (numbers meaningless). Results: table.txt, cells.json and
ablation.png under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import uvloop

from areal.intervals import MeanInterval, t_interval
from learning_runs import mechanism_table, run_training, staleness_line, warm_model

sys.path.insert(0, str(Path(__file__).parent))
from results_page import publish, write_results

DEFAULT_OUT = Path("bench/results/ablation")

COLUMNS = {
    "naive": "naive PPO",
    "recompute": "decoupled, recomputed prox",
    "loglinear": "decoupled, log-linear prox",
}
PROX_LOGP = {"naive": "behav", "recompute": "recompute", "loglinear": "loglinear"}
ETAS = ("0", "1", "2", "4", "8", "unbounded")

SETTING = [
    "trainer.lr=3e-4",
    "trainer.num_minibatches=2",
    "rollout.num_workers=3",
    "eval.temperature=1.0",
    "eval.num_samples=4",
    "trainer.measure_movement=true",
]
"""Overrides of every cell: the embedded model and arithmetic task of the default run, with

- lr 3e-4 (3x the default) and 2 PPO minibatches per step: the policy moves enough per
  version (approx. KL 0.01-0.04, 2-8 % of tokens clipped at eta=0) that data eta versions
  old is far from it; at the default lr 1e-4 with one minibatch the importance weights stay
  within 2 % of 1 and no anchor differs from another (measured: clip fraction 0). At lr 1e-3
  every column collapsed, eta=0 included; at 2e-4 every cell tried learned equally well;
- 3 rollout workers for 1 trainer: generation outruns training, so the buffer is full and
  realised staleness reaches eta deterministically (with 1 rollout worker this machine is
  generation-bound and staleness stays near 2 whatever eta). Interruption stays on;
- held-out pass@1 sampled at the training temperature, 4 samples on each of 256 problems:
  greedy decoding of this model is nearly binary (it answers at once or writes the trace),
  so greedy pass@1 jumps between ~0.3 and ~0.9 from one run to the next;
- the step's policy movement measured (trainer.measure_movement: two no-grad forwards per
  step for every column, so the columns' trainers do the same work)."""
STEPS = 20
QUICK_CELLS = [("0", "naive"), ("2", "recompute")]
"""--quick: two rows and two columns in two cells, run at once, one seed, 3 steps."""
QUICK = [
    "trainer.batch_size=16",
    "task.group_size=4",
    "eval.max_prompts=16",
    "rollout.max_new_tokens=32",
    "model.warmstart.steps=40",
    "rollout.num_workers=1",
]
"""--quick: small batches, a short warm start and a small held-out set; a smoke test only."""


def _cell_overrides(
    args: argparse.Namespace, model_dir: Path, eta: str, column: str, seed: int
) -> list[str]:
    eta_value = args.steps if eta == "unbounded" else int(eta)
    run_dir = args.out / "runs" / f"eta{eta}-{column}-seed{seed}"
    return [
        *args.setting,
        f"model.path={model_dir}",
        f"seed={seed}",
        f"staleness.eta={eta_value}",
        f"trainer.ppo.prox_logp={PROX_LOGP[column]}",
        f"trainer.total_steps={args.steps}",
        "eval.every_steps=0",
        f"run_dir={run_dir}",
        "trainer.checkpoint_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *args.overrides,
    ]


def run_all(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    """{eta: {column: [result per seed]}}; results already in cells.json are reused."""
    cells_path = args.out / "cells.json"
    cells = json.loads(cells_path.read_text()) if args.resume and cells_path.exists() else {}
    model_dir = warm_model(args.setting, args.overrides)
    todo = []
    for eta, column in args.cells:
        done = cells.setdefault(eta, {}).setdefault(column, [])
        seeds = {r["seed"] for r in done}
        todo += [(eta, column, s) for s in range(1, args.seeds + 1) if s not in seeds]
    uvloop.run(_run_cells(args, model_dir, todo, cells, cells_path))
    return cells


async def _run_cells(
    args: argparse.Namespace,
    model_dir: Path,
    todo: list[tuple[str, str, int]],
    cells: dict,
    cells_path: Path,
) -> None:
    """Run the (eta, column, seed) cells, `args.parallel` at a time; save after each."""
    slots = asyncio.Semaphore(args.parallel)

    async def one(eta: str, column: str, seed: int) -> None:
        async with slots:
            start = time.monotonic()
            result = await run_training(_cell_overrides(args, model_dir, eta, column, seed))
        result["seed"] = seed
        done = cells[eta][column]
        done.append(result)
        done.sort(key=lambda r: r["seed"])
        cells_path.write_text(json.dumps(cells, indent=1))
        print(
            f"eta={eta} {column} seed {seed}: pass@1 {result['pass@1']:.3f}, "
            f"staleness {result['staleness']}, {time.monotonic() - start:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    await asyncio.gather(*(one(*cell) for cell in todo))


def _interval(results: list[dict], key: str) -> MeanInterval:
    return t_interval([r[key] for r in results])


def table(cells: dict[str, dict[str, list[dict]]], columns: list[str]) -> str:
    width = 30
    head = f"{'eta':<10}" + "".join(f"{COLUMNS[c]:>{width}}" for c in columns)
    lines = [head, "-" * len(head)]
    for eta, row in cells.items():
        acc = [_interval(row[c], "pass@1").format() if row.get(c) else "" for c in columns]
        times = [
            f"train {_interval(row[c], 'train_time_s').mean:.0f} s" if row.get(c) else ""
            for c in columns
        ]
        lines.append(f"{eta:<10}" + "".join(f"{a:>{width}}" for a in acc))
        lines.append(f"{'':<10}" + "".join(f"{t:>{width}}" for t in times))
    seeds = sorted({len(r) for row in cells.values() for r in row.values()})
    lines.append(f"held-out pass@1 after training: mean [95% t-interval] over {seeds} seeds")
    lines += ["", "realised staleness (trained version - oldest token version): trajectories"]
    for eta, row in cells.items():
        for column in columns:
            if row.get(column):
                lines.append(f"  eta={eta:<9} {column:<9}  {staleness_line(row[column])}")
    lines += [
        "",
        "mechanism: means over steps, then seeds (train/... step-record keys)",
        mechanism_table(
            {
                f"eta={eta} {column}": row[column]
                for eta, row in cells.items()
                for column in columns
                if row.get(column)
            }
        ),
    ]
    return "\n".join(lines)


def plot(cells: dict[str, dict[str, list[dict]]], columns: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = list(cells)
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, column in enumerate(columns):
        xs, means, errors = [], [], [[], []]
        for i, eta in enumerate(etas):
            results = cells[eta].get(column)
            if not results:
                continue
            ci = _interval(results, "pass@1")
            xs.append(i + (offset - (len(columns) - 1) / 2) * 0.12)
            means.append(ci.mean)
            errors[0].append(0.0 if ci.n < 2 else ci.mean - ci.low)
            errors[1].append(0.0 if ci.n < 2 else ci.high - ci.mean)
            ax.scatter(
                [xs[-1]] * len(results),
                [r["pass@1"] for r in results],
                s=8,
                alpha=0.4,
                color=f"C{offset}",
            )
        ax.errorbar(
            xs, means, yerr=errors, marker="o", capsize=3, label=COLUMNS[column], color=f"C{offset}"
        )
    ax.set_xticks(range(len(etas)), etas)
    ax.set(
        xlabel="staleness bound eta",
        ylabel="held-out pass@1 after training",
        title="staleness ablation: mean and 95% t-interval over seeds",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs (seeds 1..N) per cell")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    parser.add_argument("--etas", nargs="+", default=list(ETAS), choices=ETAS)
    parser.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: two cells (eta 0 naive, eta 2 recompute) at once, 1 seed, 3 steps",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="cells run at once (their training times then share the CPU)",
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
        help=f"results folder (default {DEFAULT_OUT}; only a full run there "
        "writes the docs' results page, docs/results/ablation.md)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args(argv)
    args.publish = publish(args.quick, args.out) and not args.overrides
    args.out = args.out or DEFAULT_OUT
    args.setting = list(SETTING)
    args.cells = [(eta, column) for eta in args.etas for column in args.columns]
    if args.quick:
        args.seeds, args.steps, args.parallel = 1, 3, len(QUICK_CELLS)
        args.cells, args.columns = QUICK_CELLS, ["naive", "recompute"]
        args.setting += QUICK
    if min(args.seeds, args.steps, args.parallel) < 1:
        parser.error("--seeds, --steps and --parallel must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cells = run_all(args)
    text = table(cells, args.columns)
    print(text)
    (args.out / "table.txt").write_text(text + "\n")
    plot(cells, args.columns, args.out / "ablation.png")
    print(f"plot: {args.out / 'ablation.png'}")
    if args.publish:
        page = write_results(
            "ablation",
            title="Staleness ablation: naive PPO against decoupled PPO (bench/ablation.py)",
            command=" ".join(
                ["python", *(sys.argv if argv is None else ["bench/ablation.py", *argv])]
            ),
            table=text,
            data={
                "setting": args.setting,
                "seeds": args.seeds,
                "steps": args.steps,
                "cells": cells,
            },
            notes="Rows: staleness.eta (admission bound); columns: the PPO anchor "
            "(trainer.ppo.prox_logp). Each cell: held-out pass@1 after training, mean "
            "and 95% t-interval over seeds. The setting and why: the SETTING docstring "
            "of bench/ablation.py.",
        )
        print(f"results page: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
