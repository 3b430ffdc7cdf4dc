"""The simulator as a planner: the best way to run one job on a given cluster.

    plan = load_plan_config(path, overrides)
    result = search(plan, Evaluator(plan, jobs))    # -> Planned: every scored candidate

A candidate is a way to run the job: synchronous or asynchronous, how many rollout servers
of how many accelerators each (tensor parallelism; on the CPU machine, threads), how many
trainer ranks (data parallel, one accelerator each), eta and interruption. Each is scored by
a simulation with the real controller in the loop (areal.sim.run.simulate, messages passed
as objects: the codec changes no simulated number), by its effective training throughput
(trained tokens per simulated second, steady state), the measure AReaL and the paper use.

The search goes from coarse to fine, each stage's simulations in parallel (`Evaluator`):

    1. placements: the share of accelerators generating in eighths (2/8 to 7/8), servers of
       the smallest tensor-parallel size that holds the model, eta `coarse_eta`; beside
       them the synchronous colocated baselines (idealised, and paying its switches)
    2. around the best share: one sixteenth either side; the other tensor-parallel sizes
    3. eta: every power of two between eta_min and eta_max, and both bounds
    4. interruption off; one thirty-second either side of the best share

On a machine whose workers share its cores (an accelerator entry with `shared_cores`: the
CPU machine) there are few placements: every count of rollout workers up to cores + 1 and
threads per worker up to the cores, with one trainer rank, synchronous (split, as real sync
runs there) or asynchronous at each eta.

A placement must fit: a rollout server holds the weights and the KV cache of one sequence of
the longest prompt and completion (cost.kv_capacity_tokens), and a trainer rank its share of
the states (16 bytes a parameter: bf16 weights and gradients, fp32 master weights, AdamW's
two moments, sharded over the ranks as FSDP does) within `trainer_mem_fraction` of its
memory; activations are not counted. What is not searched: micro-batch sizes, pipeline or
tensor parallelism of the trainer, the concurrency limit, the PPO minibatches.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable

import psutil

from areal.config import ConfigError, opt
from areal.sim.config import SimConfig, load_options, sim_config
from areal.sim.cost import cost_model, load_costs

TRAINER_BYTES_PER_PARAM = 16
"""bf16 weights (2) and gradients (2), fp32 master weights (4), AdamW moments (8)."""
SIM_MEMORY_GB = 6
"""A simulation's peak memory, with margin (bench/cluster.py measures them: at most 3.8 GB)."""


