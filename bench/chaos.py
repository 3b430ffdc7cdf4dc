"""A training run under a schedule of faults: nothing lost, nothing trained twice, no hang.

    python bench/chaos.py [--seed 1] [--faults 24] [--quick] [--out bench/results/chaos]
                          [key=value ...]

Runs `python -m areal.controller` in the default configuration (the embedded model on the
arithmetic task, disk weights, a checkpoint every 10 steps; heartbeats every 0.5 s and a
worker silent for 8 s declared lost, so that a frozen worker costs seconds, not the default
30) and injects `--faults` faults, drawn from the seed, one at a time (bench/chaos_faults.py):
kill -9 of the rollout, reward and trainer workers, SIGSTOP of each past the heartbeat
timeout, a weight version deleted under the rollout worker, and kill -9 of the controller
followed by `--resume`. After each it waits until the run shows it repaired the fault (the
worker lost and back, the trainer restored, the failed load reported, the run resumed) and
trained a step; no progress within --deadline seconds is a hang. After the last fault the
run trains --final-steps more steps and is stopped with SIGTERM (it finishes the step,
evaluates and writes its summary), and the run's own records (metrics.jsonl, read as
areal.records does, and summary.json) are checked:

- every prompt group drawn was trained exactly once, dropped for a counted reason, or still
  in flight at the end: the draw positions of the step records and the summary (lost = 0,
  duplicated = 0);
- every step number was trained once (the steps a resume superseded set aside);
- held-out accuracy rose (greedy pass@1, before -> after, 95% Wilson intervals).

Prints one table; exits 1 if a check fails. `--quick` (the test suite): 4 faults (kill -9
of the reward worker, of the trainer and of the controller, SIGSTOP of the rollout worker)
on a smaller run (batch 16, a checkpoint every 4 steps, 32 held-out problems, 2 final
steps); held-out accuracy is reported, not required, there. With `reward.num_workers=0`
(the rollout workers score their own completions) the reward worker's faults are left out
of the schedule: there is none.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chaos_faults import KINDS, Fault, Hang, RunUnderTest
from results_page import publish, write_results

from areal.intervals import proportion_interval
from areal.records import read_records

LABELS = {
    "kill_rollout": "kill -9 rollout",
    "kill_reward": "kill -9 reward",
    "kill_trainer": "kill -9 trainer",
    "stop_rollout": "SIGSTOP rollout",
    "stop_reward": "SIGSTOP reward",
    "stop_trainer": "SIGSTOP trainer",
    "weight_load": "failed weight load",
    "kill_controller": "kill -9 controller",
}
QUICK_KINDS = ("kill_reward", "kill_trainer", "stop_rollout", "kill_controller")
"""--quick (the test suite): the suite tests kill -9 of a rollout worker
(tests/controller/test_runtime.py) and failed weight loads (test_weight_load_failure.py)
on their own."""
STOPPED = 128 + signal.SIGTERM
"""The controller's exit code after SIGTERM: the run stopped after its step, in order."""


