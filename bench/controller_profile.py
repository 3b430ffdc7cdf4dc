"""Where the controller's time goes at cluster scale: cProfile of the replayed controller.

    python bench/controller_profile.py [--accelerators N] [--prompts P] [--steps S]
                                       [--top K] [--out FILE] [--whole-run]
                                       [key=value ...]

Simulates an async run (1.5B, eta 8, the paper's batch by default) with its messages
recorded, then replays them to a fresh controller alone (sim/alone.py, as table (r) of
bench/cluster.py does) under cProfile: what is profiled is the controller's own work and
nothing of the simulated cluster, over the steps the tables measure (after step
measure_from: the pipeline full), or the whole replay with --whole-run. Prints the
functions with the most time of their own (and their callers' cumulative time for the
largest), and writes the raw profile to OUT (`python -m pstats OUT`). cProfile adds its own cost to every call, so compare shares, not
seconds, with tables (f) and (r).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import areal.sim.run as sim_run
from areal.sim.config import sim_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerators", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--out", type=Path, default=Path("/tmp/controller.prof"))
    parser.add_argument(
        "--whole-run",
        dest="measured_only",
        action="store_false",
        help="profile the whole replay (set-up, the pipeline filling) instead of the steps "
        "from measure_from on, which tables (f) and (r) measure",
    )
    parser.add_argument("overrides", nargs="*", help="more simulation options (key=value)")
    args = parser.parse_args()
    config = sim_config(
        num_accelerators=args.accelerators,
        num_prompts=args.prompts,
        eta=8,
        steps=args.steps,
        measure_from=args.steps - 2,
        measure_alone=True,
        **dict(item.split("=", 1) for item in args.overrides),
    )
    profiler = cProfile.Profile()
    real_replay = sim_run.replay

    def profiled_replay(cfg_overrides, env, recording, drive, *rest):
        async def drive_profiled(ctl, accounts, env):
            records = ctl.events

            async def profiled_records():
                num_steps = 0
                async for record in records():
                    yield record
                    num_steps += record["kind"] == "step"
                    if num_steps == config.measure_from and args.measured_only:
                        profiler.enable()  # from the step record the measurement starts at

            ctl.events = profiled_records
            return await drive(ctl, accounts, env)

        if not args.measured_only:
            profiler.enable()
        try:
            return real_replay(cfg_overrides, env, recording, drive_profiled, *rest)
        finally:
            profiler.disable()

    sim_run.replay = profiled_replay
    start = time.perf_counter()
    result = sim_run.simulate(config)
    print(
        f"simulated and replayed in {time.perf_counter() - start:.0f} s; step "
        f"{result.step_s:.1f} s; controller alone {result.controller_alone_cpu_s_per_step:.2f}"
        f" CPU s a step (profiled: inflated), by loop {result.controller_alone_by_loop}",
        file=sys.stderr,
    )
    profiler.dump_stats(args.out)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
