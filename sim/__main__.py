"""Ask the simulated cluster what a run would cost, or how best to run it.

    python -m areal.sim [--config FILE] [key=value ...]
    python -m areal.sim num_accelerators=256 accelerator=h100 model=7b mode=async eta=4
    python -m areal.sim --help
    python -m areal.sim plan [--config FILE] [key=value ...]      # areal.sim.plan
    python -m areal.sim plan num_accelerators=128 model=1.5b out=plan.yaml

A question runs the real controller on a simulated cluster (areal.sim.run.simulate) and
prints the steady-state step time, the hours of `report_steps` steps, the effective training
throughput (trained tokens per second), staleness and interruptions, and the controller's
own CPU cost. `plan` searches placements, eta and interruption by such simulations
(areal.sim.search), prints the best configurations beside synchronous colocated on the same
accelerators and writes the winner as a run config file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from areal.config import ConfigError, describe_options

from areal.sim.config import SimConfig, load_sim_config
from areal.sim.run import SimResult, simulate


def describe(schema: type = SimConfig) -> str:
    """The options with their defaults (as YAML, a list's too) and help text (for --help)."""
    lines = ["options (key=value; defaults shown):"]
    for key, default, help_text in describe_options(schema):
        lines.append(f"  {key}={default}\n      {help_text}")
    return "\n".join(lines)


def report(result: SimResult) -> str:
    cfg = result.config
    place = (
        f"{cfg['gen_fraction']:.2f} of them generating"
        if cfg["placement"] == "split"
        else "colocated"
    )
    return "\n".join(
        [
            f"{cfg['num_accelerators']} x {cfg['accelerator']}, model {cfg['model']}, "
            f"{cfg['mode']} ({place}{', paying its switches' if cfg['switch_costs'] else ''}), "
            f"eta={cfg['eta']}, interrupt={cfg['interrupt']}, "
            f"batch {cfg['num_prompts']} x {cfg['group_size']}, max {cfg['max_new_tokens']} tokens"
            + (f", LoRA rank {cfg['lora_rank']}" if cfg.get("lora_rank") else ""),
            f"  step time          {result.step_s:10.1f} s (simulated, steps "
            f"{cfg['measure_from'] + 1}-{cfg['steps']})",
            f"  {cfg['report_steps']} steps         {result.hours:10.2f} h",
            f"  trained tokens/s   {result.trained_tokens_per_s:10.0f}",
            f"  generated tokens/s {result.generated_tokens_per_s:10.0f}",
            f"  staleness          {result.staleness} (max {result.max_staleness})",
            f"  interruptions      {result.interruptions} reported by completions received "
            f"(trajectories with several versions: {result.multi_version_trajectories}); "
            f"{result.interrupted_in_window} sequences interrupted in the measured steps",
            f"  dropped            {result.dropped_groups} groups, {result.dropped_tokens} tokens "
            f"generated for nothing",
            f"  controller CPU     {result.controller_cpu_s_per_step:.3f} s per step = "
            f"{result.controller_share:.1%} of the step; simulated in {result.wall_s:.0f} s",
            *(
                []
                if result.controller_alone_cpu_s_per_step is None
                else [
                    f"  controller alone   {result.controller_alone_cpu_s_per_step:.3f} s per step = "
                    f"{result.controller_alone_share:.1%} (its messages replayed, sim/alone.py)"
                ]
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m areal.sim",
        description=__doc__.split("\n\n")[0],
        epilog=describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of options (keys as below)")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value options")
    args = parser.parse_args(argv)
    try:
        cfg = load_sim_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = simulate(cfg)
    print(json.dumps(result.to_dict(), indent=2) if args.json else report(result))
    return 0


def check_writable(path: Path) -> None:
    """ConfigError when the plan could not be written to `path` (checked before the search,
    which takes minutes): a directory, anything else that is not a regular file (a FIFO,
    whose opening would wait for a reader; a device), or a place this process cannot
    create a file in. A file it creates to find out is removed again."""
    if path.is_dir():
        raise ConfigError(f"out={str(path)!r} is a directory; give the file to write")
    existed = path.exists()
    if existed and not path.is_file():
        raise ConfigError(f"out={str(path)!r} is not a regular file; give the file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as err:
        raise ConfigError(f"out={str(path)!r} cannot be written: {err.strerror}") from None
    if not existed:
        path.unlink()


def plan_main(argv: list[str]) -> int:
    """python -m areal.sim plan: search, print the best configurations, write the winner."""
    from areal.sim.plan import Evaluator, PlanConfig, load_plan_config
    from areal.sim.plan_output import table, write_run_config
    from areal.sim.search import search

    parser = argparse.ArgumentParser(
        prog="python -m areal.sim plan",
        description="the best way to run one job on a "
        "cluster: placements, eta and interruption searched by simulation",
        epilog=describe(PlanConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of options (keys as below)")
    parser.add_argument("overrides", nargs="*", help="key=value options")
    args = parser.parse_args(argv)
    try:
        plan = load_plan_config(args.config, args.overrides)
        check_writable(Path(plan.out))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    evaluator = Evaluator(plan, progress=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        planned = search(plan, evaluator, log=lambda line: print(line, file=sys.stderr, flush=True))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        evaluator.close()
    print(table(plan, planned))
    command = " ".join(["python -m areal.sim plan", *map(shlex.quote, argv)])
    path = write_run_config(plan, planned, plan.out, command)
    print(
        f"\nwritten: {path} (python -m areal.controller --config {path}); planned in "
        f"{time.perf_counter() - start:.0f} s, {evaluator.jobs} simulations at once"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
