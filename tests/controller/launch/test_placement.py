"""What the run asks Ray for, and why a placement cannot be satisfied, in words (no Ray:
placement.py's decisions are plain functions of the config and the nodes' resources)."""

from __future__ import annotations

import re

import pytest

from areal.config import ConfigError, load_config
from areal.controller.launch.placement import (
    Group,
    PlacementError,
    first_fit,
    requested_groups,
    shortfall,
)
from areal.messages import WorkerKind


def node(node_id: str, **resources: float) -> dict:
    return {"node_id": node_id, "address": "10.0.0.1", "resources": resources}


def test_each_worker_gets_a_bundle_and_the_trainer_ranks_share_one_group():
    cfg = load_config(
        overrides=[
            "launcher=ray",
            "rollout.num_workers=2",
            "trainer.num_ranks=3",
            "ray.rollout.num_gpus=2",
            "ray.trainer.num_gpus=1",
            "ray.trainer_strategy=SPREAD",
            "ray.reward.memory_gb=2",
            "ray.reward.resources.sandbox=1",
        ]
    )
    groups = requested_groups(cfg)
    assert groups[WorkerKind.ROLLOUT, 1].bundles == [{"CPU": 1, "GPU": 2}]
    assert groups[WorkerKind.REWARD, 0].bundles == [{"CPU": 1, "memory": 2 * 2**30, "sandbox": 1}]
    trainer = groups[WorkerKind.TRAINER, 0]
    assert trainer.bundles == [{"CPU": 1, "GPU": 1}] * 3 and trainer.strategy == "SPREAD"
    remote = requested_groups(
        load_config(
            overrides=["launcher=ray", "controller.remote_kinds=[trainer]", "controller.auth=curve"]
        )
    )
    assert (WorkerKind.TRAINER, 0) not in remote


def test_resources_the_cluster_lacks_are_named_with_what_it_has():
    groups = [Group("trainer", [{"CPU": 1, "GPU": 1}] * 2, "PACK")]
    text = shortfall(groups, groups, [node("a", CPU=4), node("b", CPU=4)], {"CPU": 8})
    assert "missing GPU 2" in text and "2 alive node(s) with CPU 8 in all" in text
    assert "trainer (2 x {CPU 1, GPU 1}, PACK)" in text


def test_a_bundle_no_single_node_can_hold_is_named():
    groups = [Group("rollout-0", [{"GPU": 4}], "STRICT_PACK")]
    text = shortfall(groups, groups, [node("a", GPU=2), node("b", GPU=2)], {"GPU": 4})
    assert "no single node can hold {GPU 4}" in text and "the most one node has: GPU 2" in text


def test_nodes_a_worker_must_avoid_do_not_count_and_busy_resources_are_said_so():
    avoided = Group("rollout-0", [{"CPU": 1}], "STRICT_PACK", avoid={"a"})
    assert "avoiding 1 node(s)" in shortfall([avoided], [avoided], [node("a", CPU=1)], {})
    busy = Group("reward-0", [{"CPU": 1}], "STRICT_PACK")
    text = shortfall([busy], [busy], [node("a", CPU=1)], {"CPU": 0.0})
    assert "they are in use: free now CPU 0" in text


def test_first_fit_keeps_strict_pack_on_one_node_and_spreads_spread():
    pack = Group("trainer", [{"GPU": 1}] * 4, "STRICT_PACK")
    spread = Group("spread", [{"CPU": 1}] * 2, "STRICT_SPREAD")
    assert first_fit([pack, spread], [{"GPU": 2, "CPU": 1}, {"GPU": 4, "CPU": 1}]) == [
        [1, 1, 1, 1],
        [0, 1],
    ]
    with pytest.raises(PlacementError, match="no single node can hold"):
        first_fit([Group("big", [{"GPU": 8}], "STRICT_PACK")], [{"GPU": 4}, {"GPU": 4}])


@pytest.mark.parametrize(
    "override, message",
    [
        ("ray.rollout.num_gpus=1", "a rollout server needs one GPU per tensor-parallel rank"),
        ("rollout.cpus=[0-1]", "rollout.cpus names this machine's cores"),
        ("trainer.devices=[cuda:3]", "trainer.devices: 'cuda:3' with launcher=ray"),
        ("ray.env_vars.AREAL_SECRET=x", "AREAL_* variables are set by the launcher"),
        ("ray.trainer.num_cpus=0", "ray.trainer reserves nothing"),
        ("ray.trainer_strategy=ANYWHERE", "ray.trainer_strategy='ANYWHERE' is not one of"),
    ],
)
def test_ray_options_that_cannot_work_are_refused_by_name(override, message):
    extra = (
        ["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2"]
        if "num_gpus" in override
        else []
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=["launcher=ray", *extra, override])
