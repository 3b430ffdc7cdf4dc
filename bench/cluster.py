"""The headline claims at cluster scale, from the real controller on a simulated cluster.

    python bench/cluster.py [--quick] [--seed N] [--out DIR] [--only TABLES] [--jobs N]
    python bench/cluster.py --calibrate [--quick]   # (g) only: the check against this machine

Every number comes from `areal.sim.run.simulate`: the project's controller (admission,
staleness, dispatch, batching, sharding, the weight-update and interruption protocol) drives
simulated rollout and trainer workers on a virtual clock, with durations from the cost model
(sim/cost.py, parameters and their sources in sim/costs.yaml). Prints:

    a. the paper's four model sizes: hours sync (colocated) vs async, ratio, paper's ratio
    b. effective training throughput vs accelerators (32-512), sync and async, parallel
       efficiency against the smallest cluster
    c. maximum generation length 16k vs 32k, both modes
    d. interruptible generation on vs off (async)
    e. throughput vs eta
    f. the controller's own CPU time per simulated step (real seconds) at each scale of (b)

(a) and (b) run the paper's batch (512 prompts x 16 answers, up to 27,648 tokens); (c)-(e)
run a quarter of it (128 x 16) on a quarter of (a)'s 1.5B cluster (32 accelerators), the
same load per accelerator, so that the full bench fits its time budget. The tables are
printed in order once their simulations are done. Plots of (b) and (e) go to OUT
(bench/results/cluster).
Then

    g. the check against this machine (bench/calibration.py): measure the torch engine and
       trainer, fit the cost model, predict bench/speedup.py's sync and async wall times
       and compare with real runs (OUT/calibration)

    s. (only with --only s) what `staleness.strict` costs: async runs of (e) with and
       without it, trained throughput, largest staleness and the groups it dropped
    r. (only with --only r) the controller alone: (f)'s largest async simulation run
       again (three times: the machine's noise), each with the controller's CPU measured
       in the simulation and on a controller alone, its messages replayed (sim/alone.py)
    t. (only with --only t) the controller alone against completion length: (r)'s run at
       three maximum generation lengths, its CPU per completion, a line through them (a
       part per completion and a part per token) and what 5% of the step leaves per
       completion on a slow day (ref us 14)
    q. (only with --only q) the controller alone against rollout.max_queued: (r)'s run
       with rollout servers that queue 15 (the default), 31 and 47 requests, two seeds
       each: the controller's CPU, the step time and the trained staleness

`--only TABLES` runs some of them (e.g. `--only f`: the controller's cost alone). `--quick`
runs a small subset of a-f on small clusters and batches (a smoke run), without (g) unless
asked. `--calibrate` runs only (g) (`--calibrate --quick`: its smoke run; OUT defaults to
bench/results/calibration). A fixed seed prints the same simulated numbers twice (the
CPU-time columns of (f) and everything in (g) are real measurements and vary).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import multiprocessing
import os
import sys
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np
import psutil

from areal.config import HEARTBEATS_PER_S, ControllerConfig, RolloutConfig, load_config
from areal.sim.config import SimConfig, sim_config
from areal.sim.plan import Evaluator, Outcome, load_plan_config
from areal.sim.run import SimResult, simulate
from areal.sim.search import search

sys.path.insert(0, str(Path(__file__).parent))
from results_page import publish, write_results


@dataclass(frozen=True)
class PaperRow:
    model: str
    accelerators: int
    rollout_tp: int
    eta: int
    sync_h: float
    async_h: float


# AReaL (arXiv 2505.24298 v2), Table 1: training hours of the synchronous system and of
# AReaL, H800 GPUs. Accelerator counts: 1.5B on 16 nodes x 8 H800 (AReaL v0.1 blog,
# blog/AReaL_v0_1.md); the other sizes' counts were not found in what we could read:
# ASSUMED 32 nodes (256 GPUs), the largest count of AReaL's benchmark script
# (benchmark/verl_312a8cb/build_cmd.py, n_nodes in 4..32). Rollout tensor parallelism: 1
# below 32B, 8 for 32B (same script, sglang_tp). eta: 8 for the math models (1.5B, 7B) and
# 4 for the code models (14B, 32B) (the paper's section 7.1 settings).
PAPER = [
    PaperRow("1.5b", 128, 1, 8, 41.0, 14.8),
    PaperRow("7b", 256, 1, 8, 57.7, 25.4),
    PaperRow("14b", 256, 1, 4, 48.8, 21.9),
    PaperRow("32b", 256, 8, 4, 51.1, 31.1),
]
# Batch 512 prompts x 16 answers, 4 PPO minibatches (AReaL benchmark README,
# benchmark/verl_v0_3_0_post1_312a8cb/README.md); completions up to 27,648 tokens (the
# paper's setting for the distilled models).
BATCH = dict(num_prompts=512, group_size=16, max_new_tokens=27648, num_minibatches=4)
ABLATION_BATCH = dict(BATCH, num_prompts=128)
ABLATION_ACCELERATORS = 32
QUICK_BATCH = dict(num_prompts=32, group_size=8, max_new_tokens=8192, num_minibatches=2)
SYNC_STEPS = dict(steps=2, measure_from=1)
"""A synchronous step does not depend on the one before: one measured step."""
ASYNC_STEPS = dict(steps=7, measure_from=4)
"""The asynchronous pipeline fills over the first steps (generation runs ahead while the
buffer grows toward the eta bound, and the first batches hold the completions that finished
first): three measured steps, 5-7, after it (docs/history.md, "The measured window")."""
ABLATION_ASYNC_STEPS = dict(steps=12, measure_from=4)
"""(c)-(e)'s quarter batch: a step holds 2,048 trajectories, so a few long completions move
it more; eight measured steps (5-12)."""
QUICK_ASYNC_STEPS = dict(steps=4, measure_from=2)
"""--quick is a smoke run: two measured steps."""


class Bench:
    """Runs the simulations the tables ask for, each configuration once (tables share runs),
    in `jobs` worker processes: a simulation is single-threaded and independent of the
    others, so the tables are filled in parallel and printed in order. Tables queue all their
    simulations first (`start`), and the longest queued one starts first whenever a process
    is free, so that no long one is left running alone at the end. A simulation whose CPU
    time is measured (`wire`: table f) runs alone, nothing else beside it: another process on
    the other core would move the measurement (the simulated numbers never)."""

    def __init__(self, quick: bool, seed: int, jobs: int = 1) -> None:
        self.quick = quick
        self.seed = seed
        self.batch = QUICK_BATCH if quick else BATCH
        self.jobs = jobs
        self._pool = (
            ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
            if jobs > 1
            else None
        )
        """Spawned, not forked: the pool starts its processes from the tables' threads."""
        self._runs: dict[str, Future[SimResult]] = {}
        self._lock = threading.Lock()
        self._queue: list[tuple[bool, float, int, SimConfig, Future[SimResult]]] = []
        """Waiting simulations: measured last, then the longest (estimated) first."""
        self._running: list[bool] = []
        """Whether each running simulation is measured."""
        self.unshared = 0
        """Simulations a table ran itself, one after the other (table r's repeats)."""

    def run(
        self, mode: str, wire: bool = False, ablation: bool = False, **values: Any
    ) -> SimResult:
        """Simulate one configuration and wait for it (see `start`)."""
        return self.start(mode, wire, ablation, **values).result()

    def start(
        self, mode: str, wire: bool = False, ablation: bool = False, **values: Any
    ) -> Future[SimResult]:
        """Queue one configuration's simulation (once: runs with the same resolved
        configuration are shared). `wire`: messages go through the real codec (the
        controller's cost of table f); it changes no simulated number. `ablation`: the
        reduced batch of tables c-e."""
        return self.submit(self.config(mode, wire, ablation, **values))

    def submit(self, config: SimConfig) -> Future[SimResult]:
        """Queue a resolved configuration's simulation (once; see `start`)."""
        wire = config.wire
        key = json.dumps(dataclasses.asdict(config), sort_keys=True)
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                return run
            run = self._runs[key] = Future()
            if self._pool is None:  # one job: right here, in order
                run.set_result(_simulate(config))
                return run
            heapq.heappush(
                self._queue, (wire, -estimated_cost(config), len(self._runs), config, run)
            )
            startable = self._take_startable()
        self._launch(startable)
        return run

    def config(
        self, mode: str, wire: bool = False, ablation: bool = False, **values: Any
    ) -> SimConfig:
        """The resolved configuration of a table's run (see `start`)."""
        batch = ABLATION_BATCH if ablation and not self.quick else self.batch
        steps = (
            SYNC_STEPS
            if mode == "sync"
            else QUICK_ASYNC_STEPS
            if self.quick
            else ABLATION_ASYNC_STEPS
            if ablation
            else ASYNC_STEPS
        )
        return sim_config(
            **{
                **batch,
                **steps,
                "seed": self.seed,
                "mode": mode,
                "wire": wire,
                "placement": "colocated" if mode == "sync" else "split",
                **values,
            }
        )

    def _take_startable(self) -> list[tuple[SimConfig, Future[SimResult], bool]]:
        """The queued simulations to start now, counted as running (caller holds the lock):
        as many as processes are free; a measured one only when nothing runs."""
        startable = []
        while self._queue and len(self._running) < self.jobs and not any(self._running):
            measured = self._queue[0][0]
            if measured and self._running:
                break  # it waits for the running ones to finish
            *_, config, run = heapq.heappop(self._queue)
            self._running.append(measured)
            startable.append((config, run, measured))
        return startable

    def _launch(self, startable: list[tuple[SimConfig, Future[SimResult], bool]]) -> None:
        for config, run, measured in startable:
            self._start(config).add_done_callback(
                lambda done, run=run, measured=measured: self._finished(done, run, measured)
            )

    def _finished(self, done: Future[SimResult], run: Future[SimResult], measured: bool) -> None:
        with self._lock:
            self._running.remove(measured)
            startable = self._take_startable()
        self._launch(startable)
        error = done.exception()
        if error is None:
            run.set_result(done.result())
        else:
            run.set_exception(error)

    def _start(self, config: SimConfig) -> Future[SimResult]:
        assert self._pool is not None
        return self._pool.submit(_simulate, config)

    @property
    def simulations(self) -> int:
        return len(self._runs) + self.unshared

    def tables(self, makers: list[Callable[[Bench], Any]]) -> list[Future[Any]]:
        """Each table's result, in order: made one after the other with one job, else all at
        once (each in a thread that waits for its simulations from the worker processes).
        Tables of measured simulations go in a call of their own, after the others are done."""
        if not makers:  # e.g. --only f: no table of unmeasured simulations
            return []
        if self._pool is None:
            done = []
            for make in makers:
                future: Future[Any] = Future()
                future.set_result(make(self))
                done.append(future)
            return done
        threads = ThreadPoolExecutor(max_workers=len(makers), thread_name_prefix="table")
        futures = [threads.submit(make, self) for make in makers]
        threads.shutdown(wait=False)
        return futures

    def close(self) -> None:
        """Frees the worker processes (and their simulations' memory)."""
        self._runs.clear()
        if self._pool is not None:
            self._pool.shutdown()


