"""The cost model's formulas against hand calculations (sim/cost.py), and the cost file
checked when a simulation's or a plan's options are loaded."""

from __future__ import annotations

import re

import pytest

from areal.config import ConfigError
from areal.sim.config import load_sim_config
from areal.sim.cost import (
    COSTS_FILE,
    CostModel,
    Efficiency,
    _sum_max_of_lines,
    accelerator,
    cost_model,
    load_costs,
    model_shape,
)
from areal.sim.plan import load_plan_config

COSTS = load_costs(COSTS_FILE)


def _model(**eff: float) -> CostModel:
    base = dict(
        mfu=0.5,
        hbm=0.5,
        link=0.5,
        step_overhead_s=0.0,
        layer_step_overhead_s=0.0,
        seq_step_overhead_s=0.0,
    )
    base.update(eff)
    return CostModel(
        accelerator(COSTS, "h800"), model_shape(COSTS, "1.5b"), Efficiency(**base), mem_fraction=0.8
    )


def test_model_shapes_match_the_published_parameter_counts():
    # R1-Distill-Qwen model cards: 1.78B, 7.62B, 14.8B, 32.8B parameters.
    for name, billions in [("1.5b", 1.78), ("7b", 7.62), ("14b", 14.8), ("32b", 32.8)]:
        assert model_shape(COSTS, name).params / 1e9 == pytest.approx(billions, rel=0.01)


def test_kv_bytes_per_token_by_hand():
    # 1.5B: 28 layers x 2 KV heads x 128 dims x (K and V) x 2 bytes
    assert model_shape(COSTS, "1.5b").kv_bytes_per_token == 28 * 2 * 128 * 2 * 2


def test_kv_capacity_by_hand():
    cost = _model()
    free = 80e9 * 0.8 - cost.model.weight_bytes
    assert cost.kv_capacity_tokens(1) == int(free // (28 * 2 * 128 * 2 * 2))


def test_a_model_that_does_not_fit_says_to_raise_tensor_parallelism():
    cost = cost_model(COSTS, "h800", "32b")
    with pytest.raises(ValueError, match="rollout_tp"):
        cost.kv_capacity_tokens(1)
    assert cost.kv_capacity_tokens(2) > 0


def test_one_decode_step_is_the_roofline_by_hand():
    cost = _model()
    m, peak, bw = cost.model, 989.5e12, 3.35e12
    batch, context = 64, 64 * 1000
    flops = 2 * m.matmul_params * batch + 4 * m.layers * m.hidden * context
    memory = m.weight_bytes + m.kv_bytes_per_token * context
    expected = max(flops / (peak * 0.5), memory / (bw * 0.5))
    assert cost.decode_s(batch, context, 1, tp=1) == pytest.approx(expected, rel=1e-12)


def test_decode_steps_sum_each_steps_roofline_with_growing_context():
    cost = _model(step_overhead_s=1e-4, seq_step_overhead_s=1e-6)
    batch, context, steps = 200, 200 * 3000, 500
    one_by_one = sum(cost.decode_s(batch, context + batch * k, 1, tp=2) for k in range(steps))
    assert cost.decode_s(batch, context, steps, tp=2) == pytest.approx(one_by_one, rel=1e-9)


def test_sum_max_of_lines_against_brute_force():
    for a, b, n in [
        ((1.0, 0.5), (3.0, 0.1), 20),
        ((5.0, 0.0), (0.0, 1.0), 9),
        ((2.0, 1.0), (2.0, 1.0), 4),
        ((0.0, 1.0), (10.0, 2.0), 7),
    ]:
        brute = sum(max(a[0] + a[1] * k, b[0] + b[1] * k) for k in range(n))
        assert _sum_max_of_lines(a, b, n) == pytest.approx(brute)


def test_decode_steps_within_inverts_decode_s():
    cost = _model()
    total = cost.decode_s(32, 32 * 500, 100, 1)
    assert cost.decode_steps_within(32, 32 * 500, total, 1, 100) == 100
    part = cost.decode_s(32, 32 * 500, 37, 1)
    assert cost.decode_steps_within(32, 32 * 500, part * 1.0000001, 1, 100) == 37


def test_prefill_and_training_flops_by_hand():
    cost = _model()
    m = cost.model
    lengths = [100, 300]
    flops = 2 * m.matmul_params * 400 + 2 * m.layers * m.hidden * (100**2 + 300**2)
    assert cost.prefill_s(lengths, 1) == pytest.approx(
        max(flops / (989.5e12 * 0.5), m.weight_bytes / (3.35e12 * 0.5))
    )
    # forward + backward (3 passes) + the proximal log-prob pass; one rank: no all-reduce
    assert cost.train_s(lengths, 4, 1, recompute_prox=True) == pytest.approx(
        4 * flops / (989.5e12 * 0.5)
    )
    assert cost.train_s(lengths, 4, 1, recompute_prox=False) == pytest.approx(
        3 * flops / (989.5e12 * 0.5)
    )


def test_ring_allreduce_by_hand():
    cost = _model()
    size = 1e9
    assert cost.allreduce_s(size, 1) == 0.0
    assert cost.allreduce_s(size, 8) == pytest.approx(2 * 7 / 8 * size / (200e9 * 0.5))
    assert cost.allreduce_s(size, 16) == pytest.approx(2 * 15 / 16 * size / (50e9 * 0.5))


def test_every_number_in_the_cost_file_has_a_source(tmp_path):
    for section in ("accelerators", "models"):
        for name in COSTS[section]:
            cost_model(
                COSTS,
                name if section == "accelerators" else "h800",
                name if section == "models" else "1.5b",
            )
    broken = COSTS_FILE.read_text().replace(
        'hbm_bytes: {value: 80.0e+9, source: "80 GB HBM3, as H100 SXM (NVIDIA H100 datasheet)"}',
        "hbm_bytes: {value: 80.0e+9}",
    )
    path = tmp_path / "costs.yaml"
    path.write_text(broken)
    with pytest.raises(ValueError, match="accelerators.h800.hbm_bytes: every number needs"):
        cost_model(load_costs(path), "h800", "1.5b")


def test_a_missing_cost_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope.yaml' does not exist; costs= takes"):
        load_costs(tmp_path / "nope.yaml")


def test_a_cost_file_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="list.yaml' must hold a mapping laid out like"):
        load_costs(path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=70b"], "'70b' is not in models of the cost file; known: 1.5b"),
        (["accelerator=tpu"], "'tpu' is not in accelerators of the cost file"),
        (["costs=/nonexistent/costs.yaml"], "'/nonexistent/costs.yaml' does not exist"),
    ],
)
def test_options_that_the_cost_file_cannot_price_fail_when_loaded(overrides, message):
    """A simulation's and a plan's options are checked against the cost file as they are
    loaded: a ConfigError naming the file and the entry, not a traceback later."""
    for load in (load_sim_config, load_plan_config):
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            load(overrides=overrides)
        assert str(err.value).startswith("costs=")


