"""Simulated runs of the real controller (sim/run.py): what the issue requires of them."""

from __future__ import annotations

import pytest

from areal.algorithms.staleness import StalenessController
from areal.config import ConfigError
from areal.records import read_records
from areal.sim.config import load_sim_config, sim_config
from areal.sim.run import simulate

SMALL = dict(
    num_accelerators=16,
    num_prompts=8,
    group_size=4,
    max_new_tokens=8192,
    max_concurrent_prompts=24,
    num_minibatches=2,
    steps=6,
    measure_from=2,
    seed=3,
)


@pytest.fixture(scope="module")
def async_run():
    """The run, and (N_r, version) after every admission the controller made."""
    admissions: list[tuple[int, int]] = []
    real_admit = StalenessController.admit

    def admit(self, n: int, version: int) -> None:
        real_admit(self, n, version)
        admissions.append((self.num_live, version))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StalenessController, "admit", admit)
        result = simulate(sim_config(mode="async", eta=2, **SMALL))
    result.admissions = admissions
    return result


def test_interrupts_sequences_keeps_the_bound_and_trains_every_group_once(async_run):
    r = async_run
    assert r.interruptions > 0
    assert r.interrupted_in_window > 0  # counted when they happen, finished or not
    assert r.multi_version_trajectories > 0  # tokens of one trajectory from several versions
    # The bound holds at admission (docs/design.md section 5): N_r <= (i + eta + 1) * B. Token
    # staleness may exceed eta (batches are taken in finishing order, not admission order).
    batch = SMALL["num_prompts"] * SMALL["group_size"]
    assert r.admissions and all(live <= (version + 2 + 1) * batch for live, version in r.admissions)
    assert max(live - (version + 2 + 1) * batch for live, version in r.admissions) > -batch
    groups_per_step = SMALL["num_prompts"]
    assert len(r.trained_group_ids) == SMALL["steps"] * groups_per_step
    assert len(set(r.trained_group_ids)) == len(r.trained_group_ids)
    assert sum(r.staleness.values()) == SMALL["steps"] * groups_per_step * SMALL["group_size"]


def test_the_same_seed_gives_the_same_timeline(async_run):
    again = simulate(sim_config(mode="async", eta=2, **SMALL))
    for field in (
        "step_times",
        "staleness",
        "interruptions",
        "interrupted_in_window",
        "trained_group_ids",
        "generated_tokens_per_s",
        "multi_version_trajectories",
    ):
        assert getattr(again, field) == getattr(async_run, field), field
    # encoding every message on the wire costs real time, never simulated time
    unwired = simulate(sim_config(mode="async", eta=2, wire=False, **SMALL))
    assert unwired.step_times == async_run.step_times
    # the machine's speed is measured for the runs whose CPU time means something (wire)
    assert async_run.reference_decode_us > 0 and unwired.reference_decode_us is None


def test_another_seed_gives_another_timeline(async_run):
    other = simulate(sim_config(mode="async", eta=2, **{**SMALL, "seed": 4}))
    assert other.step_times != async_run.step_times


@pytest.mark.slow
def test_raising_eta_raises_throughput_up_to_the_trainers_pace():
    # A 7B model on 4 trainer ranks and 28 rollout servers: training is the slower side.
    base = dict(
        SMALL,
        model="7b",
        num_accelerators=32,
        gen_fraction=0.875,
        max_concurrent_prompts=64,
        steps=12,
        measure_from=6,
    )
    results = {eta: simulate(sim_config(mode="async", eta=eta, **base)) for eta in (0, 1, 4, None)}
    tput = [results[eta].trained_tokens_per_s for eta in (0, 1, 4, None)]
    assert tput[0] < tput[1] < tput[2] < tput[3]
    # Unbounded, generation is never waited for: a step takes exactly what the trainers take
    # (the cost model's train_s of the batch + publishing), which no eta can beat.
    for r in results.values():
        assert r.step_s >= r.train_step_s * 0.999
    assert results[None].step_s == pytest.approx(results[None].train_step_s, rel=0.02)
    assert results[0].step_s > 3 * results[0].train_step_s  # eta 0 waits for generation


def test_sync_colocated_run_never_interrupts_and_is_on_policy():
    r = simulate(
        sim_config(mode="sync", placement="colocated", **dict(SMALL, steps=3, measure_from=1))
    )
    assert r.interruptions == 0 and r.multi_version_trajectories == 0
    assert r.interrupted_in_window == 0
    assert r.max_staleness == 0


