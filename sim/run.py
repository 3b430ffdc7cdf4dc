"""Run one simulated training job: the real controller on a simulated cluster, virtual time.

    simulate(SimConfig) -> SimResult

builds the controller's config from the simulation's (SimConfig.to_run_overrides), the cost
model and the workload from the cost file, starts `Controller(cfg, runtime=SimRuntime)` on a
`VirtualTimeLoop`, and reads its step records: the same metrics a real run writes. Steady
state is measured over the steps after `measure_from` (the asynchronous pipeline fills
first); hours are that step time times `report_steps`.

The controller's own cost is measured too, in real CPU seconds: the time spent inside its
own tasks during each step (sim/accounting.py), message decoding and encoding included;
the simulated workers' tasks and the event loop's scheduling are counted apart.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from areal.config import load_config
from areal.controller import Controller

from areal.sim.accounting import CONTROLLER, WORKERS, CpuAccounts
from areal.sim.alone import Alone, Recording, replay
from areal.sim.config import SimConfig
from areal.sim.cost import cost_model, load_costs
from areal.sim.loop import SimulationStalled, run_virtual
from areal.sim.runtime import SimRuntime
from areal.sim.speed import reference_decode_us
from areal.sim.workers import Host, SimEnv
from areal.sim.workload import Workload

VIRTUAL_LIMIT_S = 30 * 24 * 3600.0
"""A simulated run that has not finished after 30 virtual days is stuck (SimulationStalled)."""
STALL_S = 24 * 3600.0
"""Nor is one that records nothing (no step, no event) for a simulated day."""


@dataclass(kw_only=True)
class SimResult:
    config: dict[str, Any]
    step_s: float
    """Steady-state seconds per training step (simulated)."""
    train_step_s: float
    """Of which the trainers' own time (Train sent to every rank's Trained), the mean."""
    hours: float
    """report_steps x step_s, in hours."""
    trained_tokens_per_s: float
    """Effective training throughput: tokens of the trained batches per second."""
    generated_tokens_per_s: float
    """Tokens generated per second by all rollout servers (trained or not)."""
    step_times: list[float]
    """Simulated time at the end of each step, from the start of training."""
    staleness: dict[str, int]
    """Trained trajectories by staleness (version trained at - oldest token version)."""
    max_staleness: int
    completions_per_answer: float
    """Completions per `Completions` a rollout server sent, the mean of the measured steps'
    records (`rollout/completions_per_answer`): about rollout.max_queued + 1 while the
    servers are full."""
    interruptions: int
    """Interruptions reported by the completions the controller received (in every step)."""
    interrupted_in_window: int
    """Sequences interrupted by weight updates in the measured steps, finished or not (a
    short run ends with interrupted sequences whose completions never came back)."""
    multi_version_trajectories: int
    """Trained trajectories whose tokens come from more than one policy version."""
    dropped_groups: int
    """Groups dropped and never trained, over the whole run (staleness.strict: too stale)."""
    dropped_tokens: int
    """Their generated tokens: generation spent on nothing."""
    trained_group_ids: list[int]
    controller_cpu_s_per_step: float
    """Real CPU seconds the controller spent per simulated step (steady state)."""
    controller_cpu_by_loop: dict[str, float]
    """The controller's CPU seconds per step by coroutine (its loops and handlers' tasks)."""
    controller_gc_s_per_step: float
    """Of controller_cpu_s_per_step, garbage collections that ran in the controller's steps
    (each walks the simulated cluster's objects too: sim/accounting.py)."""
    controller_pack_cpu_s_per_step: float
    """CPU seconds per step the controller's thread for packing Train messages (and freeing
    each step's batch once recorded) took (the step records' perf/pack_cpu_s): beside its
    event loop, not in controller_cpu_s_per_step."""
    controller_intake_cpu_s_per_step: float
    """CPU seconds per step of the controller's intake thread (the step records'
    perf/intake_cpu_s: decoding, checking and reading each large Completions,
    areal/intake.py): beside its event loop, not in controller_cpu_s_per_step."""
    trajectories_per_cpu_s: float
    """Trajectories the controller handles per second of its own CPU time."""
    controller_alone_cpu_s_per_step: float | None
    """The same, measured on a controller alone, its messages replayed (sim/alone.py):
    what a controller on a core of its own spends (measure_alone; else None)."""
    controller_alone_by_loop: dict[str, float]
    controller_alone_gc_s_per_step: float | None
    """Of controller_alone_cpu_s_per_step, its garbage collections (of its own objects)."""
    controller_alone_intake_cpu_s_per_step: float | None
    """controller_intake_cpu_s_per_step of the controller alone."""
    controller_alone_pack_cpu_s_per_step: float | None
    """controller_pack_cpu_s_per_step of the controller alone (packing and freeing each
    step's batch)."""
    controller_alone_without_intake_cpu_s_per_step: float | None
    """controller_alone_cpu_s_per_step of a second replay of the same messages, to a
    controller without an intake thread (its loop does that work): alone_without_intake,
    else None."""
    reference_decode_us: float | None
    """This machine's speed at the start of the run (wire only, else None): microseconds to
    decode a reference completion (sim/speed.py), the yardstick of the CPU times in the
    simulation."""
    reference_alone_us: float | None
    """The same yardstick taken just before and just after the replay alone, their mean
    (measure_alone, else None): the one the alone figures are read in. A shared machine's
    speed moves within minutes, and the replay runs minutes after the start."""
    worker_cpu_s: float
    """CPU seconds inside the simulated workers' tasks over the whole run."""
    process_cpu_s_per_step: float
    """The whole process's CPU seconds per step: controller, workers, event loop."""
    wall_s: float
    peak_rss_mb: float
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_staleness(self) -> float:
        """The trained trajectories' mean staleness, in versions."""
        return sum(int(k) * n for k, n in self.staleness.items()) / sum(self.staleness.values())

    @property
    def controller_share(self) -> float:
        """Controller CPU time per step over the simulated step time."""
        return self.controller_cpu_s_per_step / self.step_s if self.step_s else float("inf")

    @property
    def controller_alone_share(self) -> float | None:
        """The same for the controller alone (None if not measured)."""
        alone = self.controller_alone_cpu_s_per_step
        return None if alone is None else alone / self.step_s if self.step_s else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Mark = tuple[float, float, int, dict[str, float], int, float]
"""(controller CPU s, process CPU s, generated tokens, CPU s by coroutine, sequences
interrupted, controller garbage-collection s) at one moment of a run."""
_CPU, _GC = 0, 5
"""Indices in a Mark of the controller's CPU and garbage-collection seconds."""


async def _drive(
    ctl: Controller, accounts: CpuAccounts, env: SimEnv
) -> tuple[dict[str, Any], list[dict[str, Any]], list[Mark]]:
    """Run the controller; returns its summary, its records and, when each step record
    appeared, a Mark."""
    accounts.install(asyncio.get_running_loop())
    run = asyncio.create_task(ctl.run())
    records: list[dict[str, Any]] = []
    marks: list[Mark] = []

    def mark() -> Mark:
        return (
            accounts.cpu_s[CONTROLLER],
            time.process_time(),
            env.generated_tokens[0],
            dict(accounts.by_task),
            env.interrupted[0],
            accounts.gc_s[CONTROLLER],
        )

    start = mark()
    watchdog = asyncio.create_task(_watchdog(ctl, records))
    try:
        async for record in ctl.events():
            records.append(record)
            if record["kind"] == "step":
                marks.append(mark())
            elif record["kind"] == "event" and record.get("event") == "data_loaded":
                start = mark()
            if watchdog.done():
                watchdog.result()
        return await run, records, [start, *marks]
    finally:
        watchdog.cancel()
        accounts.uninstall()


async def _watchdog(ctl: Controller, records: list[dict[str, Any]]) -> None:
    """Fail a run that records nothing for STALL_S virtual seconds, saying where it stands."""
    loop = asyncio.get_running_loop()
    seen, since = 0, loop.time()
    while True:
        await asyncio.sleep(STALL_S / 10)
        if len(records) != seen:
            seen, since = len(records), loop.time()
        elif loop.time() - since > STALL_S:
            stages = collections.Counter(s.stage.value for s in ctl.ledger.by_request.values())
            ctl.stop()
            raise SimulationStalled(
                f"no record for {STALL_S:.0f} simulated seconds at version {ctl.version}: "
                f"ledger {dict(stages)}, {len(ctl.ledger.pending)} pending, "
                f"{len(ctl.ledger.buffer)} groups buffered"
            )


def simulate(
    sim: SimConfig, console: io.TextIOBase | None = None, workload: Workload | None = None
) -> SimResult:
    """Simulate `sim`; the controller's console lines go to `console` (default: dropped).
    `workload`: the lengths to generate (default: the cost file's distribution; a real
    run's lengths replayed: areal.sim.replay)."""
    costs = load_costs(sim.costs)
    cost = cost_model(costs, sim.accelerator, sim.model, sim.lora_rank)
    workload = workload or Workload.from_costs(costs, sim.seed)
    reference_us = reference_decode_us() if sim.wire else None
    wall = time.perf_counter()
    _reset_peak_rss()
    with contextlib.ExitStack() as stack:
        run_dir = sim.run_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="sim-"))
        cfg = load_config(overrides=sim.to_run_overrides(str(Path(run_dir))))
        accounts = CpuAccounts()
        env = SimEnv(
            cfg=cfg,
            cost=cost,
            workload=workload,
            host=Host(cost.eff.contention, cost.eff.train_contention, cost.acc.shared_cores),
            rollout_tp=sim.rollout_tp,
            colocated=sim.placement == "colocated",
            num_trainer_ranks=sim.num_trainer_ranks,
            switch_s=cost.switch_s(sim.num_trainer_ranks, sim.rollout_tp)
            if sim.switch_costs
            else 0.0,
        )
        recording = (
            Recording(accounts, lambda: asyncio.get_running_loop().time())
            if sim.measure_alone
            else None
        )
        ctl = Controller(cfg, runtime=SimRuntime(env, sim.wire, recording))
        with contextlib.redirect_stdout(console or io.StringIO()):
            summary, records, marks = run_virtual(
                lambda: _drive(ctl, accounts, env), VIRTUAL_LIMIT_S
            )
        alone, alone_us, without_intake = None, None, None
        if recording is not None:
            before_us = reference_decode_us()
            alone = replay(
                sim.to_run_overrides, env, recording, _drive, VIRTUAL_LIMIT_S, _tmp(stack)
            )
            if sim.alone_without_intake:
                without_intake = replay(
                    lambda run_dir: [
                        *sim.to_run_overrides(run_dir),
                        "controller.intake_thread=false",
                    ],
                    env,
                    recording,
                    _drive,
                    VIRTUAL_LIMIT_S,
                    _tmp(stack),
                )
            alone_us = (before_us + reference_decode_us()) / 2
    steps = [r for r in records if r["kind"] == "step"]
    return _result(
        sim,
        summary,
        steps,
        marks,
        ctl,
        env,
        accounts,
        time.perf_counter() - wall,
        alone,
        reference_us,
        alone_us,
        without_intake,
    )


