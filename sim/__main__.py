"""Ask the simulated cluster one question: what would this run cost?

    python -m areal.sim [--config FILE] [key=value ...]
    python -m areal.sim num_accelerators=256 accelerator=h100 model=7b mode=async eta=4
    python -m areal.sim --help

Runs the real controller on a simulated cluster (areal.sim.run.simulate) and prints the
steady-state step time, the hours of `report_steps` steps, the effective training throughput
(trained tokens per second), staleness and interruptions, and the controller's own CPU cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from areal.config import ConfigError

from areal.sim.config import SimConfig, load_sim_config
from areal.sim.run import SimResult, simulate


def describe() -> str:
    """The options with their defaults and help text (for --help)."""
    lines = ["options (key=value; defaults shown):"]
    for f in dataclasses.fields(SimConfig):
        choices = f.metadata.get("choices")
        extra = f" [{', '.join(choices)}]" if choices else ""
        lines.append(f"  {f.name}={f.default!r}{extra}\n      {f.metadata['help']}")
    return "\n".join(lines)


def report(result: SimResult) -> str:
    cfg = result.config
    place = f"{cfg['gen_fraction']:.2f} of them generating" if cfg["placement"] == "split" \
        else "colocated"
    return "\n".join([
        f"{cfg['num_accelerators']} x {cfg['accelerator']}, model {cfg['model']}, "
        f"{cfg['mode']} ({place}), eta={cfg['eta']}, interrupt={cfg['interrupt']}, "
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
        *([] if result.controller_alone_cpu_s_per_step is None else [
            f"  controller alone   {result.controller_alone_cpu_s_per_step:.3f} s per step = "
            f"{result.controller_alone_share:.1%} (its messages replayed, sim/alone.py)"]),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.sim", description=__doc__.split("\n\n")[0],
        epilog=describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    sys.exit(main())