@dataclass(kw_only=True)
class PlanConfig:
    accelerator: str = opt("h800", "accelerator kind, an entry of the cost file")
    num_accelerators: int = opt(
        128,
        "accelerators (on the CPU machine: worker threads may "
        "exceed its cores, which they then share)",
    )
    model: str = opt("1.5b", "model shape, an entry of the cost file")
    num_prompts: int = opt(512, "prompts per training step")
    group_size: int = opt(16, "samples per prompt")
    max_new_tokens: int = opt(27648, "longest completion")
    num_minibatches: int = opt(4, "PPO minibatches (optimiser steps) per training step")
    eta_min: int = opt(1, "smallest staleness bound to consider")
    eta_max: int = opt(8, "largest staleness bound to consider")
    coarse_eta: int = opt(4, "eta of the placement stages (clipped into [eta_min, eta_max])")
    rollout_tp: list[int] = opt(
        [],
        "tensor-parallel sizes of rollout servers to consider "
        "(threads per worker on the CPU machine); empty: 1, 2, 4, 8 "
        "up to the devices of a node",
    )
    trainer_mem_fraction: float = opt(
        0.9, "fraction of a trainer accelerator's memory its share of the training states may take"
    )
    max_concurrent_prompts: int | None = opt(
        None, "prompts in flight over all rollout servers; null: 512, or max_concurrent_per_worker"
    )
    max_concurrent_per_worker: int | None = opt(
        None,
        "sequences one rollout worker decodes "
        "at once (the run's rollout.max_concurrent); "
        "null: max_concurrent_prompts decides",
    )
    steps: int = opt(7, "training steps each simulation runs")
    measure_from: int = opt(4, "throughput is measured over the steps after this one")
    sync_steps: int | None = opt(
        2,
        "steps of a synchronous simulation, measured over its last "
        "(a sync step does not depend on the one before); null: as "
        "many as `steps`, measured over the same window",
    )
    replay: str | None = opt(
        None,
        "a real run's directory (run with logging.save_batches): "
        "its prompt and completion lengths replace the cost file's "
        "workload (areal.sim.replay)",
    )
    reward_latency_s: float = opt(0.002, "with replay: seconds a reward check takes")
    eval_prompts: int = opt(
        1, "held-out prompts evaluated before training (the run's eval.max_prompts)"
    )
    top: int = opt(5, "configurations printed")
    jobs: int | None = opt(None, "simulations at once; null: one per core, memory allowing")
    out: str = opt(
        "plan.yaml",
        "where the winning configuration is written (a run config "
        "for python -m areal.controller --config)",
    )
    seed: int = opt(1, "seed of the simulated workload")
    report_steps: int = opt(1000, "hours are reported for a run of this many steps")
    costs: str | None = opt(None, "cost parameter file; null: the shipped sim/costs.yaml")

    def check(self) -> None:
        for name in (
            "num_accelerators",
            "num_prompts",
            "group_size",
            "max_new_tokens",
            "num_minibatches",
            "steps",
            "top",
            "report_steps",
            "eval_prompts",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 1")
        if not 0 <= self.eta_min <= self.eta_max:
            raise ConfigError(
                f"eta_min={self.eta_min}, eta_max={self.eta_max}: need 0 <= eta_min <= eta_max"
            )
        if not 0 <= self.measure_from < self.steps:
            raise ConfigError(
                f"measure_from={self.measure_from} must be in [0, steps={self.steps})"
            )
        if self.sync_steps is not None and self.sync_steps < 2:
            raise ConfigError(
                f"sync_steps={self.sync_steps} must be >= 2 (the first step "
                "is not measured) or null"
            )
        if any(tp < 1 for tp in self.rollout_tp):
            raise ConfigError(f"rollout_tp={self.rollout_tp}: sizes must be >= 1")
        if not 0 < self.trainer_mem_fraction <= 1:
            raise ConfigError(f"trainer_mem_fraction={self.trainer_mem_fraction} must be in (0, 1]")
        if self.jobs is not None and self.jobs < 1:
            raise ConfigError(f"jobs={self.jobs} must be >= 1 or null")


def load_plan_config(path: str | Path | None = None, overrides=()) -> PlanConfig:
    return load_options(PlanConfig, path, overrides)


@dataclass(frozen=True, order=True)
class Candidate:
    """One way to run the job."""

    mode: str
    """async, sync (split placement) or colocated (sync, every accelerator both)."""
    num_rollout_workers: int
    rollout_tp: int
    num_trainer_ranks: int
    eta: int = 0
    interrupt: bool = True
    switch_costs: bool = False
    """colocated only: pays the switches between generation and training."""

    @property
    def num_accelerators(self) -> int:
        if self.mode == "colocated":
            return self.num_trainer_ranks
        return self.num_rollout_workers * self.rollout_tp + self.num_trainer_ranks

    @property
    def gen_fraction(self) -> float:
        return self.num_rollout_workers * self.rollout_tp / self.num_accelerators

    def sim_config(self, plan: PlanConfig) -> SimConfig:
        """The simulation that scores this candidate."""
        sync = self.mode != "async"
        steps = plan.sync_steps if sync and plan.sync_steps is not None else plan.steps
        measure_from = steps - 1 if sync and plan.sync_steps is not None else plan.measure_from
        workers = (
            self.num_accelerators // self.rollout_tp
            if self.mode == "colocated"
            else self.num_rollout_workers
        )
        concurrent = plan.max_concurrent_prompts or 512
        if plan.max_concurrent_per_worker is not None:
            concurrent = max(1, plan.max_concurrent_per_worker * workers // plan.group_size)
        placement = (
            dict(placement="colocated", switch_costs=self.switch_costs)
            if self.mode == "colocated"
            else dict(placement="split", gen_fraction=self.gen_fraction)
        )
        return sim_config(
            accelerator=plan.accelerator,
            model=plan.model,
            costs=plan.costs,
            num_accelerators=self.num_accelerators,
            rollout_tp=self.rollout_tp,
            mode="async" if self.mode == "async" else "sync",
            eta=self.eta,
            interrupt=self.interrupt if self.mode == "async" else False,
            num_prompts=plan.num_prompts,
            group_size=plan.group_size,
            max_new_tokens=plan.max_new_tokens,
            num_minibatches=plan.num_minibatches,
            max_concurrent_prompts=concurrent,
            steps=steps,
            measure_from=measure_from,
            report_steps=plan.report_steps,
            eval_prompts=plan.eval_prompts,
            seed=plan.seed,
            wire=False,
            **placement,
        )

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"sync colocated x{self.num_accelerators}" + (
                ", paying its switches" if self.switch_costs else ", idealised"
            )
        text = (
            f"{self.mode} {self.num_rollout_workers} x tp{self.rollout_tp} + "
            f"{self.num_trainer_ranks} trainers"
        )
        return text + (
            f", eta {self.eta}, interrupt {'on' if self.interrupt else 'off'}"
            if self.mode == "async"
            else ""
        )


@dataclass(frozen=True)
class Outcome:
    """What a simulation predicts for one candidate (the few numbers a plan needs)."""

    candidate: Candidate
    step_s: float
    hours: float
    trained_tokens_per_s: float
    generated_tokens_per_s: float
    max_staleness: int
    wall_s: float


def _simulate(config: SimConfig, replay: str | None, reward_latency_s: float) -> Any:
    """One candidate's simulation (in a worker process): its outcome, less the candidate."""
    from areal.sim.run import simulate

    result = simulate(
        config, workload=_replay_workload(replay, reward_latency_s, config.seed) if replay else None
    )
    return SimpleNamespace(**{name: getattr(result, name) for name in _NUMBERS})


_NUMBERS = (
    "step_s",
    "hours",
    "trained_tokens_per_s",
    "generated_tokens_per_s",
    "max_staleness",
    "wall_s",
)


def _outcome(candidate: Candidate, result: Any) -> Outcome:
    """An Outcome from a SimResult (or `_simulate`'s numbers)."""
    return Outcome(
        candidate,
        result.step_s,
        result.hours,
        result.trained_tokens_per_s,
        result.generated_tokens_per_s,
        result.max_staleness,
        result.wall_s,
    )


@lru_cache(maxsize=2)
def _replay_workload(run_dir: str, reward_latency_s: float, seed: int):
    from areal.sim.replay import ReplayWorkload

    return ReplayWorkload.from_run(run_dir, reward_latency_s, seed)


Submit = Callable[[SimConfig], "Future[Any]"]
"""Starts a simulation; its future's result has SimResult's step_s, hours,
trained_tokens_per_s, generated_tokens_per_s, max_staleness and wall_s."""


class Evaluator:
    """Scores candidates by simulation, `jobs` at a time in worker processes (each
    simulation is single-threaded), each candidate once. `submit`: start simulations
    elsewhere instead (bench/cluster.py's pool, shared with its other tables)."""

    def __init__(
        self,
        plan: PlanConfig,
        jobs: int | None = None,
        progress: Callable[[str], None] = lambda line: None,
        submit: Submit | None = None,
    ) -> None:
        self.plan = plan
        self.jobs = jobs or plan.jobs or default_jobs()
        self.progress = progress
        self.done: dict[Candidate, Outcome] = {}
        self._pool = (
            ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"))
            if self.jobs > 1 and submit is None
            else None
        )
        self._submit = submit or self._start

    def _start(self, config: SimConfig) -> Future[Any]:
        args = (config, self.plan.replay, self.plan.reward_latency_s)
        if self._pool is not None:
            return self._pool.submit(_simulate, *args)
        future: Future[Any] = Future()
        future.set_result(_simulate(*args))
        return future

    def evaluate(self, candidates: list[Candidate]) -> list[Outcome]:
        """Each candidate's outcome (simulated now unless it was before), in order."""
        todo = list(dict.fromkeys(c for c in candidates if c not in self.done))
        futures = [self._submit(c.sim_config(self.plan)) for c in todo]
        for candidate, future in zip(todo, futures, strict=True):
            outcome = self.done[candidate] = _outcome(candidate, future.result())
            self.progress(
                f"  {candidate.describe()}: {outcome.trained_tokens_per_s:.0f} "
                f"tok/s, step {outcome.step_s:.1f} s (simulated in "
                f"{outcome.wall_s:.0f} s)"
            )
        return [self.done[c] for c in candidates]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def default_jobs() -> int:
    """One simulation per core, as many as memory holds (SIM_MEMORY_GB each)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, int(psutil.virtual_memory().available / SIM_MEMORY_GB / 2**30)))


# -- what fits ----------------------------------------------------------------------------------


def rollout_tps(plan: PlanConfig) -> list[int]:
    """Tensor-parallel sizes whose servers hold the weights and one longest sequence."""
    costs = load_costs(plan.costs)
    cost = cost_model(costs, plan.accelerator, plan.model)
    longest = costs["workload"]["prompt_max_tokens"]["value"] + plan.max_new_tokens
    sizes = plan.rollout_tp or [tp for tp in (1, 2, 4, 8) if tp <= cost.acc.devices_per_node]
    fitting = []
    for tp in sorted(set(sizes)):
        try:
            if cost.kv_capacity_tokens(tp) >= longest:
                fitting.append(tp)
        except ValueError:  # the weights alone do not fit
            continue
    if not fitting:
        raise ConfigError(
            f"no rollout server of tensor-parallel size {sizes} holds "
            f"{plan.model} and one sequence of {longest} tokens on "
            f"{plan.accelerator}; allow larger sizes (rollout_tp)"
        )
    return fitting


def min_trainer_ranks(plan: PlanConfig) -> int:
    """The fewest trainer ranks whose shares of the training states fit in memory."""
    costs = load_costs(plan.costs)
    cost = cost_model(costs, plan.accelerator, plan.model)
    states = TRAINER_BYTES_PER_PARAM * cost.model.params
    return max(1, math.ceil(states / (cost.acc.hbm_bytes * plan.trainer_mem_fraction)))


def shared_cores(plan: PlanConfig) -> int | None:
    return cost_model(load_costs(plan.costs), plan.accelerator, plan.model).acc.shared_cores


def split(plan: PlanConfig, share: float, tp: int, min_ranks: int) -> Candidate | None:
    """The async placement with about `share` of the accelerators generating (None if it
    leaves no server or too few trainer ranks)."""
    n = plan.num_accelerators
    workers = round(share * n / tp)
    ranks = n - workers * tp
    if workers < 1 or ranks < max(1, min_ranks):
        return None
    return Candidate("async", workers, tp, ranks, eta=_clip(plan.coarse_eta, plan))


def etas(plan: PlanConfig) -> list[int]:
    """eta_min, eta_max and every power of two between them."""
    powers = [2**k for k in range(8) if plan.eta_min <= 2**k <= plan.eta_max]
    return sorted({plan.eta_min, plan.eta_max, *powers})


def _clip(eta: int, plan: PlanConfig) -> int:
    return min(max(eta, plan.eta_min), plan.eta_max)