def estimated_cost(config: SimConfig) -> float:
    """A simulation's relative cost, only to order the queue: the tokens it may generate."""
    return config.num_prompts * config.group_size * config.steps * config.max_new_tokens


def _simulate(config: SimConfig) -> SimResult:
    start = time.perf_counter()
    result = simulate(config)
    settings = {
        k: v
        for k, v in dataclasses.asdict(config).items()
        if k in ("eta", "interrupt", "max_new_tokens")
        and (k == "max_new_tokens" or config.mode == "async")
    }
    if config.strict:  # table (s): otherwise the same line as its non-strict run
        settings["strict"] = True
    print(
        f"  simulated {config.model} {config.mode} x{config.num_accelerators} {settings} "
        f"in {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return result


def _simulate_in_child(config: SimConfig) -> SimResult:
    """`_simulate` in a fresh process of its own, which exits after it: run one after another
    in one process, table (r)'s 2,048-accelerator simulations did not give all their memory
    back, and the third ran a 24 GB machine out of memory."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
        return child.submit(_simulate, config).result()


def default_jobs() -> int:
    """One simulation per core, as many as memory holds (SIM_MEMORY_GB each)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, int(psutil.virtual_memory().available / SIM_MEMORY_GB / 2**30)))


SIM_MEMORY_GB = 6
"""A simulation's peak memory, with margin over the largest (512 prompts x 16 answers, async,
512 accelerators; table (f)'s `rss GB` column reports each one's)."""