def test_strict_staleness_holds_the_bound_on_trained_tokens_by_dropping_groups():
    loose = simulate(sim_config(mode="async", eta=1, **SMALL))
    strict = simulate(sim_config(mode="async", eta=1, strict=True, **SMALL))
    assert loose.max_staleness > 1 and loose.dropped_groups == loose.dropped_tokens == 0
    assert strict.max_staleness <= 1
    assert strict.dropped_groups > 0 and strict.dropped_tokens > 0
    # every step still trains a full batch of distinct groups
    assert (
        len(strict.trained_group_ids)
        == len(set(strict.trained_group_ids))
        == SMALL["steps"] * SMALL["num_prompts"]
    )


@pytest.mark.slow
def test_interruptions_count_sequences_that_never_finished():
    """A short run with long completions: updates interrupt sequences that are still
    running when it ends, so no completion received reports them (bench/cluster.py's quick
    table d); the simulated servers count them. Without interruption, updates drain."""
    base = dict(
        num_accelerators=32,
        num_prompts=32,
        group_size=8,
        max_new_tokens=8192,
        num_minibatches=2,
        steps=4,
        measure_from=2,
        seed=1,
        mode="async",
        eta=8,
    )
    on = simulate(sim_config(interrupt=True, **base))
    off = simulate(sim_config(interrupt=False, **base))
    assert on.interruptions == 0 < on.interrupted_in_window
    assert off.interruptions == off.interrupted_in_window == 0
    assert on.generated_tokens_per_s > off.generated_tokens_per_s


def test_the_start_evaluates_as_many_prompts_as_asked_beside_the_first_groups(tmp_path):
    """A real run evaluates its held-out prompts before training while its first training
    groups are generated; the simulated run does the same with `eval_prompts` of them."""
    result = simulate(
        sim_config(mode="async", eta=2, eval_prompts=12, run_dir=str(tmp_path), **SMALL)
    )
    evals = [r for r in read_records(tmp_path) if r["kind"] == "eval"]
    assert [r["eval/num_problems"] for r in evals] == [12, 12]  # at the start and the end
    assert len(result.trained_group_ids) == SMALL["steps"] * SMALL["num_prompts"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mode=async", "placement=colocated"], "needs mode='sync'"),
        (["gen_fraction=1.0"], "gen_fraction=1.0 must be in"),
        (["steps=3", "measure_from=3"], "measure_from=3 must be in"),
        (["num_accelerators=2", "rollout_tp=2"], "leaves no rollout server or no trainer rank"),
        (["eta=-1"], "eta=-1"),
        (["eval_prompts=0"], "eval_prompts=0 must be >= 1"),
        (["heartbeat_interval_s=0"], r"heartbeat_interval_s=0.0 must be in \(0, 28800\]"),
        (["max_queued=-1"], "max_queued=-1 must be >= 0"),
        (["mode=fast"], "mode='fast' is not one of"),
        (["no_such_key=1"], "no_such_key"),
        (["num_accelerators"], "key=value"),
    ],
)
def test_bad_options_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_sim_config(None, overrides)


def test_the_simulated_run_queues_what_max_queued_says(tmp_path):
    """The run's rollout.max_queued is the simulation's (a real run's default unless set):
    the controller's room per rollout server and the server's rule for answering."""
    from areal.config import RolloutConfig

    assert sim_config().max_queued == RolloutConfig().max_queued
    overrides = sim_config(max_queued=7).to_run_overrides(str(tmp_path))
    assert "rollout.max_queued=7" in overrides


def test_a_null_heartbeat_interval_is_a_real_runs_automatic_one(tmp_path):
    """heartbeat_interval_s null: the simulated run's interval is a real run's default (1 s,
    longer past 500 workers), which the controller's CPU measurements at scale pay for."""
    from areal.config import load_config

    def interval(**values) -> float:
        overrides = sim_config(**values).to_run_overrides(str(tmp_path))
        return load_config(overrides=overrides).heartbeat_interval()

    assert interval() == 300.0  # the simulation's own default: rare
    assert interval(heartbeat_interval_s=None) == 1.0
    # 2,048 accelerators: 1,536 rollout servers, 512 trainer ranks, 32 reward workers
    assert interval(heartbeat_interval_s=None, num_accelerators=2048) == 2080 / 500


def test_a_colocated_sync_step_that_pays_its_switches_takes_that_much_longer():
    from areal.sim.cost import cost_model, load_costs

    values = dict(SMALL, mode="sync", placement="colocated", steps=2, measure_from=1)
    ideal = simulate(sim_config(**values))
    paid = simulate(sim_config(switch_costs=True, **values))
    switch = cost_model(load_costs(), "h800", "1.5b").switch_s(16, 1)
    assert paid.step_s - ideal.step_s == pytest.approx(switch, rel=1e-6)
    with pytest.raises(ConfigError, match="needs placement='colocated'"):
        sim_config(switch_costs=True, mode="async")