def schedule(num_faults: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """`num_faults` kinds, each kind as often as the others (+-1), in a seeded order."""
    plan = [kinds[i % len(kinds)] for i in range(num_faults)]
    random.Random(seed).shuffle(plan)
    return plan


def fault_kinds(quick: bool, settings: dict[str, str]) -> tuple[str, ...]:
    """The kinds of fault a run of `settings` (its key=value options) is given: with
    reward.num_workers=0 (the rollout workers score) there is no reward worker to hurt."""
    kinds = QUICK_KINDS if quick else KINDS
    if settings.get("reward.num_workers") == "0":
        kinds = tuple(kind for kind in kinds if not kind.endswith("_reward"))
    return kinds


def overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    base = [
        f"run_dir={run_dir}",
        f"seed={args.seed}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "controller.heartbeat_interval_s=0.5",
    ]
    if args.quick:
        return [
            *base,
            "trainer.batch_size=16",
            "trainer.total_steps=100000",
            "trainer.checkpoint_every=4",
            "eval.max_prompts=32",
            "eval.every_steps=0",
            "controller.heartbeat_timeout_s=8",
            *args.overrides,
        ]
    return [
        *base,
        "trainer.batch_size=64",
        "trainer.total_steps=100000",
        "controller.heartbeat_timeout_s=8",
        *args.overrides,
    ]


def run_chaos(args: argparse.Namespace, run_dir: Path, log: Path) -> tuple[list[Fault], int]:
    """Inject the scheduled faults into one run; (the faults, the controller's exit code)."""
    settings = dict(o.split("=", 1) for o in overrides(args, run_dir))
    run = RunUnderTest(
        run_dir=run_dir,
        overrides=overrides(args, run_dir),
        log=log,
        deadline_s=args.deadline,
        heartbeat_timeout_s=float(settings["controller.heartbeat_timeout_s"]),
        batch_size=int(settings["trainer.batch_size"]),
    )
    rng = random.Random(args.seed)
    kinds = fault_kinds(args.quick, settings)
    faults = [Fault(kind=kind) for kind in schedule(args.faults, args.seed, kinds)]
    run.start()
    try:
        for fault in faults:
            run.wait_steps(rng.randint(1, 3))
            if fault.kind == "kill_controller":  # it needs a checkpoint to resume from
                run.wait_for(lambda: run.find(0, event="checkpoint") is not None, "a checkpoint")
            print(f"  {time.strftime('%H:%M:%S')} {LABELS[fault.kind]}", flush=True)
            try:
                run.inject(fault)
            except Hang as hang:
                fault.detail = f"HANG: {hang}"
                return faults, -1
            print(f"    survived in {fault.recovery_s:.1f} s {fault.detail}", flush=True)
        run.wait_steps(args.final_steps)
        return faults, run.stop()
    finally:
        run.kill_all()


def check_records(run_dir: Path) -> dict:
    """What the run's records say: groups trained, dropped, in flight; lost; duplicated."""
    kept = read_records(run_dir)
    steps = [r for r in kept if r["kind"] == "step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = [p for r in steps for p in r["rollout/trained_positions"]]
    dropped = [p for r in steps for p in r["rollout/dropped_positions"]]
    dropped += summary["rollout/dropped_positions"]
    untrained = summary["untrained_positions"]
    seen = collections.Counter(trained + dropped + untrained)
    evals = [r for r in kept if r["kind"] == "eval"]
    return {
        "steps": [r["step"] for r in steps],
        "drawn": summary["num_drawn"],
        "trained": len(trained),
        "dropped": len(dropped),
        "untrained": len(untrained),
        "dropped_reasons": summary["dropped_groups"],
        "lost": len(set(range(summary["num_drawn"])) - set(seen)),
        "duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "before": summary["eval_pass@1_before"],
        "after": summary["eval_pass@1_after"],
        "num_problems": int(evals[-1]["eval/num_problems"]) if evals else 0,
        "superseded_steps": sum(
            1
            for r in read_records(run_dir, superseded=True)
            if r["kind"] == "step" and r.get("superseded")
        ),
    }


def table(faults: list[Fault], done: dict, code: int, seed: int) -> str:
    by_kind: dict[str, list[Fault]] = collections.defaultdict(list)
    for fault in faults:
        by_kind[fault.kind].append(fault)
    head = f"{'fault':<22} {'injected':>8} {'survived':>8} {'recovery s mean':>15} {'max':>6}"
    lines = [head, "-" * len(head)]
    for kind in KINDS:
        group = by_kind.get(kind, [])
        times = [f.recovery_s for f in group if f.survived]
        lines.append(
            f"{LABELS[kind]:<22} {sum(f.injected for f in group):>8} "
            f"{sum(f.survived for f in group):>8} "
            f"{(sum(times) / len(times) if times else 0):>15.1f} "
            f"{max(times, default=0):>6.1f}"
        )
    lines.append(
        f"{'all':<22} {sum(f.injected for f in faults):>8} {sum(f.survived for f in faults):>8}"
    )
    lines.append("-" * len(head))
    hangs = sum(f.detail.startswith("HANG") for f in faults)
    n = done["num_problems"]
    lo0, hi0 = proportion_interval(done["before"] * n, n)
    lo1, hi1 = proportion_interval(done["after"] * n, n)
    lines += [
        f"seed {seed}; {len(done['steps'])} steps trained once each "
        f"({done['superseded_steps']} superseded by resumes and trained again); "
        f"controller exit code {code}",
        f"prompt groups: {done['drawn']} drawn = {done['trained']} trained + {done['dropped']} "
        f"dropped {done['dropped_reasons'] or ''} + {done['untrained']} in flight at the end; "
        f"lost {done['lost']}, duplicated {done['duplicated']}; hangs {hangs}",
        f"held-out pass@1 ({done['num_problems']} problems, 95% Wilson): "
        f"{done['before']:.3f} [{lo0:.3f}, {hi0:.3f}] -> {done['after']:.3f} "
        f"[{lo1:.3f}, {hi1:.3f}]",
    ]
    return "\n".join(lines)


def passed(faults: list[Fault], done: dict, code: int, quick: bool) -> bool:
    return (
        code == STOPPED
        and all(f.survived for f in faults)
        and done["lost"] == 0
        and done["duplicated"] == 0
        and done["steps"] == list(range(1, len(done["steps"]) + 1))
        and (quick or done["after"] > done["before"])
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=24)
    parser.add_argument(
        "--final-steps",
        type=int,
        default=10,
        help="steps trained after the last fault, before SIGTERM ends the run",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=600.0,
        help="seconds without progress after a fault that count as a hang",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default bench/results/chaos; only a full run "
        "there writes the docs' results page, docs/results/chaos.md)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    page = publish(args.quick, args.out) and not args.overrides
    args.out = args.out or Path("bench/results/chaos")
    if args.quick:
        args.faults, args.final_steps = len(QUICK_KINDS), 2
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        run_dir, log = Path(tmp) / "run", Path(tmp) / "controller.log"
        print(f"chaos: {args.faults} faults, seed {args.seed}; log {log}", flush=True)
        faults, code = run_chaos(args, run_dir, log)
        if code != STOPPED:
            print(log.read_text(errors="replace")[-6000:], file=sys.stderr)
            done = {
                "steps": [],
                "drawn": 0,
                "trained": 0,
                "dropped": 0,
                "untrained": 0,
                "dropped_reasons": {},
                "lost": -1,
                "duplicated": -1,
                "before": 0.0,
                "after": 0.0,
                "num_problems": 0,
                "superseded_steps": 0,
            }
        else:
            done = check_records(run_dir)
    text = table(faults, done, code, args.seed)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {
        "seed": args.seed,
        "overrides": args.overrides,
        "exit_code": code,
        "records": done,
        "faults": [vars(f) for f in faults],
    }
    (args.out / ("quick.json" if args.quick else "chaos.json")).write_text(
        json.dumps(data, indent=1)
    )
    ok = passed(faults, done, code, args.quick)
    print("chaos check: " + ("PASSED" if ok else "FAILED"))
    if page:
        print(
            "results page: "
            + str(
                write_results(
                    "chaos",
                    title="Faults injected into one run (bench/chaos.py)",
                    command=" ".join(["python", *sys.argv]),
                    table=text,
                    data=data,
                    notes=f"Check: {'PASSED' if ok else 'FAILED'}. Recovery is the time from the fault "
                    "to the first step trained after the repair; every prompt group drawn must "
                    "be trained exactly once, dropped with a reason, or in flight at the end.",
                )
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