def _lines(head: str, rows: list[str]) -> str:
    return "\n".join([head, "-" * len(head), *rows])


def table_a(bench: Bench) -> str:
    paper = PAPER[:1] if bench.quick else PAPER
    counts = [32 if bench.quick else p.accelerators for p in paper]
    runs = []  # all queued before the first is awaited
    for p, n in zip(paper, counts, strict=True):
        common = dict(model=p.model, num_accelerators=n, rollout_tp=p.rollout_tp)
        runs.append(
            (
                _shared_start(bench, "sync", **common),
                bench.start("sync", switch_costs=True, **common),
                _shared_start(bench, "async", eta=p.eta, **common),
            )
        )
    with ThreadPoolExecutor(len(paper), thread_name_prefix="plan") as threads:
        plans = list(
            threads.map(lambda pn: planned_best(bench, *pn), zip(paper, counts, strict=True))
        )
    rows = []
    for p, n, (sync_run, paid_run, async_run), best in zip(paper, counts, runs, plans, strict=True):
        sync, paid, async_ = sync_run.result(), paid_run.result(), async_run.result()
        c = best.candidate
        rows.append(
            f"{p.model:>5} {n:>5} {p.eta:>4} {sync.step_s / 60:>8.2f} "
            f"{paid.step_s / 60:>8.2f} {async_.step_s / 60:>9.2f} "
            f"{sync.step_s / async_.step_s:>6.2f}x {paid.step_s / async_.step_s:>5.2f}x "
            f"{c.gen_fraction:>6.2f} {c.rollout_tp:>3} {best.step_s / 60:>8.2f} "
            f"{sync.step_s / best.step_s:>6.2f}x {paid.step_s / best.step_s:>5.2f}x "
            f"{p.sync_h:>7.1f} {p.async_h:>5.1f} {p.sync_h / p.async_h:>6.2f}x "
            f"{async_.max_staleness:>5}"
        )
    head = (
        f"{'model':>5} {'accel':>5} {'eta':>4} {'sync min':>8} {'+switch':>8} "
        f"{'async min':>9} {'ratio':>7} {'paid':>6} {'plan':>6} {'tp':>3} {'plan min':>8} "
        f"{'ratio':>7} {'paid':>6} {'paper h':>7} {'':>5} {'paper':>7} {'stale':>5}"
    )
    return _lines(head, rows) + (
        "\n(sim: minutes per training step, steady state; sync: colocated, idealised; "
        "+switch: the same paying its switches between generation and training (costs.yaml "
        "colocation); async: 3/4 of the accelerators generating, the paper's tp; ratio: "
        "sync over async step time, paid: +switch over async; plan: the planner's best split "
        "(share generating, rollout tp) at the paper's eta (python -m areal.sim plan); paper: "
        "hours of the whole run, sync then async)"
    )


def planned_best(bench: Bench, row: PaperRow, n: int) -> Outcome:
    """The planner's best asynchronous configuration for a row of (a), at the paper's eta
    (placements and interruption searched), its simulations run by the bench's pool."""
    steps = QUICK_ASYNC_STEPS if bench.quick else ASYNC_STEPS
    plan = load_plan_config(
        overrides=[
            "accelerator=h800",
            f"model={row.model}",
            f"num_accelerators={n}",
            *(f"{key}={value}" for key, value in bench.batch.items()),
            f"eta_min={row.eta}",
            f"eta_max={row.eta}",
            f"coarse_eta={row.eta}",
            f"steps={steps['steps']}",
            f"measure_from={steps['measure_from']}",
            f"seed={bench.seed}",
        ]
    )
    return search(plan, Evaluator(plan, jobs=1, submit=bench.submit), baselines=False).best


def scale_counts(bench: Bench) -> list[int]:
    return [16, 32] if bench.quick else [32, 64, 128, 256, 512]


