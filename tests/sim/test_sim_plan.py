"""python -m areal.sim plan: what fits, the search's stages, the table and the config file,
on a tiny search space (a few simulations of a small batch)."""

from __future__ import annotations

import math

import pytest
import yaml

from areal.config import ConfigError, load_config
from areal.sim.__main__ import main
from areal.sim.cost import cost_model, load_costs
from areal.sim.plan import (
    Candidate,
    Evaluator,
    load_plan_config,
    min_trainer_ranks,
    rollout_tps,
    split,
)
from areal.sim.search import search

TINY = [
    "num_accelerators=8",
    "num_prompts=4",
    "group_size=2",
    "max_new_tokens=1024",
    "steps=3",
    "measure_from=1",
    "eta_min=1",
    "eta_max=2",
    "jobs=1",
]


def test_a_rollout_server_must_hold_the_model_and_one_longest_sequence():
    assert rollout_tps(load_plan_config(overrides=["model=1.5b"])) == [1, 2, 4, 8]
    # 32B: 65.6 GB of weights do not fit 0.7 x 80 GB on one H800; on two they do
    tps = rollout_tps(load_plan_config(overrides=["model=32b"]))
    assert tps[0] == 2 and 1 not in tps
    with pytest.raises(ConfigError, match="rollout_tp"):
        rollout_tps(load_plan_config(overrides=["model=32b", "rollout_tp=[1]"]))


def test_trainer_ranks_must_hold_their_share_of_the_training_states():
    plan = load_plan_config(overrides=["model=32b"])
    params = cost_model(load_costs(), "h800", "32b").model.params
    assert min_trainer_ranks(plan) == math.ceil(16 * params / (80e9 * 0.9)) == 8
    # a split that would leave 4 trainer ranks is not proposed
    assert (
        split(
            load_plan_config(overrides=["model=32b", "num_accelerators=16"]),
            12 / 16,
            2,
            min_trainer_ranks(plan),
        )
        is None
    )


def test_a_candidate_is_the_simulation_of_its_placement():
    plan = load_plan_config(overrides=TINY)
    config = Candidate("async", 3, 2, 2, eta=2, interrupt=False).sim_config(plan)
    assert (
        config.num_accelerators,
        config.num_rollout_workers,
        config.rollout_tp,
        config.num_trainer_ranks,
    ) == (8, 3, 2, 2)
    assert (config.eta, config.interrupt, config.wire) == (2, False, False)
    base = Candidate("colocated", 8, 1, 8, switch_costs=True).sim_config(plan)
    assert (base.placement, base.mode, base.switch_costs, base.steps) == (
        "colocated",
        "sync",
        True,
        2,
    )


def test_the_cpu_machine_shares_its_cores_among_few_worker_placements():
    plan = load_plan_config(
        overrides=["accelerator=cpu-2core", "model=tiny", "num_accelerators=2", *TINY[1:]]
    )

    class Recorder:
        def __init__(self):
            self.done: dict = {}
            self.asked = []

        def evaluate(self, candidates):
            self.asked.append(candidates)
            from areal.sim.plan import Outcome

            return [
                Outcome(
                    c,
                    1.0,
                    1.0,
                    float(c.num_rollout_workers * 10 + c.eta + c.interrupt),
                    1.0,
                    0,
                    0.0,
                )
                for c in candidates
            ]

    recorder = Recorder()
    planned = search(plan, recorder)
    first = {(c.mode, c.num_rollout_workers, c.rollout_tp) for c in recorder.asked[0]}
    assert first == {
        (mode, w, tp) for mode in ("async", "sync") for w, tp in [(1, 1), (2, 1), (3, 1), (1, 2)]
    }
    assert not planned.baselines  # real sync runs split here: it is a candidate
    assert planned.best.candidate == Candidate("async", 3, 1, 1, eta=2, interrupt=True)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "best.yaml"
    plan = load_plan_config(overrides=[*TINY, "rollout_tp=[1,2]", f"out={out}"])
    evaluator = Evaluator(plan)
    try:
        planned = search(plan, evaluator)
    finally:
        evaluator.close()
    return plan, planned, evaluator, out


@pytest.mark.slow
def test_the_search_goes_coarse_to_fine_and_ranks_every_candidate(tiny_plan):
    _, planned, evaluator, _ = tiny_plan
    # stage 1: shares 2/8..7/8 of 8 accelerators at tp 1, and the two baselines
    assert planned.stages[0] == 6 + 2 and len(planned.stages) == 4
    assert sum(planned.stages) == len(evaluator.done)
    tokens = [o.trained_tokens_per_s for o in planned.ranked]
    assert tokens == sorted(tokens, reverse=True)
    assert planned.best.trained_tokens_per_s == max(
        o.trained_tokens_per_s for c, o in evaluator.done.items() if c.mode == "async"
    )
    # the eta stage tried every eta in [1, 2] at the best placement
    best = planned.best.candidate
    tried = {
        (c.eta, c.interrupt)
        for c in evaluator.done
        if (c.num_rollout_workers, c.rollout_tp) == (best.num_rollout_workers, best.rollout_tp)
    }
    assert {(1, True), (2, True)} <= tried and any(not i for _, i in tried)
    ideal, paid = planned.baselines
    assert paid.step_s > ideal.step_s  # the switches cost time


@pytest.mark.slow
def test_plan_cli_prints_the_ranking_and_writes_a_config_the_run_loads(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", *TINY, "eta_max=1", "rollout_tp=[1]", f"out={out}"]) == 0
    text = capsys.readouterr().out
    assert "rank" in text and "base colocated" in text and f"written: {out}" in text
    cfg = load_config(out)
    written = yaml.safe_load(out.read_text())
    assert cfg.rollout.num_workers + cfg.trainer.num_ranks == 8
    assert cfg.trainer.batch_size == 8 and cfg.staleness.eta == 1
    assert written["rollout"]["vllm"]["tensor_parallel_size"] == 1
    assert "# Simulate it again: python -m areal.sim num_accelerators=8" in out.read_text()


def test_plan_cli_names_a_bad_option(capsys):
    assert main(["plan", "eta_min=3", "eta_max=2"]) == 2
    assert "eta_min=3, eta_max=2" in capsys.readouterr().err
