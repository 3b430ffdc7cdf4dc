"""Where the controller's time goes at cluster scale: cProfile of the replayed controller.

    python bench/controller_profile.py [--accelerators N] [--prompts P] [--steps S]
                                       [--table-r] [--top K] [--out FILE] [--whole-run]
                                       [--timed [MODULE:NAME ...]] [key=value ...]

Simulates an async run (1.5B, eta 8, the paper's batch by default; with --table-r, table
(r)'s own run of bench/cluster.py: 2,048 accelerators, its batch, Heartbeats at a real
run's interval, seed 1) with its messages recorded, then replays them to a fresh
controller alone (sim/alone.py, as table (r) of bench/cluster.py does) under cProfile: what
is profiled is the controller's own work and nothing of the simulated cluster, over the
steps the tables measure (after step measure_from: the pipeline full), or the whole replay
with --whole-run. Prints the functions with the most time of their own (and their callers'
cumulative time for the largest), and writes the raw profile to OUT (`python -m pstats
OUT`). cProfile adds its own cost to every call, so compare shares, not seconds, with
tables (f) and (r).

cProfile's cost per call is larger than many of the controller's calls (decoding a
Heartbeat takes a few microseconds), so it over-weights whatever makes many small calls.
`--timed` times a few functions instead, each call with `time.thread_time` around it and
nothing else traced: by default the controller's message handlers and the codec
(`HANDLERS`), or the functions named (`module:Class.method`). It prints, per measured step,
each one's calls, CPU milliseconds (inclusive: a handler's time holds the functions it
calls) and microseconds a call. Each timed call still adds about a microsecond.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import importlib
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import areal.sim.run as sim_run
from areal.sim.config import SimConfig, sim_config

from cluster import Bench, table_r_config  # bench/ is on the path when run as a script


HANDLERS = (
    "areal.codec:decode",
    "areal.codec:encode",
    "areal.controller.core:Core.on_message",
    "areal.controller.core:Core._on_completions",
    "areal.controller.ledger:Ledger.finish_completions",
    "areal.controller.checks:completions_fit",
    "areal.messages:Completions.check",
    "areal.controller.scoring:Scoring.score",
    "areal.controller.scoring:Scoring.on_scored",
    "areal.controller.scoring:Scoring.on_accepted_completions",
    "areal.controller.scoring:Scoring.on_scored_completions",
    "areal.controller.generation:Generation.dispatch",
    "areal.controller.admission:Admission.admit",
    "areal.controller.report:StepReport.step_record",
    "areal.controller.pool:WorkerPool.lost",
)
"""What `--timed` times by default: where a step's CPU goes at cluster scale."""


class Timers:
    """Thread CPU time and calls of the functions named (`module:Class.method` or
    `module:function`), counted only while enabled; installed in place of each (and of the
    same function where another module imported it by name)."""

    def __init__(self, names: list[str]) -> None:
        self.enabled = False
        self.cpu_s = dict.fromkeys(names, 0.0)
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            self._install(name)

    def _install(self, name: str) -> None:
        module_name, _, path = name.partition(":")
        owner: Any = importlib.import_module(module_name)
        *outer, attribute = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        original = getattr(owner, attribute)
        clock, cpu_s, calls = time.thread_time, self.cpu_s, self.calls

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return original(*args, **kwargs)
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                cpu_s[name] += clock() - start
                calls[name] += 1

        setattr(owner, attribute, timed)
        if not outer:  # a module's function: also where it was imported by name (read
            # from each module's own namespace: a lazy module's __getattr__, transformers',
            # would import whatever the name stands for)
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None) or {}
                if module is not owner and namespace.get(attribute) is original:
                    setattr(module, attribute, timed)

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False

    def table(self, steps: int) -> str:
        rows = sorted(self.cpu_s, key=self.cpu_s.__getitem__, reverse=True)
        lines = [f"{'function':<52} {'calls/step':>10} {'ms/step':>8} {'us/call':>8}"]
        lines.append("-" * len(lines[0]))
        for name in rows:
            calls = self.calls[name]
            lines.append(
                f"{name.rpartition(':')[2][:52]:<52} {calls / steps:>10.0f} "
                f"{self.cpu_s[name] / steps * 1e3:>8.1f} "
                f"{self.cpu_s[name] / max(calls, 1) * 1e6:>8.1f}"
            )
        return "\n".join(lines)


def simulation(args: argparse.Namespace) -> SimConfig:
    """The run to profile: table (r)'s (`--table-r`), or one built from the options."""
    overrides = dict(item.split("=", 1) for item in args.overrides)
    if args.table_r:  # one replay profiled: the controller as configured (intake or not)
        table_r = dataclasses.replace(
            table_r_config(Bench(quick=False, seed=1)), alone_without_intake=False
        )
        return sim_config(**{**dataclasses.asdict(table_r), **overrides}) if overrides else table_r
    return sim_config(
        num_accelerators=args.accelerators,
        num_prompts=args.prompts,
        eta=8,
        steps=args.steps,
        measure_from=args.steps - 2,
        measure_alone=True,
        **overrides,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerators", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--table-r",
        action="store_true",
        help="bench/cluster.py's table (r) run (2,048 accelerators; --accelerators, "
        "--prompts and --steps are then not read; key=value changes that run, as "
        "rollout_rewards=true)",
    )
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--out", type=Path, default=Path("/tmp/controller.prof"))
    parser.add_argument(
        "--whole-run",
        dest="measured_only",
        action="store_false",
        help="profile the whole replay (set-up, the pipeline filling) instead of the steps "
        "from measure_from on, which tables (f) and (r) measure",
    )
    parser.add_argument(
        "--timed",
        nargs="*",
        metavar="MODULE:NAME",
        help="time these functions' calls with their thread's CPU clock instead of running "
        "cProfile (none named: HANDLERS)",
    )
    parser.add_argument("overrides", nargs="*", help="more simulation options (key=value)")
    args = parser.parse_args()
    config = simulation(args)
    timers = None if args.timed is None else Timers(args.timed or list(HANDLERS))
    profiler: Any = cProfile.Profile() if timers is None else timers
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
    if timers is not None:
        measured = config.steps - config.measure_from if args.measured_only else config.steps
        print(timers.table(measured))
        return 0
    profiler.dump_stats(args.out)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