def table_b(bench: Bench) -> tuple[str, dict[str, list[float]]]:
    counts = scale_counts(bench)
    runs = {mode: [_scale_run(bench, mode, n) for n in counts] for mode in ("sync", "async")}
    tput = {mode: [run.result().trained_tokens_per_s for run in runs[mode]] for mode in runs}
    rows = []
    for i, n in enumerate(counts):
        eff = {m: tput[m][i] / n / (tput[m][0] / counts[0]) for m in tput}
        rows.append(
            f"{n:>5} {tput['sync'][i]:>12.0f} {eff['sync']:>8.0%} "
            f"{tput['async'][i]:>12.0f} {eff['async']:>8.0%} "
            f"{tput['async'][i] / tput['sync'][i]:>7.2f}x"
        )
    return _lines(
        f"{'accel':>5} {'sync tok/s':>12} {'par.eff':>8} {'async tok/s':>12} "
        f"{'par.eff':>8} {'ratio':>8}",
        rows,
    ), tput


def _scale_run(bench: Bench, mode: str, n: int) -> Future[SimResult]:
    """A run of (b) and (f): the paper's batch on n accelerators, through the codec."""
    return bench.start(mode, wire=True, **_scale_values(mode, n))


def _scale_values(mode: str, n: int) -> dict[str, Any]:
    return dict(num_accelerators=n, **({} if mode == "sync" else {"eta": 8}))


def large_counts(bench: Bench) -> list[int]:
    """(f) and (r) only, async: clusters beyond (b)'s largest."""
    return [64] if bench.quick else [1024, 2048]


def _large_run(bench: Bench, n: int, **values: Any) -> Future[SimResult]:
    """An async run of (f) beyond (b)'s largest cluster: the batch and the prompts in flight
    scaled with the cluster (at 2,048 accelerators 2,048 prompts x 16 a step), so that each
    accelerator has the load it has at (b)'s largest."""
    return bench.start("async", wire=True, **_large_values(bench, n), **values)


def _large_values(bench: Bench, n: int) -> dict[str, Any]:
    """(f)'s large rows, (r) and (t): the controller at scale, with Heartbeats at a real run's
    default interval (a simulation's default keeps them rare), whose cost it pays."""
    factor = n // scale_counts(bench)[-1]
    return dict(
        _scale_values("async", n),
        num_prompts=bench.batch["num_prompts"] * factor,
        max_concurrent_prompts=512 * factor,
        heartbeat_interval_s=ControllerConfig().heartbeat_interval_s,  # a real run's default
    )


def _shared_start(bench: Bench, mode: str, **values: Any) -> Future[SimResult]:
    """`bench.start` for a table outside (b): a configuration that is also one of (b)'s runs
    goes through the codec as (b)'s do (which changes no simulated number), so that it is
    simulated once, not twice."""
    n = values["num_accelerators"]
    shared = n in scale_counts(bench) and bench.config(mode, True, **values) == bench.config(
        mode, True, **_scale_values(mode, n)
    )
    return bench.start(mode, shared, **values)


def table_c(bench: Bench) -> str:
    rows = []
    n = ABLATION_ACCELERATORS
    lengths = [4096, 8192] if bench.quick else [16384, 32768]
    runs = [
        (
            bench.start("sync", ablation=True, num_accelerators=n, max_new_tokens=length),
            bench.start("async", ablation=True, num_accelerators=n, max_new_tokens=length, eta=8),
        )
        for length in lengths
    ]
    for length, (sync_run, async_run) in zip(lengths, runs, strict=True):
        sync, async_ = sync_run.result(), async_run.result()
        rows.append(
            f"{length:>7} {sync.step_s / 60:>9.2f} {async_.step_s / 60:>9.2f} "
            f"{sync.trained_tokens_per_s:>11.0f} {async_.trained_tokens_per_s:>11.0f} "
            f"{sync.step_s / async_.step_s:>7.2f}x"
        )
    return (
        _lines(
            f"{'max len':>7} {'sync min':>9} {'async min':>9} {'sync tok/s':>11} "
            f"{'async tok/s':>11} {'ratio':>8}",
            rows,
        )
        + f"\n(1.5B, {n} accelerators, {_batch(bench)})"
    )


def table_d(bench: Bench) -> str:
    n = ABLATION_ACCELERATORS
    rows = []
    runs = {
        flag: bench.start("async", ablation=True, num_accelerators=n, eta=8, interrupt=flag)
        for flag in (False, True)
    }
    results = {flag: run.result() for flag, run in runs.items()}
    for flag, r in results.items():
        rows.append(
            f"{'on' if flag else 'off':>9} {r.step_s / 60:>9.2f} "
            f"{r.generated_tokens_per_s:>12.0f} {r.trained_tokens_per_s:>11.0f} "
            f"{r.interrupted_in_window:>8}"
        )
    gain = results[True].generated_tokens_per_s / results[False].generated_tokens_per_s - 1
    return (
        _lines(
            f"{'interrupt':>9} {'step min':>9} {'gen tok/s':>12} {'train tok/s':>11} "
            f"{'interr.':>8}",
            rows,
        )
        + f"\ngeneration throughput with interruption: {gain:+.1%} (paper: +12 to 17%); "
        f"1.5B, {n} accelerators, {_batch(bench)}, eta 8\n(interr.: sequences interrupted "
        f"by weight updates in the measured steps, finished or not)"
    )


def _batch(bench: Bench) -> str:
    batch = bench.batch if bench.quick else ABLATION_BATCH
    return f"batch {batch['num_prompts']} x {batch['group_size']}"


ETAS: list[int | None] = [0, 1, 2, 4, 8, None]


