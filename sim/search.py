"""The planner's search: coarse to fine over placements, eta and interruption.

    planned = search(plan, evaluator)

Each stage proposes candidates (areal.sim.plan.Candidate) from what the stages before it
found best and has the evaluator simulate them, in parallel; see areal.sim.plan for the
stages. The search ranks by effective training throughput (trained tokens per second); the
baselines (synchronous colocated, idealised and paying its switches) are simulated beside
the first stage and never ranked among the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Callable

from areal.config import ConfigError
from areal.sim.plan import (
    Candidate,
    Evaluator,
    Outcome,
    PlanConfig,
    _clip,
    etas,
    min_trainer_ranks,
    rollout_tps,
    shared_cores,
    split,
)

COARSE_SHARES = [k / 8 for k in range(2, 8)]
"""Stage 1: the share of accelerators generating, in eighths."""


@dataclass
class Planned:
    """A search's outcome: every candidate scored, best first, and the baselines."""

    ranked: list[Outcome]
    baselines: list[Outcome]
    stages: list[int] = field(default_factory=list)
    """Simulations run by each stage."""

    @property
    def best(self) -> Outcome:
        return self.ranked[0]


def search(
    plan: PlanConfig,
    evaluator: Evaluator,
    log: Callable[[str], None] = lambda line: None,
    baselines: bool = True,
) -> Planned:
    """Every stage in turn; the candidates ranked by trained tokens per second.
    `baselines`: simulate the synchronous colocated baselines too."""
    cores = shared_cores(plan)
    stages = _shared_host_stages(plan, cores) if cores else _cluster_stages(plan, cores)
    base = _baselines(plan, cores) if baselines else []
    planned = Planned(ranked=[], baselines=[])
    seen: dict[Candidate, Outcome] = {}
    for index, stage in enumerate(stages, start=1):
        proposed = stage(_ranked(seen))
        if index == 1:
            proposed = [*proposed, *base]
        fresh = [c for c in dict.fromkeys(proposed) if c not in seen and c not in evaluator.done]
        log(f"stage {index}: {len(fresh)} simulations")
        for outcome in evaluator.evaluate(proposed):
            if outcome.candidate not in base:
                seen[outcome.candidate] = outcome
        planned.stages.append(len(fresh))
        if not seen:
            raise ConfigError(
                "no placement fits: every split leaves no rollout server or "
                "too few trainer ranks for the model's training states; add "
                "accelerators or raise trainer_mem_fraction"
            )
    planned.ranked = _ranked(seen)
    planned.baselines = [evaluator.done[c] for c in base]
    return planned


def _ranked(seen: dict[Candidate, Outcome]) -> list[Outcome]:
    """Best first; of equal throughputs the one simulated first (closer to the defaults:
    interruption on, the coarse eta)."""
    return sorted(seen.values(), key=lambda o: -o.trained_tokens_per_s)


def _baselines(plan: PlanConfig, cores: int | None) -> list[Candidate]:
    """Synchronous colocated on the same accelerators, idealised and paying its switches
    (on a machine of shared cores, real sync runs split: it is a candidate there)."""
    if cores:
        return []
    tp = rollout_tps(plan)[0]
    if plan.num_accelerators % tp:
        return []
    return [
        Candidate(
            "colocated", plan.num_accelerators // tp, tp, plan.num_accelerators, switch_costs=paid
        )
        for paid in (False, True)
    ]


Stage = Callable[[list[Outcome]], list[Candidate]]


def _cluster_stages(plan: PlanConfig, cores: int | None) -> list[Stage]:
    tps = rollout_tps(plan)
    min_ranks = min_trainer_ranks(plan)
    step = 1 / plan.num_accelerators

    def placements(ranked: list[Outcome]) -> list[Candidate]:
        return _some(split(plan, share, tps[0], min_ranks) for share in COARSE_SHARES)

    def around(ranked: list[Outcome], width: float, **changes) -> list[Candidate]:
        best = ranked[0].candidate
        out = []
        for delta in (-width, width):
            share = best.gen_fraction + delta
            if step <= share < 1:
                moved = split(plan, share, best.rollout_tp, min_ranks)
                if moved is not None:
                    out.append(_with(moved, eta=best.eta, interrupt=best.interrupt, **changes))
        return out

    def refine(ranked: list[Outcome]) -> list[Candidate]:
        best = ranked[0].candidate
        other_tps = _some(
            split(plan, best.gen_fraction, tp, min_ranks) for tp in tps if tp != best.rollout_tp
        )
        return [*around(ranked, 1 / 16), *other_tps]

    def eta_stage(ranked: list[Outcome]) -> list[Candidate]:
        best = ranked[0].candidate
        return [_with(best, eta=eta) for eta in etas(plan)]

    def finish(ranked: list[Outcome]) -> list[Candidate]:
        best = ranked[0].candidate
        return [_with(best, interrupt=False), *around(ranked, 1 / 32)]

    return [placements, refine, eta_stage, finish]


def _shared_host_stages(plan: PlanConfig, cores: int) -> list[Stage]:
    """A few worker processes sharing a machine's cores: every placement, then etas."""
    tps = [tp for tp in (plan.rollout_tp or range(1, cores + 1)) if tp <= cores]
    coarse = _clip(plan.coarse_eta, plan)
    layouts = [
        (workers, tp) for tp in tps for workers in range(1, cores + 2) if workers * tp <= cores + 1
    ]

    def placements(ranked: list[Outcome]) -> list[Candidate]:
        out = []
        for workers, tp in layouts:
            out.append(Candidate("async", workers, tp, 1, eta=coarse))
            out.append(Candidate("sync", workers, tp, 1))
        return out

    def eta_stage(ranked: list[Outcome]) -> list[Candidate]:
        best = [o.candidate for o in ranked if o.candidate.mode == "async"][:2]
        return [_with(c, eta=eta) for c in best for eta in etas(plan)]

    def finish(ranked: list[Outcome]) -> list[Candidate]:
        best = next(o.candidate for o in ranked if o.candidate.mode == "async")
        return [_with(best, interrupt=False)]

    return [placements, eta_stage, finish]


def _with(candidate: Candidate, **changes) -> Candidate:
    return replace(candidate, **changes)


def _some(candidates) -> list[Candidate]:
    return [c for c in candidates if c is not None]
