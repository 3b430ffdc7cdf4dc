"""The Ray example configs load, and their placement groups fit the cluster they are written
for: examples/ray/gsm8k_2x8gpu.yaml on 2 nodes x 8 GPUs, gsm8k_local_cpu.yaml on this
machine's Ray instance. No Ray needed: what Ray would be asked for is computed
(controller/launch/placement.py) and placed first-fit on the described nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal.config import config_to_yaml, load_config
from areal.controller.launch.placement import PlacementError, first_fit, requested_groups
from areal.controller.launch.ray_runtime import _devices
from areal.messages import WorkerKind

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray"
GPU_NODE = {"CPU": 96, "GPU": 8, "memory": 1024 * 2**30}


def test_the_2x8_gpu_example_fills_two_nodes_with_tp2_servers_and_fsdp_ranks(tiny_model_dir):
    cfg = load_config(EXAMPLES / "gsm8k_2x8gpu.yaml", [f"model.path={tiny_model_dir}"])
    assert cfg.launcher == "ray" and cfg.trainer.data_parallel == "fsdp"
    groups = requested_groups(cfg)
    rollout = [groups[WorkerKind.ROLLOUT, i] for i in range(4)]
    assert all(
        g.bundles == [{"CPU": 8, "GPU": 2}] and g.strategy == "STRICT_PACK" for g in rollout
    )  # a TP-2 server's GPUs: one bundle, one node
    trainer = groups[WorkerKind.TRAINER, 0]
    assert trainer.bundles == [{"CPU": 8, "GPU": 1}] * 8 and trainer.strategy == "STRICT_PACK"
    ordered = [trainer, *rollout, *(groups[WorkerKind.REWARD, i] for i in range(4))]
    plan = first_fit(ordered, [GPU_NODE, GPU_NODE])
    assert set(plan[0]) == {0}  # the 8 ranks share a node
    assert [p[0] for p in plan[1:5]] == [1, 1, 1, 1]  # the 4 servers fill the other
    with pytest.raises(PlacementError, match="missing CPU 16, GPU 8"):
        first_fit(ordered, [GPU_NODE])
    # Each worker sees only its own GPUs: the first is cuda:0 (filled by the runtime).
    assert _devices(cfg.trainer.devices, cfg.ray.trainer.num_gpus, 8) == ["cuda:0"] * 8
    assert "launcher: ray" in config_to_yaml(cfg)


def test_the_local_cpu_example_is_the_same_shape_on_one_machine():
    cfg = load_config(EXAMPLES / "gsm8k_local_cpu.yaml")
    assert cfg.launcher == "ray" and cfg.ray.address is None
    assert (cfg.rollout.num_workers, cfg.trainer.num_ranks) == (2, 2)
    assert cfg.weight_sync.mode == "collective"
    groups = requested_groups(cfg)
    assert sorted((k.value, i) for k, i in groups) == [
        ("reward", 0),
        ("rollout", 0),
        ("rollout", 1),
        ("trainer", 0),
    ]
    plan = first_fit(list(groups.values()), [{"CPU": 5}])  # the local instance's CPUs
    assert all(spots and set(spots) == {0} for spots in plan)
    assert _devices(cfg.rollout.devices, cfg.ray.rollout.num_gpus, 2) == []