def table_e(bench: Bench) -> tuple[str, list[float]]:
    n = ABLATION_ACCELERATORS
    etas = [0, 4] if bench.quick else ETAS
    sync_run = bench.start("sync", ablation=True, num_accelerators=n)
    runs = [bench.start("async", ablation=True, num_accelerators=n, eta=eta) for eta in etas]
    sync = sync_run.result()
    rows, tput = [], []
    for eta, run in zip(etas, runs, strict=True):
        r = run.result()
        tput.append(r.trained_tokens_per_s)
        rows.append(
            f"{'inf' if eta is None else eta:>5} {r.step_s / 60:>9.2f} "
            f"{r.trained_tokens_per_s:>11.0f} "
            f"{r.trained_tokens_per_s / sync.trained_tokens_per_s:>9.2f}x "
            f"{r.max_staleness:>9}"
        )
    return (
        _lines(
            f"{'eta':>5} {'step min':>9} {'train tok/s':>11} {'vs sync':>10} {'max stale':>9}", rows
        )
        + f"\n(1.5B, {n} accelerators, {_batch(bench)}, async with a 3/4 generation split; "
        f"sync colocated: "
        f"{sync.trained_tokens_per_s:.0f} tok/s)",
        tput,
    )


STRICT_ETAS = [1, 2, 4]


def table_s(bench: Bench) -> str:
    """What `staleness.strict` costs: the same async runs as (e), with and without it."""
    n = ABLATION_ACCELERATORS
    etas = STRICT_ETAS[:2] if bench.quick else STRICT_ETAS
    runs = [
        (
            eta,
            bench.start("async", ablation=True, num_accelerators=n, eta=eta),
            bench.start("async", ablation=True, num_accelerators=n, eta=eta, strict=True),
        )
        for eta in etas
    ]
    rows = []
    for eta, loose_run, strict_run in runs:
        loose, strict = loose_run.result(), strict_run.result()
        rows.append(
            f"{eta:>5} {loose.trained_tokens_per_s:>11.0f} "
            f"{strict.trained_tokens_per_s:>11.0f} "
            f"{strict.trained_tokens_per_s / loose.trained_tokens_per_s:>7.2f}x "
            f"{loose.max_staleness:>6} {strict.max_staleness:>6} "
            f"{strict.dropped_groups:>8} {strict.dropped_tokens:>12}"
        )
    return (
        _lines(
            f"{'eta':>5} {'tok/s':>11} {'strict':>11} {'ratio':>8} {'stale':>6} "
            f"{'strict':>6} {'dropped':>8} {'dropped tok':>12}",
            rows,
        )
        + f"\n(1.5B, {n} accelerators, {_batch(bench)}, async with a 3/4 generation split; "
        "stale: the largest trained staleness; dropped: groups too stale to train and their "
        "generated tokens, over the whole run)"
    )


ALONE_REPEATS = 3


def table_r_config(bench: Bench) -> SimConfig:
    """Table (r)'s run: (f)'s largest async run, with its messages recorded for the replay
    alone (bench/controller_profile.py --table-r profiles the same)."""
    n = large_counts(bench)[-1]
    return bench.config(
        "async",
        wire=True,
        measure_alone=True,
        alone_without_intake=True,
        **_large_values(bench, n),
    )


def table_r(bench: Bench) -> str:
    """(f)'s largest async run, measured in the simulation and alone, a few times over. Run
    here, one after the other (nothing else runs beside a measured simulation)."""
    n = large_counts(bench)[-1]
    config = table_r_config(bench)
    scorers = (("reward", config), ("rollout", dataclasses.replace(config, rollout_rewards=True)))
    rows = []
    for i, (scorer, run_config) in enumerate(
        pair for _ in range(1 if bench.quick else ALONE_REPEATS) for pair in scorers
    ):
        r = _simulate_in_child(run_config)
        bench.unshared += 1
        rows.append(
            f"{i + 1:>5} {scorer:>8} {r.controller_cpu_s_per_step:>9.2f} "
            f"{r.controller_gc_s_per_step:>5.2f} {r.controller_share:>7.1%} "
            f"{r.controller_alone_cpu_s_per_step:>9.2f} "
            f"{r.controller_alone_gc_s_per_step:>5.2f} {r.controller_alone_share:>7.1%} "
            f"{r.controller_alone_intake_cpu_s_per_step:>8.2f} "
            f"{r.controller_alone_pack_cpu_s_per_step:>6.2f} "
            f"{r.controller_alone_without_intake_cpu_s_per_step:>7.2f} "
            f"{r.controller_alone_cpu_s_per_step / r.controller_alone_without_intake_cpu_s_per_step:>7.2f} "
            f"{r.controller_alone_cpu_s_per_step / r.controller_cpu_s_per_step:>8.2f} "
            f"{r.reference_decode_us:>6.1f} {r.reference_alone_us:>6.1f} "
            f"{_at_slow_speed(r):>8.1%}"
        )
        print(f"  table r, run {i + 1}: {rows[-1].split(maxsplit=1)[1]}", file=sys.stderr)
    return (
        _lines(
            f"{'run':>5} {'rewards':>8} {'in sim s':>9} {'gc s':>5} {'share':>7} {'alone s':>9} "
            f"{'gc s':>5} {'share':>7} {'intake s':>8} {'pack s':>6} {'w/o s':>7} {'ratio':>7} "
            f"{'alone/in':>8} {'ref us':>6} {'ref al':>6} {f'at {SLOW_REF_US:g} us':>8}",
            rows,
        )
        + f"\n(1.5B async, eta 8, {n} accelerators, batch {config.num_prompts} x "
        f"{bench.batch['group_size']}, step {r.step_s:.1f} s "
        f"simulated; rewards: computed by reward workers, each group sent to one in a Score "
        "through the controller (the default), or by the rollout servers themselves, their "
        "Completions carrying the rewards (reward.num_workers=0; the simulation's "
        "rollout_rewards), the two run in turn; "
        f"{HEARTBEAT_NOTE}: {_heartbeat_interval(bench, n):.2g} s; CPU seconds "
        "per step inside the controller's tasks: in the simulation "
        "(its messages recorded), and alone with the same messages replayed; intake s: "
        "CPU seconds per step of the alone controller's intake thread, which decodes each "
        "large Completions, checks its parts and reads its tokens beside its event loop "
        "(areal/intake.py; not in alone s); "
        "pack s: the same of its thread that packs each step's Train messages and frees "
        "the step's batch once recorded (not in alone s); "
        "w/o s: alone s of a second replay of the same messages to a controller without "
        "an intake (controller.intake_thread=false: its loop does that work), and ratio: "
        f"alone s over it; {GC_NOTE}; "
        f"{REF_NOTE}; {ALONE_REF_NOTE}; at {SLOW_REF_US:g} us: the alone share on a machine "
        f"at ref us {SLOW_REF_US:g}, a slow day's speed of this one (share x "
        f"{SLOW_REF_US:g} / ref al))"
    )


