"""A plan as the user sees it: the best configurations in a table, and the winner as a run
config file.

    table(plan, planned)                -> text: the top configurations beside the baselines
    write_run_config(plan, planned, path, command) -> the config `python -m areal.controller
                                          --config PATH` runs (checked by loading it)

The run config holds what the plan decided (mode, eta, interruption, workers, tensor
parallelism or threads, trainer ranks) and the batch it was planned for; the rest keeps the
run's defaults. A GPU plan's file names the model it was planned for but cannot know its
directory or the task: its header says to set them.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from areal.config import load_config
from areal.sim.cost import load_costs
from areal.sim.plan import Candidate, Outcome, PlanConfig, shared_cores
from areal.sim.search import Planned


def _row(rank: str, o: Outcome, reference: Outcome | None) -> str:
    c = o.candidate
    eta = str(c.eta) if c.mode == "async" else "-"
    interrupt = ("on" if c.interrupt else "off") if c.mode == "async" else "-"
    ratio = (
        f"{o.trained_tokens_per_s / reference.trained_tokens_per_s:>6.2f}x"
        if reference
        else f"{'':>7}"
    )
    workers = "-" if c.mode == "colocated" else str(c.num_rollout_workers)
    return (
        f"{rank:>4} {c.mode:>9} {c.gen_fraction if c.mode != 'colocated' else 1:>5.2f} "
        f"{workers:>7} {c.rollout_tp:>3} {c.num_trainer_ranks:>8} {eta:>4} "
        f"{interrupt:>9} {o.step_s:>9.1f} {o.hours:>8.2f} {o.trained_tokens_per_s:>12.0f}"
        f" {ratio}"
    )


def table(plan: PlanConfig, planned: Planned) -> str:
    """The best `plan.top` configurations, then the baselines; `vs base`: trained tokens/s
    over the idealised synchronous baseline's (over the first ranked one's without one)."""
    cpu = shared_cores(plan) is not None
    reference = planned.baselines[0] if planned.baselines else None
    head = (
        f"{'rank':>4} {'mode':>9} {'gen':>5} {'workers':>7} {'tp':>3} {'trainers':>8} "
        f"{'eta':>4} {'interrupt':>9} {'step s':>9} {'hours':>8} {'trained tok/s':>12} "
        f"{'vs base':>7}"
    )
    rows = [head, "-" * len(head)]
    for i, outcome in enumerate(planned.ranked[: plan.top], start=1):
        rows.append(_row(str(i), outcome, reference))
    for outcome in planned.baselines:
        rows.append(_row("base", outcome, reference))
    total = sum(planned.stages)
    rows.append(
        f"({plan.num_accelerators} x {plan.accelerator}, model {plan.model}, batch "
        f"{plan.num_prompts} x {plan.group_size}, max {plan.max_new_tokens} tokens; "
        f"{total} configurations simulated in {len(planned.stages)} stages "
        f"({', '.join(map(str, planned.stages))}); gen: share of the accelerators generating; "
        f"tp: {'threads per rollout worker' if cpu else 'accelerators per rollout server'}; "
        f"hours: {plan.report_steps} steps; base: synchronous colocated on the same "
        "accelerators, idealised then paying its switches (costs.yaml colocation))"
    )
    return "\n".join(rows)


def run_config(plan: PlanConfig, candidate: Candidate) -> dict[str, Any]:
    """The run options of `candidate` (areal.config.RunConfig keys, nested)."""
    sim = candidate.sim_config(plan)
    per_worker = -(-sim.max_concurrent_prompts * plan.group_size // sim.num_rollout_workers)
    rollout: dict[str, Any] = {
        "num_workers": sim.num_rollout_workers,
        "max_new_tokens": plan.max_new_tokens,
        "max_concurrent": per_worker,
    }
    if shared_cores(plan):
        rollout["threads"] = candidate.rollout_tp
    else:
        rollout["engine"] = "vllm"
        rollout["vllm"] = {"tensor_parallel_size": candidate.rollout_tp}
    out: dict[str, Any] = {
        "mode": sim.mode,
        "task": {"group_size": plan.group_size},
        "rollout": rollout,
        "trainer": {
            "batch_size": plan.num_prompts * plan.group_size,
            "num_minibatches": plan.num_minibatches,
            "num_ranks": sim.num_trainer_ranks,
        },
    }
    if candidate.mode == "async":
        rollout["interrupt"] = candidate.interrupt
        out["staleness"] = {"eta": candidate.eta}
    return out


def write_run_config(plan: PlanConfig, planned: Planned, path: str | Path, command: str) -> Path:
    """The winner as a run config file, its prediction and provenance in a header; loaded
    once written (an error names what does not fit)."""
    best = planned.best
    c = best.candidate
    sim = c.sim_config(plan)
    lines = [
        f"# Written by: {command}",
        f"# The best of {sum(planned.stages)} simulated configurations for "
        f"{plan.num_accelerators} x {plan.accelerator}, model {plan.model}: "
        f"{c.describe()}",
        f"# predicted: {best.step_s:.1f} s a step, {best.hours:.2f} h for "
        f"{plan.report_steps} steps, {best.trained_tokens_per_s:.0f} trained tokens/s",
    ]
    for base in planned.baselines:
        lines.append(
            f"#   {base.candidate.describe()}: {base.step_s:.1f} s a step, "
            f"{base.trained_tokens_per_s:.0f} trained tokens/s"
        )
    if not shared_cores(plan):
        source = load_costs(plan.costs)["models"][plan.model].get("config", plan.model)
        lines.append(
            f"# Set model.path (planned for {plan.model}: {source}) and the task before running it."
        )
    lines.append(
        "# Simulate it again: python -m areal.sim "
        + " ".join(shlex.quote(f"{k}={_text(v)}") for k, v in _sim_overrides(sim).items())
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + yaml.safe_dump(run_config(plan, c), sort_keys=False))
    load_config(path)
    return path


def _sim_overrides(sim: Any) -> dict[str, Any]:
    keys = (
        "num_accelerators",
        "accelerator",
        "model",
        "mode",
        "placement",
        "gen_fraction",
        "rollout_tp",
        "eta",
        "interrupt",
        "num_prompts",
        "group_size",
        "max_new_tokens",
        "num_minibatches",
        "max_concurrent_prompts",
        "steps",
        "measure_from",
        "costs",
    )
    return {k: getattr(sim, k) for k in keys if getattr(sim, k) is not None}


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
