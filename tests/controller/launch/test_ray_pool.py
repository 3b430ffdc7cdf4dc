"""The Ray pool's per-node retry bound, around stand-ins for Ray's actors (unit tests: the
real actors, nodes and placement groups are exercised in test_ray_runtime.py)."""

from __future__ import annotations

from pathlib import Path

from areal.config import load_config
from areal.controller.launch.ray_pool import RayPool, RayProcess
from areal.messages import WorkerKind


class FakePlacement:
    run_name = "run"

    def __init__(self) -> None:
        self.avoided: list[tuple[WorkerKind, int, str]] = []

    def avoid(self, kind: WorkerKind, index: int, node_id: str) -> None:
        self.avoided.append((kind, index, node_id))


def ended(code: int, node: str = "n1", *, killed: bool = False, node_lost: bool = False):
    process = RayProcess.__new__(RayProcess)
    process.worker_id, process.returncode, process.killed = "rollout-0", code, killed
    process.node_lost = node_lost
    process.node = {"node_id": node, "node_ip": "10.0.0.1", "pid": "1", "gpus": ""}
    return process


def pool(tmp_path: Path) -> tuple[RayPool, FakePlacement]:
    cfg = load_config(overrides=["launcher=ray", "ray.max_failures_per_node=2"])
    placement = FakePlacement()
    return RayPool(cfg, tmp_path, "tcp://127.0.0.1:1", "s", None, placement), placement


def test_a_worker_failing_twice_on_a_node_is_placed_off_it_with_the_reason_logged(tmp_path):
    ray_pool, placement = pool(tmp_path)
    ray_pool._count_failure(ended(2), WorkerKind.ROLLOUT, 0)
    assert placement.avoided == []
    ray_pool._count_failure(ended(2), WorkerKind.ROLLOUT, 0)
    assert placement.avoided == [(WorkerKind.ROLLOUT, 0, "n1")]
    note = (tmp_path / "logs" / "rollout-0.log").read_text()
    assert "rollout-0 failed 2 times on node n1" in note and "last exit code 2" in note


def test_kills_lost_nodes_clean_exits_and_other_nodes_are_not_counted(tmp_path):
    ray_pool, placement = pool(tmp_path)
    for process in (
        ended(-9, killed=True),
        ended(-9, node_lost=True),
        ended(0),
        ended(75),
        ended(2, "n2"),
        ended(2, "n3"),
    ):
        ray_pool._count_failure(process, WorkerKind.ROLLOUT, 0)
    assert placement.avoided == []
    assert ray_pool.failures == {("rollout-0", "n2"): 1, ("rollout-0", "n3"): 1}
