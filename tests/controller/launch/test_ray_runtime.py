"""launcher=ray on a real local Ray cluster: a head and four one-CPU worker nodes, so that
the default job's three workers land on three different nodes and one node is spare.

One run (the letter task, which a random tiny model learns in a few steps) is hurt twice:
the node of its rollout worker is removed from the cluster mid-run, then its reward
worker's actor is killed through Ray. The tests below read what it recorded: where each
worker ran (logs/placements.jsonl), that it learnt, that every prompt group was trained
exactly once (the step records' draw positions), and that the replacements ran on nodes
that survived. The run's shared secret is given in a 0600 config file and looked for
where it must not be. A second controller asks for a GPU the cluster lacks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from areal.records import read_records
from cli_runs import HERE, last_step, letter_overrides, log_tail, start, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SECRET = "ray-test-secret-5f1c0a7e"


def placements(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "placements.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def placed(run_dir: Path, worker_id: str, attempt: int) -> dict | None:
    return next(
        (p for p in placements(run_dir) if p["worker_id"] == worker_id and p["attempt"] == attempt),
        None,
    )


def registered(log: Path, worker_id: str, times: int) -> bool:
    return log.read_text().count(f"{worker_id} registered") >= times


@pytest.fixture(scope="module")
def cluster():
    from areal.controller.launch.local_cluster import local_cluster

    with local_cluster([{"num_cpus": 1}] * 4) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def hurt_run(cluster, tiny_model_dir, tmp_path_factory):
    import ray

    tmp = tmp_path_factory.mktemp("ray-run")
    run_dir, log, config = tmp / "run", tmp / "controller.log", tmp / "secret.yaml"
    config.write_text(f"controller:\n  secret: {SECRET}\n")
    config.chmod(0o600)
    args = [
        "--config",
        str(config),
        *letter_overrides(
            run_dir,
            tiny_model_dir,
            "launcher=ray",
            f"ray.address={cluster.address}",
            "trainer.total_steps=200",
            "ray.placement_timeout_s=60",
            f"ray.env_vars.PYTHONPATH={HERE}",
        ),
    ]
    proc = start(args, log)
    try:
        wait_for(lambda: last_step(run_dir) >= 2, 300, "step 2", proc)
        first = {w: placed(run_dir, w, 1) for w in ("rollout-0", "reward-0", "trainer-0")}
        killed = next(n for n in cluster.worker_nodes if n.node_id == first["rollout-0"]["node_id"])
        cluster.remove_node(killed)
        wait_for(lambda: registered(log, "rollout-0", 2), 240, "a new rollout worker", proc)
        step = last_step(run_dir)
        wait_for(lambda: last_step(run_dir) >= step + 2, 240, "two steps after it", proc)
        ray.kill(ray.get_actor(first["reward-0"]["actor"], namespace="areal"))
        wait_for(lambda: registered(log, "reward-0", 2), 240, "a new reward worker", proc)
        step = last_step(run_dir)
        wait_for(lambda: last_step(run_dir) >= step + 2, 240, "two steps after it", proc)
        processes = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(240)
    except BaseException:
        proc.kill()
        print(log_tail(log))
        raise
    return {
        "run_dir": run_dir,
        "log": log,
        "code": code,
        "first": first,
        "killed_node": killed.node_id,
        "command_lines": processes,
        "session_dir": Path(cluster.head_node.get_session_dir_path()),
    }


def test_the_workers_are_spread_over_the_nodes_and_the_job_learns(hurt_run):
    assert hurt_run["code"] == 128 + signal.SIGTERM, log_tail(hurt_run["log"])
    nodes = {p["node_id"] for p in hurt_run["first"].values()}
    assert len(nodes) == 3  # one CPU per node, one CPU per worker
    kept = read_records(hurt_run["run_dir"])
    (summary,) = [r for r in kept if r["kind"] == "summary"]
    evals = [r for r in kept if r["kind"] == "eval"]
    assert evals[-1]["eval/pass@1"] > evals[0]["eval/pass@1"]
    assert summary["final_version"] == max(r["step"] for r in kept if r["kind"] == "step")


def test_a_lost_node_and_a_killed_actor_lose_and_repeat_no_prompt_group(hurt_run):
    kept = read_records(hurt_run["run_dir"])
    steps = [r for r in kept if r["kind"] == "step"]
    (summary,) = [r for r in kept if r["kind"] == "summary"]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    trained = [p for r in steps for p in r["rollout/trained_positions"]]
    dropped = [p for r in steps for p in r["rollout/dropped_positions"]]
    dropped += summary["rollout/dropped_positions"]
    assert len(trained) == len(set(trained)) == 2 * len(steps)  # batch 8 = 2 groups of 4
    assert sorted(trained + dropped + summary["untrained_positions"]) == list(
        range(summary["num_drawn"])
    )
    lost = [r["worker_id"] for r in kept if r.get("event") == "worker_lost"]
    assert lost == ["rollout-0", "reward-0"]


def test_replacements_run_on_surviving_nodes(hurt_run, cluster):
    run_dir = hurt_run["run_dir"]
    rollout = placed(run_dir, "rollout-0", 2)
    assert rollout is not None and rollout["node_id"] != hurt_run["killed_node"]
    alive = {n.node_id for n in cluster.worker_nodes}
    assert rollout["node_id"] in alive
    reward = placed(run_dir, "reward-0", 2)
    assert reward is not None and reward["node_id"] in alive
    assert reward["actor"] != hurt_run["first"]["reward-0"]["actor"]


def test_the_secret_is_in_no_command_line_log_or_ray_record(hurt_run):
    import ray

    assert not [line for line in hurt_run["command_lines"] if SECRET in line]
    texts = [
        p
        for p in hurt_run["run_dir"].rglob("*")
        if p.is_file() and p.suffix in (".log", ".jsonl", ".yaml", ".json")
    ]
    texts += [
        p for p in hurt_run["session_dir"].rglob("*") if p.is_file() and p.stat().st_size < 50 << 20
    ]
    assert texts
    leaks = [str(p) for p in texts if SECRET.encode() in p.read_bytes()]
    assert leaks == [] and SECRET not in hurt_run["log"].read_text()
    actors = ray._private.state.actors()  # what Ray's dashboard shows of actors
    assert actors and SECRET not in json.dumps(actors, default=str)


def test_a_placement_that_cannot_be_satisfied_fails_naming_what_is_missing(
    cluster, tiny_model_dir, tmp_path
):
    env = dict(os.environ, PYTHONPATH=str(HERE))
    result = subprocess.run(
        [
            "python",
            "-m",
            "areal.controller",
            *letter_overrides(
                tmp_path / "run",
                tiny_model_dir,
                "launcher=ray",
                f"ray.address={cluster.address}",
                "ray.trainer.num_gpus=1",
                "ray.placement_timeout_s=3",
            ),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "cannot place the run's workers within ray.placement_timeout_s=3" in result.stderr
    assert "trainer (1 x {CPU 1, GPU 1}, PACK)" in result.stderr
    assert "missing GPU 1" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no worker was started