def _tmp(stack: contextlib.ExitStack) -> Path:
    """A fresh directory for a replay's run, removed with `stack`."""
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="alone-")))


def _result(
    sim: SimConfig,
    summary: dict[str, Any],
    steps: list[dict[str, Any]],
    marks: list[Mark],
    ctl: Controller,
    env: SimEnv,
    accounts: CpuAccounts,
    wall_s: float,
    alone: Alone | None,
    reference_us: float | None,
    reference_alone_us: float | None,
    without_intake: Alone | None,
) -> SimResult:
    if len(steps) != sim.steps:
        raise RuntimeError(f"the simulated run trained {len(steps)} of {sim.steps} steps")
    times = [0.0] + [r["perf/train_elapsed_s"] for r in steps]
    tokens = [0] + [r["perf/trained_tokens"] for r in steps]
    first, last = sim.measure_from, sim.steps
    window = times[last] - times[first]
    step_s = window / (last - first)
    cpu = marks[last][0] - marks[first][0]
    process_cpu = marks[last][1] - marks[first][1]
    staleness: collections.Counter = collections.Counter()
    for r in steps:
        staleness.update({k: int(v) for k, v in r["staleness/hist"].items()})
    batch = sim.batch_size
    return SimResult(
        config=asdict(sim),
        step_s=step_s,
        hours=step_s * sim.report_steps / 3600,
        train_step_s=sum(r["perf/train_s"] for r in steps[first:last]) / (last - first),
        trained_tokens_per_s=(tokens[last] - tokens[first]) / window,
        generated_tokens_per_s=(marks[last][2] - marks[first][2]) / window,
        step_times=times[1:],
        staleness=dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        max_staleness=max(int(k) for k in staleness),
        completions_per_answer=sum(r["rollout/completions_per_answer"] for r in steps[first:last])
        / (last - first),
        interruptions=int(sum(r["rollout/interruptions"] for r in steps)),
        interrupted_in_window=marks[last][4] - marks[first][4],
        multi_version_trajectories=env.multi_version,
        dropped_groups=int(sum(r["rollout/dropped_groups"] for r in steps)),
        dropped_tokens=int(sum(r["rollout/dropped_tokens"] for r in steps)),
        trained_group_ids=list(ctl.ledger.trained_group_ids),
        controller_cpu_s_per_step=cpu / (last - first),
        controller_cpu_by_loop=_by_loop(marks, first, last),
        controller_gc_s_per_step=_per_step(marks, _GC, first, last),
        controller_pack_cpu_s_per_step=sum(r.get("perf/pack_cpu_s", 0.0) for r in steps[first:last])
        / (last - first),
        controller_intake_cpu_s_per_step=sum(
            r.get("perf/intake_cpu_s", 0.0) for r in steps[first:last]
        )
        / (last - first),
        trajectories_per_cpu_s=batch * (last - first) / cpu if cpu > 0 else float("inf"),
        controller_alone_cpu_s_per_step=None
        if alone is None
        else _per_step(alone.marks, _CPU, first, last),
        controller_alone_by_loop={} if alone is None else _by_loop(alone.marks, first, last),
        controller_alone_gc_s_per_step=None
        if alone is None
        else _per_step(alone.marks, _GC, first, last),
        controller_alone_intake_cpu_s_per_step=None
        if alone is None
        else sum(alone.intake_cpu_s[first:last]) / (last - first),
        controller_alone_pack_cpu_s_per_step=None
        if alone is None
        else sum(alone.pack_cpu_s[first:last]) / (last - first),
        controller_alone_without_intake_cpu_s_per_step=None
        if without_intake is None
        else _per_step(without_intake.marks, _CPU, first, last),
        reference_decode_us=reference_us,
        reference_alone_us=reference_alone_us,
        worker_cpu_s=accounts.cpu_s[WORKERS],
        process_cpu_s_per_step=process_cpu / (last - first),
        wall_s=wall_s,
        peak_rss_mb=_peak_rss_mb(),
        summary=summary,
    )


def _per_step(marks: Sequence[tuple[Any, ...]], index: int, first: int, last: int) -> float:
    """Mark field `index` gained per step from step `first` to step `last`."""
    return (marks[last][index] - marks[first][index]) / (last - first)


def _by_loop(marks: list[Mark], first: int, last: int) -> dict[str, float]:
    """The controller's CPU seconds per step by task (its loops), largest first."""
    by_loop = {
        name: (seconds - marks[first][3].get(name, 0.0)) / (last - first)
        for name, seconds in marks[last][3].items()
    }
    return {k: v for k, v in sorted(by_loop.items(), key=lambda kv: -kv[1]) if v > 0.0005}


def _reset_peak_rss() -> None:
    """Start this run's peak memory from now (Linux: "5" to clear_refs resets VmHWM), so that
    runs in one process each report their own peak; elsewhere the process's peak is kept."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_mb() -> float:
    """Peak resident memory since `_reset_peak_rss` (the process's peak where it cannot be
    reset)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