def _at_slow_speed(r: SimResult) -> float:
    """The controller's alone share of the step on a machine at `SLOW_REF_US`: CPU time
    scaled by the yardstick taken around the replay."""
    assert r.controller_alone_share is not None and r.reference_alone_us is not None
    return r.controller_alone_share * SLOW_REF_US / r.reference_alone_us


QUEUED = (15, 31, 47)
"""Table (q)'s rollout.max_queued values: the default first. Not beyond: at 95 the answers
shrank to about 13 completions, samples went out as they were admitted, and the controller
spent more than at 15; one of its two simulations ran a 24 GB machine out of memory
(docs/history.md)."""


def table_q(bench: Bench) -> str:
    """(r)'s run alone at each of `QUEUED`, two seeds each, one after the other: what a
    rollout server's queue buys (fewer, larger answers: the controller's CPU) and costs
    (completions held back: staleness), and what it does to the step."""
    n = large_counts(bench)[-1]
    queued = (0, QUEUED[-1]) if bench.quick else QUEUED
    seeds = (bench.seed,) if bench.quick else (bench.seed, bench.seed + 1)
    rows = []
    for max_queued in queued:
        for seed in seeds:
            config = bench.config(
                "async",
                wire=True,
                measure_alone=True,
                seed=seed,
                max_queued=max_queued,
                **_large_values(bench, n),
            )
            r = _simulate_in_child(config)
            bench.unshared += 1
            rows.append(
                f"{max_queued:>6} {seed:>4} {r.completions_per_answer:>6.1f} {r.step_s:>7.2f} "
                f"{r.mean_staleness:>9.2f} {r.max_staleness:>5} "
                f"{r.controller_alone_cpu_s_per_step:>8.2f} "
                f"{r.controller_alone_share:>7.1%} {r.reference_alone_us:>6.1f}"
            )
            print(f"  table q: {rows[-1]}", file=sys.stderr)
    return (
        _lines(
            f"{'queued':>6} {'seed':>4} {'answer':>6} {'step s':>7} {'staleness':>9} {'max':>5} "
            f"{'alone s':>8} {'share':>7} {'ref al':>6}",
            rows,
        )
        + f"\n(1.5B async, eta 8, {n} accelerators, batch "
        f"{_large_values(bench, n)['num_prompts']} x {bench.batch['group_size']}, as (r); "
        "queued: rollout.max_queued, requests each rollout server holds beyond what it "
        f"decodes (a real run's default: {RolloutConfig().max_queued}); answer: completions "
        "per Completions message a server sent; staleness, max: trained trajectories' mean "
        "and largest staleness in versions; alone s: CPU seconds per step of the controller "
        f"alone, its messages replayed (as (r)), and its share of the step; {HEARTBEAT_NOTE}; "
        f"{ALONE_REF_NOTE})"
    )


SLOW_REF_US = 14.0
"""A slow day's speed of this kind of machine, shared: `ref us` 11-17 was measured on it
(docs/history.md, "The controller's own cost"); the controller is to stay under 5% of the
step even then. Table (t) prices a completion at this speed."""

SHARE_TARGET = 0.05
"""The controller's largest share of a simulated step (the design's: it must not become the
bottleneck)."""


def table_t(bench: Bench) -> str:
    """(r)'s run alone, once per maximum generation length (the paper's length last): the
    controller's CPU per completion against the tokens each carries, a line through them,
    and what 5% of the paper-length step leaves per completion at `SLOW_REF_US`: the
    per-completion part (the line at no tokens) and the per-token part, priced apart.
    Run here, one after the other."""
    n = large_counts(bench)[-1]
    lengths = [1024, 4096] if bench.quick else [2048, 8192, bench.batch["max_new_tokens"]]
    rows, points = [], []
    for length in lengths:
        config = bench.config(
            "async", wire=True, measure_alone=True, max_new_tokens=length, **_large_values(bench, n)
        )
        r = _simulate_in_child(config)
        bench.unshared += 1
        completions = config.num_prompts * bench.batch["group_size"]
        tokens = r.trained_tokens_per_s * r.step_s / completions
        us = r.controller_alone_cpu_s_per_step / completions * 1e6
        slow_us = us * SLOW_REF_US / r.reference_alone_us
        points.append((tokens, slow_us))
        rows.append(
            f"{length:>7} {tokens:>8.0f} {r.step_s:>7.1f} "
            f"{r.controller_alone_cpu_s_per_step:>8.3f} {r.controller_alone_share:>7.1%} "
            f"{us:>8.1f} {r.reference_alone_us:>6.1f} {slow_us:>9.1f}"
        )
        print(f"  table t, {length} tokens: {rows[-1].split(maxsplit=1)[1]}", file=sys.stderr)
    tokens_of, us_of = np.array(points).T
    slope, intercept = np.polyfit(tokens_of, us_of, deg=1)
    budget = SHARE_TARGET * r.step_s / completions * 1e6  # the last run: the paper's length
    return (
        _lines(
            f"{'max tok':>7} {'tok/traj':>8} {'step s':>7} {'alone s':>8} {'share':>7} "
            f"{'us/compl':>8} {'ref al':>6} {f'at {SLOW_REF_US:g} us':>9}",
            rows,
        )
        + f"\nus per completion at ref us {SLOW_REF_US:g} = {intercept:.1f} + "
        f"{slope * 1000:.2f} per 1,000 tokens of its trajectory (least squares over "
        f"{len(points)} runs); {SHARE_TARGET:.0%} of the {r.step_s:.1f}-s step leaves "
        f"{budget:.1f} us per completion, against {points[-1][1]:.1f} measured: "
        f"{intercept:.1f} for a completion with no tokens, "
        f"{points[-1][1] - intercept:.1f} for its {points[-1][0]:.0f} tokens"
        + f"\n(1.5B async, eta 8, {n} accelerators, batch {config.num_prompts} x "
        f"{bench.batch['group_size']}; {HEARTBEAT_NOTE}; max tok: rollout.max_new_tokens; "
        "tok/traj: trained "
        "tokens per trajectory, prompt included; alone s: CPU seconds per step of the "
        "controller alone, its messages replayed (as (r)); us/compl: those per completion "
        f"of the batch; at {SLOW_REF_US:g} us: the same on a machine at ref us "
        f"{SLOW_REF_US:g}, a slow day's speed of this one; {ALONE_REF_NOTE})"
    )