def test_a_malformed_cost_file_fails_when_the_options_are_loaded(tmp_path):
    path = tmp_path / "costs.yaml"
    path.write_text("models: [1, 2\n")
    with pytest.raises(ConfigError, match=f"costs={re.escape(str(path))}: while parsing"):
        load_sim_config(overrides=[f"costs={path}"])
    path.write_text(COSTS_FILE.read_text().replace("lora:", "lora_gone:"))
    assert load_sim_config(overrides=[f"costs={path}"]).lora_rank == 0  # LoRA not asked for
    with pytest.raises(ConfigError, match="needs a `lora` entry"):
        load_sim_config(overrides=[f"costs={path}", "lora_rank=8"])


def test_lora_publishes_the_adapters_and_skips_the_base_weight_gradients():
    full = cost_model(COSTS, "h800", "7b")
    lora = cost_model(COSTS, "h800", "7b", lora_rank=64)
    m = lora.model
    h, kv, inter = m.hidden, m.kv_heads * m.head_dim, m.intermediate
    per_layer = 64 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h))
    assert lora.adapter_params == m.layers * per_layer  # 7B, rank 64: ~161M
    assert lora.published_bytes == lora.adapter_params * 2
    ratio = lora.published_bytes / full.published_bytes
    assert lora.publish_s(False) / full.publish_s(False) == pytest.approx(ratio)
    assert lora.weight_load_s(1) / full.weight_load_s(1) == pytest.approx(ratio)
    # One rank, no proximal pass: (1 + 2 * (1 - 0.5)) / 3 of the base FLOPs, plus the
    # adapters' own 6 * P_a per token.
    lengths = [1000] * 8
    base = full.model.forward_flops(8000, 8 * 1000**2)
    expected = (2 * base + 3 * 2 * lora.adapter_params * 8000) / (3 * base)
    assert lora.train_s(lengths, 1, 1, False) / full.train_s(lengths, 1, 1, False) == pytest.approx(
        expected
    )
    assert cost_model(COSTS, "h800", "7b", lora_rank=0).lora is None
    with pytest.raises(ValueError, match="needs a `lora` entry"):
        cost_model({k: v for k, v in COSTS.items() if k != "lora"}, "h800", "7b", lora_rank=8)


def test_a_colocated_switch_by_hand():
    costs = load_costs(COSTS_FILE)
    cost = cost_model(costs, "h800", "7b")
    c = costs["colocation"]
    sleep, wake = (c[k]["value"] * 64e9 for k in ("sleep_efficiency", "wake_efficiency"))
    moved = cost.model.weight_bytes / 2 + 14 * cost.model.params / 256  # tp 2, 256 ranks
    assert cost.switch_s(256, 2) == pytest.approx(
        moved / sleep + moved / wake + c["wake_overhead_s"]["value"], rel=1e-12
    )
    cpu = cost_model(costs, "cpu-2core", "tiny")
    with pytest.raises(ValueError, match="host_bandwidth"):
        cpu.switch_s(2, 1)
