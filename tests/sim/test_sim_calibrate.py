"""Fitting the cost model to measured timings (sim/calibrate.py), the training extensions
it relies on (sim/cost.py), and replaying a real run's lengths (sim/replay.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from areal.sim.calibrate import (
    DecodeSample,
    PrefillSample,
    TrainSample,
    fit_generation,
    fit_train_slowdown,
    fit_training,
)
from areal.sim.cost import COSTS_FILE, CostModel, Efficiency, accelerator, load_costs, model_shape
from areal.sim.replay import ReplayWorkload, batch_groups

COSTS = load_costs(COSTS_FILE)
ACC, MODEL = accelerator(COSTS, "h100"), model_shape(COSTS, "1.5b")


def _cost(**eff) -> CostModel:
    base = dict(
        mfu=0.3,
        hbm=0.6,
        link=1.0,
        step_overhead_s=0.002,
        layer_step_overhead_s=0.0,
        seq_step_overhead_s=1e-4,
    )
    return CostModel(ACC, MODEL, Efficiency(**{**base, **eff}), mem_fraction=1.0)


def _generation_samples(cost: CostModel) -> tuple[list[DecodeSample], list[PrefillSample]]:
    """Timings as the cost model itself would give them: memory-bound at small batches,
    compute-bound at large ones, so that every factor shows."""
    decode = [
        DecodeSample(batch=b, context=b * c, steps=50, seconds=cost.decode_s(b, b * c, 50, 1))
        for b in (1, 8, 64, 256, 1024)
        for c in (100, 4000, 16000)
    ]
    prefill = [
        PrefillSample(lengths=(n,) * k, seconds=cost.prefill_s((n,) * k, 1))
        for n in (100, 2000)
        for k in (1, 16, 64)
    ]
    return decode, prefill


def test_generation_fit_recovers_the_factors_that_made_the_timings():
    truth = _cost()
    fit = fit_generation(ACC, MODEL, *_generation_samples(truth))
    assert fit.mfu == pytest.approx(0.3, rel=0.01)
    assert fit.hbm == pytest.approx(0.6, rel=0.01)
    assert fit.step_overhead_s == pytest.approx(0.002, rel=0.01)
    assert fit.seq_step_overhead_s == pytest.approx(1e-4, rel=0.01)
    assert fit.decode_pack_attention is False
    assert fit.decode_rms < 0.005 and fit.prefill_rms < 0.005


def test_generation_fit_reports_how_far_noisy_timings_are_from_its_form():
    decode, prefill = _generation_samples(_cost())
    rng = np.random.default_rng(0)
    noisy = [
        DecodeSample(
            batch=s.batch,
            context=s.context,
            steps=s.steps,
            seconds=s.seconds * (1 + 0.05 * rng.standard_normal()),
        )
        for s in decode
    ]
    fit = fit_generation(ACC, MODEL, noisy, prefill)
    assert 0.01 < fit.decode_rms < 0.1
    assert fit.mfu == pytest.approx(0.3, rel=0.15)


def test_hbm_the_timings_cannot_see_is_the_largest_that_fits():
    # Large batches only, no context (one step each): every step is compute-bound; any
    # hbm above the bound fits as well, and the fit keeps the one that assumes least (1.0).
    cost = _cost(hbm=0.9)
    decode = [
        DecodeSample(batch=b, context=0, steps=1, seconds=cost.decode_s(b, 0, 1, 1))
        for b in (512, 1024, 2048, 4096)
    ]
    prefill = [PrefillSample(lengths=(2000,) * 8, seconds=cost.prefill_s((2000,) * 8, 1))]
    assert fit_generation(ACC, MODEL, decode, prefill).hbm == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("pack", [False, True])
def test_training_fit_recovers_rate_overhead_and_attention_form(pack):
    truth = _cost(train_mfu=0.2, train_step_overhead_s=0.05, train_pack_attention=pack)
    samples = [
        TrainSample(lengths=(n,) * k, seconds=truth.train_s((n,) * k, 1, 1, True, 8192))
        for n, k in [(32, 16), (24, 64), (64, 64), (120, 64), (96, 128), (4000, 2)]
    ]
    fit = fit_training(ACC, MODEL, samples)
    assert fit.train_pack_attention is pack
    assert fit.train_mfu == pytest.approx(0.2, rel=1e-6)
    assert fit.train_step_overhead_s == pytest.approx(0.05, rel=1e-6)
    assert fit.rms < 1e-9


def test_training_needs_samples_of_several_sizes():
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_training(ACC, MODEL, [TrainSample(lengths=(10,), seconds=1.0)])


def _in_run_steps(cost: CostModel, slowdown: float) -> list[TrainSample]:
    """Steps of real batch shapes (varied lengths) as a trainer `slowdown` times slower than
    `cost` prices training would take them, plus the publication at its price."""
    rng = np.random.default_rng(1)
    batches = [tuple(int(n) for n in rng.integers(12, 400, size=64)) for _ in range(10)]
    return [
        TrainSample(
            lengths=b,
            seconds=slowdown * cost.train_s(b, 1, 1, True, 8192) + cost.publish_s(colocated=False),
        )
        for b in batches
    ]


def test_train_slowdown_fit_recovers_the_factor_that_made_the_steps():
    cost = _cost(train_mfu=0.2, train_step_overhead_s=0.05, train_pack_attention=True)
    fit = fit_train_slowdown(cost, _in_run_steps(cost, 1.15))
    assert fit.factor == pytest.approx(1.15, rel=1e-9)
    assert fit.rms < 1e-9 and fit.steps == 10


def test_train_slowdown_is_the_median_step_and_reports_the_spread():
    cost = _cost(train_mfu=0.2)
    samples = _in_run_steps(cost, 1.0)
    # three of ten steps disturbed (3x): the median step is not, the spread shows them
    disturbed = [
        TrainSample(lengths=s.lengths, seconds=3 * s.seconds) if i < 3 else s
        for i, s in enumerate(samples)
    ]
    fit = fit_train_slowdown(cost, disturbed)
    assert fit.factor == pytest.approx(1.0, rel=1e-9)
    assert fit.rms == pytest.approx(np.sqrt(3 / 10 * (2 / 3) ** 2))  # 3 steps at 1/3 - 1
    # steps 1.1, 1.2, ... 2.0 times the price: the median of ten is between the 5th and 6th
    graded = _in_run_steps(cost, 1.0)
    graded = [
        TrainSample(
            lengths=s.lengths,
            seconds=(1 + (i + 1) / 10) * cost.train_s(s.lengths, 1, 1, True, 8192)
            + cost.publish_s(colocated=False),
        )
        for i, s in enumerate(graded)
    ]
    assert fit_train_slowdown(cost, graded).factor == pytest.approx(1.55)
    # without the publication priced apart the same steps look slower against the model
    assert fit_train_slowdown(cost, samples, publishes=False).factor > 1.0


def test_train_slowdown_needs_steps():
    with pytest.raises(ValueError, match="at least one step"):
        fit_train_slowdown(_cost(), [])


def test_training_extensions_by_hand():
    cost = _cost(train_mfu=0.25, train_step_overhead_s=0.1)
    m, lengths = cost.model, [100, 300]
    flops = 2 * m.matmul_params * 400 + 2 * m.layers * m.hidden * (100**2 + 300**2)
    assert cost.train_s(lengths, 1, 1, True) == pytest.approx(4 * flops / (989.5e12 * 0.25) + 0.1)
    # pack attention: 3000 tokens, 2 minibatches of 1500, budget 1000 -> 4 packs of 750
    packed = _cost(train_pack_attention=True)
    tokens = 3000
    flops = 2 * m.matmul_params * tokens + 4 * m.layers * m.hidden * 4 * 750**2
    assert packed.train_s([1000, 2000], 2, 1, False, 1000) == pytest.approx(
        3 * flops / (989.5e12 * 0.3)
    )


def test_shipped_gpu_entries_are_unchanged_by_the_training_extensions():
    eff = Efficiency(
        mfu=0.35,
        hbm=0.75,
        link=0.8,
        step_overhead_s=0.0005,
        layer_step_overhead_s=3e-5,
        seq_step_overhead_s=0.0,
    )
    assert eff.train_mfu is None and eff.train_step_overhead_s == 0.0
    assert eff.train_pack_attention is False


def _saved_batch(groups: dict[int, list[tuple[int, int]]]) -> dict[str, np.ndarray]:
    """A packed batch as controller/setup.py saves it: per group, (prompt, completion)."""
    versions, cu, group_ids = [], [0], []
    for group_id, seqs in groups.items():
        for prompt, completion in seqs:
            versions += [-1] * prompt + [3] * completion
            cu.append(cu[-1] + prompt + completion)
            group_ids.append(group_id)
    return {
        "versions": np.array(versions),
        "cu_seqlens": np.array(cu),
        "group_ids": np.array(group_ids),
    }


def test_batch_groups_reads_prompt_and_completion_lengths_in_sample_order():
    batch = _saved_batch({7: [(5, 10), (5, 2)], 3: [(9, 4), (9, 40)]})
    assert batch_groups(batch) == [(5, (10, 2)), (9, (4, 40))]


def test_replay_gives_the_real_lengths_by_draw_position(tmp_path):
    (tmp_path / "batches").mkdir()
    np.savez(
        tmp_path / "batches" / "step_000001.npz",
        **_saved_batch({300: [(5, 10), (5, 2)], 301: [(9, 4), (9, 40)]}),
    )
    records = [{"kind": "eval"}, {"kind": "step", "step": 1, "rollout/trained_positions": [1, 0]}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    workload = ReplayWorkload.from_run(tmp_path, reward_latency_s=0.001)
    assert workload.completion_tokens(1, "0", 384) == 10
    assert workload.completion_tokens(0, "1", 384) == 40
    assert workload.completion_tokens(0, "1", 16) == 16  # the run's cap still applies
    assert workload.prompt_tokens(0) == 9 and workload.prompt_tokens(1) == 5
    # never trained: one of the run's own lengths, the same every time
    unseen = workload.completion_tokens(5, "3", 384)
    assert unseen in (10, 2, 4, 40)
    assert workload.completion_tokens(5, "3", 384) == unseen


def test_replay_reads_a_resumed_run_as_its_history(tmp_path):
    """Step 2 was trained, the run resumed from step 1's checkpoint and trained step 2 again
    (its batch file is the second one); the last line was torn by a kill."""
    (tmp_path / "batches").mkdir()
    np.savez(tmp_path / "batches" / "step_000001.npz", **_saved_batch({0: [(5, 10)]}))
    np.savez(tmp_path / "batches" / "step_000002.npz", **_saved_batch({1: [(6, 20)]}))
    records = [
        {"kind": "step", "step": 1, "rollout/trained_positions": [0]},
        {"kind": "step", "step": 2, "rollout/trained_positions": [1]},
        {"kind": "event", "event": "resumed", "step": 1, "version": 1},
        {"kind": "step", "step": 2, "rollout/trained_positions": [2]},
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records) + '\n{"kind": "st'
    )
    workload = ReplayWorkload.from_run(tmp_path, reward_latency_s=0.001)
    assert workload.completions == {0: (10,), 2: (20,)}
    assert workload.prompts == {0: 5, 2: 6}


def test_replay_refuses_a_run_without_saved_batches(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"kind": "step", "step": 1, "rollout/trained_positions": [0]})
    )
    with pytest.raises(ValueError, match="logging.save_batches=true"):
        ReplayWorkload.from_run(tmp_path, reward_latency_s=0.001)


def test_generation_fit_finds_attention_over_the_whole_batch():
    truth = _cost(decode_pack_attention=True)
    fit = fit_generation(ACC, MODEL, *_generation_samples(truth))
    assert fit.decode_pack_attention is True
    assert fit.mfu == pytest.approx(0.3, rel=0.01)
    assert fit.step_overhead_s == pytest.approx(0.002, rel=0.01)
    assert fit.decode_rms < 0.005


def test_decode_pack_attention_by_hand():
    plain, packed = _cost(hbm=1e9), _cost(hbm=1e9, decode_pack_attention=True)  # compute-bound
    m, rate = plain.model, 989.5e12 * 0.3
    b, context = 16, 16 * 1000
    fixed = 0.002 + 1e-4 * b
    assert plain.decode_s(b, context, 1, 1) == pytest.approx(
        fixed + (2 * m.matmul_params * b + 4 * m.layers * m.hidden * context) / rate
    )
    assert packed.decode_s(b, context, 1, 1) == pytest.approx(
        fixed + (2 * m.matmul_params * b + 4 * m.layers * m.hidden * b * context) / rate
    )