def table_f(bench: Bench) -> str:
    counts = scale_counts(bench)
    runs = [(n, mode, _scale_run(bench, mode, n)) for n in counts for mode in ("sync", "async")]
    runs += [(n, "async", _large_run(bench, n)) for n in large_counts(bench)]
    rows = []
    for n, mode, run in runs:
        r = run.result()
        top = max(r.controller_cpu_by_loop.items(), key=lambda kv: kv[1], default=("-", 0))
        rows.append(
            f"{n:>5} {mode:>6} {r.step_s:>9.1f} {r.controller_cpu_s_per_step:>9.2f} "
            f"{r.controller_gc_s_per_step:>5.2f} {r.controller_share:>7.1%} "
            f"{r.controller_pack_cpu_s_per_step:>6.2f} {r.controller_intake_cpu_s_per_step:>8.2f} "
            f"{r.trajectories_per_cpu_s:>9.0f} {r.peak_rss_mb / 1024:>6.1f} "
            f"{r.reference_decode_us:>6.1f} {top[0]}:{top[1]:.2f}"
        )
    return (
        _lines(
            f"{'accel':>5} {'mode':>6} {'step s':>9} {'ctl cpu s':>9} {'gc s':>5} "
            f"{'share':>7} {'pack s':>6} {'intake s':>8} {'traj/cpus':>9} {'rss GB':>6} {'ref us':>6} "
            "largest loop (cpu s/step)",
            rows,
        )
        + "\n(ctl cpu s: real CPU seconds inside the controller's tasks per simulated step, "
        "message decoding and encoding included; share: of the simulated step time; "
        "pack s: CPU seconds a step of the thread that packs the Train messages, beside "
        "the controller's event loop (not in ctl cpu s); intake s: the same of the thread "
        "that decodes, checks and reads each large Completions (areal/intake.py); "
        f"{GC_NOTE}; {REF_NOTE}; {_large_note(bench)})"
    )


def _large_note(bench: Bench) -> str:
    large = large_counts(bench)
    group = bench.batch["group_size"]
    batches = ", ".join(f"{_large_values(bench, n)['num_prompts']} x {group}" for n in large)
    intervals = ", ".join(f"{_heartbeat_interval(bench, n):.2g} s" for n in large)
    return (
        f"{', '.join(map(str, large))} accelerators: async, the batch scaled with the "
        f"cluster ({batches}), as the prompts in flight; {HEARTBEAT_NOTE}: {intervals} (the "
        f"smaller rows: every {SimConfig().heartbeat_interval_s:g} s)"
    )


def _heartbeat_interval(bench: Bench, n: int) -> float:
    """The heartbeat interval of (f)'s large row of `n` accelerators' run (automatic)."""
    sim = bench.config("async", True, **_large_values(bench, n))
    return load_config(overrides=sim.to_run_overrides("run")).heartbeat_interval()


HEARTBEAT_NOTE = (
    "Heartbeats at a real run's default interval (controller.heartbeat_interval_s null: "
    f"1 s, or workers / {HEARTBEATS_PER_S} s past {HEARTBEATS_PER_S} workers; each side "
    "skips a round in which it sent the other something else)"
)


GC_NOTE = (
    "gc s: of the CPU seconds, garbage collections that ran in the controller's "
    "steps (in a simulation they walk the simulated cluster's objects too)"
)
REF_NOTE = (
    "ref us: this machine's speed when the run started, microseconds to decode a "
    "3,000-token completion (sim/speed.py): CPU seconds of runs compare in its units"
)
ALONE_REF_NOTE = (
    "ref al: the same yardstick (microseconds to decode a 3,000-token completion, "
    "sim/speed.py) taken just before and just after the replay alone, their mean: the unit "
    "the alone figures compare in (a shared machine's speed moves within minutes)"
)


