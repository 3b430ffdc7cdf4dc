"""The planner checked against real runs on this machine: does it rank configurations of
the CPU default job as they measure?

    python bench/plan_check.py [--steps N] [--seeds 1 2 ...] [--out DIR] [--max-runs K]
                               [--costs FILE]
    python bench/plan_check.py --quick        # the test suite's: 3 steps, two configurations

1. A probe: the default job (`python -m areal.controller`'s defaults: the embedded model,
   the arithmetic task, batch 8 x 8, 64 new tokens at most) with another seed (PROBE_SEED)
   and its batches saved, for the prompt and completion lengths the simulations replay
   (areal.sim.replay). Nothing else of it is used.
2. The planner (areal.sim.plan, accelerator `cpu-2core` as shipped in sim/costs.yaml or
   as fitted to this machine in --costs, model `tiny`) scores each configuration of CONFIGS
   (rollout workers, threads per worker, eta, sync or async) by its simulated effective
   training throughput, and runs its own search.
3. Each configuration runs for real, once per seed: the default job for `--steps` steps,
   held-out evaluation of EVAL_PROMPTS prompts at the start and the end only (periodic
   evaluations would share the rollout workers and are not what is compared). Its
   throughput: trained tokens per second from the end of step 1 to the end of the last
   (step 1 runs beside the first evaluation; bench/calibration.py's `after_first`).
4. Prints predicted against measured throughput, both rankings, Spearman's rank
   correlation, and whether the planner's first choice measured best; a full run into the
   default --out also writes docs/results/plan_check.md (bench/results_page.py).

Real runs take a minute each on 2 cores; results are kept in OUT/check.json as they come,
so that `--max-runs K` does K of them and stops (run it again to go on; each invocation can
hold the shared CPU lock on its own), and the table is printed once every run is done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).parent))

import speedup
from calibration import after_first
from results_page import publish, write_results

from areal.config import load_config
from areal.models.warmstart import ensure_warm_model
from areal.sim.plan import Candidate, Evaluator, load_plan_config
from areal.sim.search import search

PROBE_SEED = 9
"""The probe's seed: none of the compared runs' (1, 2, ...)."""
EVAL_PROMPTS = 16
DEFAULT_OUT = Path("bench/results/plan_check")


@dataclass(frozen=True)
class Config:
    name: str
    mode: str
    workers: int
    threads: int
    eta: int = 2

    def overrides(self) -> list[str]:
        return [
            f"mode={self.mode}",
            f"rollout.num_workers={self.workers}",
            f"rollout.threads={self.threads}",
            f"staleness.eta={self.eta}",
        ]

    def candidate(self) -> Candidate:
        if self.mode == "sync":
            return Candidate("sync", self.workers, self.threads, 1)
        return Candidate("async", self.workers, self.threads, 1, eta=self.eta)


CONFIGS = [
    Config("default (async, 1 worker)", "async", 1, 1),
    Config("async, 2 workers", "async", 2, 1),
    Config("async, 1 worker x 2 threads", "async", 1, 2),
    Config("async, eta 1", "async", 1, 1, eta=1),
    Config("async, eta 4", "async", 1, 1, eta=4),
    Config("sync, 1 worker", "sync", 1, 1),
    Config("sync, 2 workers", "sync", 2, 1),
]


def job_overrides(model_dir: Path, run_dir: Path, steps: int, seed: int) -> list[str]:
    """The default job, `steps` steps, evaluated only at its start and end."""
    return [
        f"model.path={model_dir}",
        f"seed={seed}",
        f"trainer.total_steps={steps}",
        "eval.every_steps=0",
        f"eval.max_prompts={EVAL_PROMPTS}",
        f"weight_sync.keep_versions={steps + 1}",
        f"run_dir={run_dir}",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]


def real_run(overrides: list[str]) -> tuple[float, int]:
    """(seconds, trained tokens) after step 1 of one real run."""
    _, records = uvloop.run(speedup._run(overrides))
    steps = [r for r in records if r["kind"] == "step"]
    return after_first(
        [r["perf/train_elapsed_s"] for r in steps], [r["perf/trained_tokens"] for r in steps]
    )


def plan_options(probe_dir: Path, steps: int, costs: Path | None = None) -> list[str]:
    cfg = load_config(probe_dir / "config.yaml")
    return [
        *([f"costs={costs}"] if costs is not None else []),
        "accelerator=cpu-2core",
        "model=tiny",
        "num_accelerators=2",
        f"num_prompts={cfg.trainer.batch_size // cfg.task.group_size}",
        f"group_size={cfg.task.group_size}",
        f"max_new_tokens={cfg.rollout.max_new_tokens}",
        f"num_minibatches={cfg.trainer.num_minibatches}",
        f"max_concurrent_per_worker={cfg.rollout.max_concurrent}",
        f"steps={steps}",
        "measure_from=1",
        "sync_steps=null",
        f"replay={probe_dir}",
        f"eval_prompts={EVAL_PROMPTS}",
        "eta_min=1",
        "eta_max=4",
        "jobs=1",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="results directory (only the default one publishes the results page)",
    )
    parser.add_argument(
        "--max-runs", type=int, default=None, help="real runs to do in this invocation, then stop"
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 steps, two configurations, one seed (a smoke test)"
    )
    parser.add_argument(
        "--costs",
        type=Path,
        default=None,
        help="cost parameters with a cpu-2core entry fitted to this machine (python "
        "bench/cluster.py --calibrate writes one to bench/results/calibration/costs-cpu.yaml); "
        "default: the shipped sim/costs.yaml",
    )
    args = parser.parse_args()
    if args.costs is not None and not args.costs.is_file():
        parser.error(f"--costs={args.costs}: no such file")
    configs = CONFIGS[:1] + CONFIGS[5:6] if args.quick else CONFIGS
    steps, seeds = (3, [1]) if args.quick else (args.steps, args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "check.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("steps", steps) != steps:
        parser.error(f"{state_path} holds runs of {state['steps']} steps; use another --out")
    state["steps"] = steps
    costs = str(args.costs) if args.costs else None
    if state.get("predicted") is not None and state.get("costs") != costs:
        parser.error(
            f"{state_path} holds predictions from costs={state.get('costs')}, not {costs}: "
            "use another --out (its real runs can be copied into it: check.json's 'measured')"
        )
    measured = state.setdefault("measured", {})
    model_dir = ensure_warm_model(load_config(overrides=["seed=1"]))
    probe_dir = args.out / "probe"
    runs_left = args.max_runs if args.max_runs is not None else 1 << 30

    def save() -> None:
        state_path.write_text(json.dumps(state, indent=1) + "\n")

    if not (probe_dir / "batches").is_dir():
        if runs_left <= 0:
            return 0
        start = time.monotonic()
        real_run(
            [*job_overrides(model_dir, probe_dir, steps, PROBE_SEED), "logging.save_batches=true"]
        )
        print(f"probe: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        runs_left -= 1
    if "predicted" not in state:
        state["predicted"], state["search"] = predict(probe_dir, steps, configs, args.costs)
        state["costs"] = costs
        save()
    for config in configs:
        for seed in seeds:
            key = f"{config.name} | seed {seed}"
            if key in measured:
                continue
            if runs_left <= 0:
                save()
                return 0
            start = time.monotonic()
            run_dir = args.out / f"run-{configs.index(config)}-seed{seed}"
            seconds, tokens = real_run(
                [*job_overrides(model_dir, run_dir, steps, seed), *config.overrides()]
            )
            measured[key] = {"seconds": seconds, "tokens": tokens}
            runs_left -= 1
            save()
            print(
                f"{key}: {tokens / seconds:.0f} tok/s ({time.monotonic() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    text = report(state, configs, seeds)
    print(text)
    (args.out / ("table-quick.txt" if args.quick else "table.txt")).write_text(text + "\n")
    if publish(args.quick, None if args.out == DEFAULT_OUT else args.out):
        page = write_results(
            "plan_check",
            title="The planner against real runs of the CPU default job",
            command="python " + " ".join(sys.argv),
            table=text,
            data={"configs": [asdict(c) for c in configs], "seeds": seeds, **state},
        )
        print(f"results page: {page}")
    return 0


def predict(
    probe_dir: Path, steps: int, configs: list[Config], costs: Path | None = None
) -> tuple[dict[str, float], dict[str, object]]:
    """The planner's throughput for each configuration, and its own search's first choice;
    `costs`: a cost parameter file instead of the shipped sim/costs.yaml."""
    plan = load_plan_config(overrides=plan_options(probe_dir, steps, costs))
    evaluator = Evaluator(plan)
    try:
        outcomes = evaluator.evaluate([c.candidate() for c in configs])
        planned = search(plan, evaluator)
    finally:
        evaluator.close()
    best = planned.best
    return (
        {c.name: o.trained_tokens_per_s for c, o in zip(configs, outcomes, strict=True)},
        {
            "first_choice": best.candidate.describe(),
            "tokens_per_s": best.trained_tokens_per_s,
            "simulations": sum(planned.stages),
            "candidate": asdict(best.candidate),
        },
    )


def report(state: dict, configs: list[Config], seeds: list[int]) -> str:
    predicted = state["predicted"]
    measured = {c.name: [state["measured"][f"{c.name} | seed {s}"] for s in seeds] for c in configs}
    tput = {
        name: statistics.mean(r["tokens"] / r["seconds"] for r in runs)
        for name, runs in measured.items()
    }
    by_predicted = sorted(predicted, key=lambda n: -predicted[n])
    by_measured = sorted(tput, key=lambda n: -tput[n])
    head = (
        f"{'configuration':<30} {'predicted tok/s':>15} {'measured tok/s':>15} "
        f"{'error':>7} {'rank pred':>9} {'rank meas':>9}"
    )
    rows = [head, "-" * len(head)]
    for c in configs:
        per_seed = ", ".join(f"{r['tokens'] / r['seconds']:.0f}" for r in measured[c.name])
        rows.append(
            f"{c.name:<30} {predicted[c.name]:>15.0f} {tput[c.name]:>15.0f} "
            f"{predicted[c.name] / tput[c.name] - 1:>+7.1%} "
            f"{by_predicted.index(c.name) + 1:>9} {by_measured.index(c.name) + 1:>9}"
            f"   (seeds: {per_seed})"
        )
    names = [c.name for c in configs]
    rho = (
        spearmanr([predicted[n] for n in names], [tput[n] for n in names]).statistic
        if len(names) > 2
        else float("nan")
    )
    first = by_predicted[0]
    rows.append(
        f"Spearman's rank correlation, predicted vs measured: {rho:.2f}; the planner's "
        f"first choice among these, {first!r}, measured "
        f"{'best' if first == by_measured[0] else f'#{by_measured.index(first) + 1}'}"
    )
    search_ = state["search"]
    rows.append(
        f"(the planner's own search over {search_['simulations']} configurations "
        f"chose: {search_['first_choice']}, {search_['tokens_per_s']:.0f} tok/s "
        f"predicted; costs: {state.get('costs') or 'sim/costs.yaml'}; "
        f"the CPU default job, {state['steps']} steps, seeds "
        f"{', '.join(map(str, seeds))}; throughput after step 1)"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
