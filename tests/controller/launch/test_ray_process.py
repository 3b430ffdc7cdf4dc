"""RayProcess and the pool's exit polling (controller/launch/ray_pool.py) on a real local
Ray instance with real actors: one `ray.wait` a round answers for every actor, and each
reads as its own `poll` would (exited with its code, still running, not placed in time,
killed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from areal.config import load_config
from areal.controller.launch.ray_pool import DIED, NOT_PLACED, RayPool, RayProcess, poll_all
from areal.controller.pool import WorkerHandle
from areal.messages import WorkerKind

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_actor():
    """A local Ray instance and an actor class shaped as the pool's (where, run)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    class Actor:  # defined here, so that Ray ships it by value to its workers
        def where(self) -> dict[str, str]:
            return {
                "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": "127.0.0.1",
                "hostname": "local",
                "pid": str(os.getpid()),
                "gpus": "",
            }

        def run(self, code: int, delay_s: float) -> int:
            time.sleep(delay_s)
            return code

    try:
        yield ray, ray.remote(num_cpus=0)(Actor)
    finally:
        ray.shutdown()


def _process(name: str, actor, code: int, delay_s: float, events: list, timeout_s: float = 120.0):
    return RayProcess(
        actor,
        actor.where.remote(),
        actor.run.remote(code, delay_s),
        worker_id=name,
        attempt=1,
        actor_name="test",
        placement_timeout_s=timeout_s,
        on_placed=lambda p: events.append(("placed", p)),
        on_not_placed=lambda p: events.append(("not placed", p)),
    )


def _until(done, processes: list[RayProcess]) -> int:
    """poll_all each 0.1 s until `done()`; the rounds it took."""
    deadline, rounds = time.monotonic() + 120, 0
    while not done():
        assert time.monotonic() < deadline, [p.returncode for p in processes]
        poll_all(processes)
        rounds += 1
        time.sleep(0.1)
    return rounds


def test_one_ray_wait_a_round_reads_each_actor_as_its_own_poll_would(
    ray_actor, monkeypatch, tmp_path: Path
):
    ray, actor_cls = ray_actor
    events: list = []
    exits = _process("rollout-0", actor_cls.remote(), 3, 0.0, events)
    runs = _process("rollout-1", actor_cls.remote(), 0, 3600.0, events)
    unplaced = _process(
        "rollout-2", actor_cls.options(resources={"absent": 1}).remote(), 0, 0.0, events, 1.0
    )
    processes = [exits, runs, unplaced]
    waits: list[int] = []
    real_wait = ray.wait

    def counted_wait(refs, **kwargs):
        waits.append(len(refs))
        return real_wait(refs, **kwargs)

    monkeypatch.setattr(ray, "wait", counted_wait)
    rounds = _until(
        lambda: (
            exits.returncode is not None
            and unplaced.returncode is not None
            and runs.node is not None
        ),
        processes,
    )
    assert len(waits) == rounds  # one ray.wait a round, whatever the number of actors
    assert exits.returncode == 3 and exits.node is not None
    assert runs.returncode is None and runs.poll() is None
    assert unplaced.returncode == NOT_PLACED and unplaced.node is None and unplaced.killed
    assert [(what, p) for what, p in events if p is unplaced] == [("not placed", unplaced)]
    assert {p for what, p in events if what == "placed"} == {exits, runs}

    # the pool's round: every actor in one wait, the exited ones returned
    pool = RayPool(
        load_config(overrides=["launcher=ray"]), tmp_path, "tcp://127.0.0.1:1", None, None, None
    )  # type: ignore[arg-type]
    for i, process in enumerate(processes):
        pool.expected[f"rollout-{i}"] = WorkerHandle(
            worker_id=f"rollout-{i}", kind=WorkerKind.ROLLOUT, process=process
        )
    waits.clear()
    assert [h.process for h in pool.exited()] == [exits, unplaced]
    assert waits == [1]  # only the running actor's run is still asked after

    ray.kill(runs.actor, no_restart=True)  # died: not an exit of its own
    _until(lambda: runs.returncode is not None, processes)
    assert runs.returncode == DIED and not runs.node_lost and not runs.killed
    assert runs.failed_on_its_node()
    assert [h.process for h in pool.exited()] == processes