def _plot(
    out: Path,
    counts: list[int],
    tput: dict[str, list[float]],
    etas: list[int | None],
    eta_tput: list[float],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, values in tput.items():
        ax_b.plot(counts, values, marker="o", label=mode)
    ax_b.plot(
        counts,
        [tput["async"][0] * n / counts[0] for n in counts],
        "k--",
        alpha=0.4,
        label="linear (async)",
    )
    ax_b.set(
        xscale="log",
        yscale="log",
        xlabel="accelerators",
        ylabel="trained tokens/s",
        title="(b) throughput vs accelerators",
    )
    labels = ["inf" if e is None else str(e) for e in etas]
    ax_e.plot(labels, eta_tput, marker="o")
    ax_e.set(xlabel="eta", ylabel="trained tokens/s", title="(e) throughput vs eta")
    for ax in (ax_b, ax_e):
        ax.grid(alpha=0.3)
    ax_b.legend()
    fig.tight_layout()
    fig.savefig(out / "cluster.png", dpi=120)


TABLES = {
    "a": ("sync vs async at the paper's settings (H800)", table_a, False, False),
    "b": ("effective training throughput vs accelerators (1.5B)", table_b, True, True),
    "c": ("maximum generation length", table_c, False, False),
    "d": ("interruptible generation", table_d, False, False),
    "e": ("throughput vs eta", table_e, True, False),
    "f": ("the controller's own cost", table_f, False, True),
    "s": ("what staleness.strict costs (not in the default run)", table_s, False, False),
    "r": ("the controller alone (not in the default run)", table_r, False, True),
    "t": (
        "the controller alone against completion length (not in the default run)",
        table_t,
        False,
        True,
    ),
    "q": (
        "the controller alone against rollout.max_queued (not in the default run)",
        table_q,
        False,
        True,
    ),
}
"""Letter: (title, the function printing it, whether it also returns data to plot, whether its
simulations are measured: run through the codec (`wire`), one at a time; (b) shares (f)'s)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset (smoke test)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--only",
        default=None,
        help="the tables to run, e.g. f (the controller's cost alone); "
        "default a-g (a-f with --quick); s (the cost of "
        "staleness.strict), r (the controller alone), t (alone, against completion "
        "length) and q (alone, against rollout.max_queued) only when asked",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="the same as --only g: only the check of the simulator against "
        "real runs on this machine",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: bench/results/cluster (bench/results/calibration with --calibrate)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="simulations run at once, one per process (default: one per "
        f"core, as many as free memory holds at {SIM_MEMORY_GB} GB each)",
    )
    args = parser.parse_args()
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs={args.jobs}: at least 1")
    default = "abcdef" if args.quick else "abcdefg"
    only = "g" if args.calibrate else args.only or default
    if set(only) - set("abcdefgsrtq"):
        parser.error(f"--only={only!r}: letters among a-g, s, r, t and q, e.g. --only f")
    page = publish(args.quick, args.out)
    if only == "g":
        text = calibrate(args.quick, args.out or Path("bench/results/calibration"))
        print(f"{CALIBRATION_TITLE}\n{text}")
        if page:
            _results_page("g", CALIBRATION_TITLE, text, None)
        return 0
    args.out = args.out or Path("bench/results/cluster")
    bench = Bench(args.quick, args.seed, args.jobs or default_jobs())
    start = time.perf_counter()
    sections: list[str] = []

    def show(title: str, body: str) -> None:
        sections.append(f"{title}\n{body}")
        print(sections[-1] + "\n", flush=True)

    plotted: dict[str, Any] = {}
    """The throughputs of (b) and (e), for the plot."""
    made: dict[str, Future[Any]] = {}
    for measured in (False, True):  # measured runs alone, after the others
        letters = [letter for letter in TABLES if letter in only and TABLES[letter][3] is measured]
        made.update(
            zip(letters, bench.tables([TABLES[letter][1] for letter in letters]), strict=True)
        )
        futures.wait(made.values())
    for letter, future in sorted(made.items()):
        title, _, has_data, _ = TABLES[letter]
        text, plotted[letter] = future.result() if has_data else (future.result(), None)
        show(f"{letter}. {title}", text)
        if page:
            _results_page(letter, title, text, plotted[letter])
    print(
        f"\n{bench.simulations} simulations in {time.perf_counter() - start:.0f} s "
        f"({bench.jobs} at once)",
        file=sys.stderr,
    )
    bench.close()  # the simulations' memory, before the real runs of (g)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.quick and {"b", "e"} <= set(only):
        _plot(args.out, scale_counts(bench), plotted["b"], ETAS, plotted["e"])
        print(f"plot: {args.out / 'cluster.png'}")
    if "g" in only:
        text = calibrate(args.quick, args.out / "calibration")
        show(f"g. {CALIBRATION_TITLE}", text)
        if page:
            _results_page("g", CALIBRATION_TITLE, text, None)
    name = "table" + ("" if only == default else f"-{only}") + ("-quick" if args.quick else "")
    (args.out / f"{name}.txt").write_text("\n\n".join(sections) + "\n")
    return 0


CALIBRATION_TITLE = "calibration against this machine (bench/speedup.py's runs)"


def _results_page(letter: str, title: str, text: str, values: Any) -> None:
    """docs/results/cluster-<letter>.md: one table of a full run, as printed."""
    page = write_results(
        f"cluster-{letter}",
        title=f"Cluster simulation, table ({letter}): {title}",
        command=" ".join(["python", *sys.argv]),
        table=text,
        data={"table": letter, "values": json.loads(json.dumps(values, default=str))},
        notes="The real controller drives simulated workers on a virtual clock, priced by "
        "the cost model of sim/costs.yaml (docs/guides/simulation.md says how to read it).",
    )
    print(f"results page: {page}", file=sys.stderr)


def calibrate(quick: bool, out: Path) -> str:
    """Table (g). Imported here: it loads torch and the engines, which (a)-(f) do not use."""
    from calibration import run

    return run(quick, out)


if __name__ == "__main__":
    sys.exit(main())
