"""What polling every Ray actor's exit costs the controller, one `ray.wait` each or one in all.

    python bench/ray_poll.py [--quick] [--repeats R]

Each liveness round, the controller asks whether any worker's process has exited
(`WorkerPool.lost`). On Ray a worker's process is an actor (controller/launch/ray_pool.py),
and whether its run has ended is a `ray.wait` on its run's reference. This bench starts a
local Ray instance, makes N references that stay pending (tasks queued behind one that
sleeps, as a running actor's run stays pending), wraps each in a `RayProcess` as the pool
does, and measures one round of polling them all:

    each      `RayProcess.poll` on each in turn: one `ray.wait` per actor
    one wait  `poll_all`: one `ray.wait` over every actor's references (RayPool.exited)

in the calling thread's CPU time (`time.thread_time`: what the controller's event loop
thread pays) and in wall time, the median of `--repeats` rounds. The ratio is one wait's
against each's. The last columns price a second of a run: the rounds a second at the
automatic heartbeat interval of a run of N workers (`RunConfig.heartbeat_interval`: one
Heartbeat from each worker every N / `areal.config.HEARTBEATS_PER_S` seconds, at least 1 s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from areal.config import load_config
from areal.controller.launch.ray_pool import RayProcess, poll_all

from results_page import publish, write_results  # bench/ is on the path when run as a script

SIZES = (256, 1_024, 2_048, 4_096)
QUICK_SIZES = (64, 256)


def _processes(ray: Any, pending: Any, count: int) -> list[RayProcess]:
    """`count` placed processes whose runs (`pending()`) stay pending."""
    node = {"node_id": "n", "node_ip": "127.0.0.1", "hostname": "h", "pid": "1"}
    processes = [
        RayProcess(
            None,
            ray.put(node),  # each actor's own reference, as each actor's `where`
            pending(),
            worker_id=f"rollout-{i}",
            attempt=1,
            actor_name=f"bench:rollout-{i}",
            placement_timeout_s=3600.0,
            on_placed=lambda process: None,
            on_not_placed=lambda process: None,
        )
        for i in range(count)
    ]
    poll_all(processes)  # placed: from now on each waits on its run alone
    assert all(p.node is not None and p.returncode is None for p in processes)
    return processes


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _round(poll, processes: list[RayProcess]) -> tuple[float, float]:
    """(thread CPU s, wall s) of one round."""
    cpu, wall = time.thread_time(), time.perf_counter()
    poll(processes)
    return time.thread_time() - cpu, time.perf_counter() - wall


def _each(processes: list[RayProcess]) -> None:
    for process in processes:
        process.poll()


def measure(ray: Any, pending: Any, count: int, repeats: int) -> dict[str, float]:
    processes = _processes(ray, pending, count)
    rounds: dict[str, list[tuple[float, float]]] = {"each": [], "one": []}
    for _ in range(repeats):  # alternated, so that drift in the machine falls on both
        rounds["each"].append(_round(_each, processes))
        rounds["one"].append(_round(poll_all, processes))
    assert all(p.returncode is None for p in processes)
    result = {}
    for name, values in rounds.items():
        result[f"{name}_cpu_ms"] = statistics.median(cpu for cpu, _ in values) * 1e3
        result[f"{name}_wall_ms"] = statistics.median(wall for _, wall in values) * 1e3
    workers = [f"rollout.num_workers={count - 1}", "reward.num_workers=0"]  # and one trainer
    result["rounds_per_s"] = 1.0 / load_config(overrides=workers).heartbeat_interval()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small sizes, three rounds")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    import ray

    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = 3 if args.quick else args.repeats
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        hold = ray.remote(num_cpus=1)(_sleep)
        hold.remote(3600)  # takes the one CPU: every later task stays queued
        rows, data = [], []
        for count in sizes:
            r = measure(ray, lambda: hold.remote(3600), count, repeats)
            data.append({"actors": count, **r})
            rows.append(_row(count, r))
            print(rows[-1], file=sys.stderr)
    finally:
        ray.shutdown()
    header = (
        f"{'actors':>7} {'each ms':>8} {'one ms':>7} {'ratio':>6} {'each wall':>9} "
        f"{'one wall':>8} {'ratio':>6} {'each ms/s':>9} {'one ms/s':>8}"
    )
    table = "\n".join([header, "-" * len(header), *rows]) + (
        "\n(one liveness round's polling of every actor's exit: the calling thread's CPU "
        "milliseconds (ms) and wall milliseconds, `RayProcess.poll` on each (each) or one "
        f"`ray.wait` over all (one); medians of {repeats} rounds; ms/s: CPU milliseconds a "
        "second of a run at the automatic heartbeat interval)"
    )
    print(table)
    if publish(args.quick):
        write_results(
            "ray_poll",
            title="Polling Ray actors' exits: one ray.wait each or one in all",
            command=" ".join(["python", *sys.argv]),
            table=table,
            data=data,
        )
    return 0


def _row(count: int, r: dict[str, float]) -> str:
    return (
        f"{count:>7,} {r['each_cpu_ms']:>8.2f} {r['one_cpu_ms']:>7.2f} "
        f"{r['one_cpu_ms'] / r['each_cpu_ms']:>6.3f} {r['each_wall_ms']:>9.2f} "
        f"{r['one_wall_ms']:>8.2f} {r['one_wall_ms'] / r['each_wall_ms']:>6.3f} "
        f"{r['each_cpu_ms'] * r['rounds_per_s']:>9.2f} {r['one_cpu_ms'] * r['rounds_per_s']:>8.2f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
