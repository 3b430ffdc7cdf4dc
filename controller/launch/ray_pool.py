"""A WorkerPool whose workers are Ray actors (actor.py) in the run's placement groups.

    spawn(kind, index, rank)  an actor in its bundle (placement.py) -> where() -> run(...):
                              `python -m areal.workers.<kind> --connect <controller>` on
                              that node, credentials in its environment only
    RayProcess.poll()         None while the actor runs; the worker's exit code when it
                              exits; -9 when the actor or its node died (ray.kill, node
                              lost); 1 when it could not be placed within
                              ray.placement_timeout_s (the reason goes to its log)
    RayPool.exited()          every actor polled at once: one ray.wait over all of them

The controller's liveness loop sees these exits as it sees a local process's, re-queues
the worker's work and calls `start` (`spawn`) again: the replacement goes into the same
bundle, which Ray moves to a node with free resources when its node was lost. A worker
that failed (exited non-zero or died, its node alive, not killed by the controller)
ray.max_failures_per_node times on one node is placed elsewhere from then on, with the
reason in the log; the controller's own limit (trainers.MAX_RESTARTS deaths in a row)
still ends a crash loop.
Every placement is appended to <run_dir>/logs/placements.jsonl (worker, attempt, actor
name, node), which is how a person or a test finds where a worker runs.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections import Counter
from pathlib import Path
from collections.abc import Collection, Iterable
from typing import Any

from areal import clock
from areal.config import RunConfig
from areal.controller.launch.placement import Placement
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.messages import REJOIN_EXIT_CODE, WorkerKind

log = logging.getLogger(__name__)

DIED = -9
"""RayProcess exit code of a worker whose actor or node died."""
NOT_PLACED = 1
"""RayProcess exit code of a worker that was not placed within ray.placement_timeout_s."""


class RayProcess:
    """One worker actor seen through the `Popen` methods the pool and controller use."""

    def __init__(
        self,
        actor: Any,
        where: Any,
        run: Any,
        *,
        worker_id: str,
        attempt: int,
        actor_name: str,
        placement_timeout_s: float,
        on_placed,
        on_not_placed,
    ) -> None:
        self.actor, self._where, self._run = actor, where, run
        self.worker_id, self.attempt, self.actor_name = worker_id, attempt, actor_name
        self.node: dict[str, str] | None = None
        """actor.where() once the actor runs: node_id, node_ip, hostname, pid, gpus."""
        self.returncode: int | None = None
        self.killed = False
        """The controller killed it (not a failure of the worker)."""
        self.node_lost = False
        self._deadline = clock.now() + placement_timeout_s
        self._on_placed, self._on_not_placed = on_placed, on_not_placed

    @property
    def pid(self) -> int:
        return int(self.node["pid"]) if self.node else 0

    def poll(self) -> int | None:
        poll_all([self])
        return self.returncode

    def pending(self) -> list[Any]:
        """The references whose completion changes what `poll` says: the actor's placement
        (until it is placed) and its run; none once it has exited."""
        if self.returncode is not None:
            return []
        return [self._run] if self.node is not None else [self._where, self._run]

    def update(self, ready: Collection[Any]) -> int | None:
        """What `poll` says, given which of `pending()`'s references are done (`ready`):
        one `ray.wait` can answer for many actors (`poll_all`)."""
        import ray

        if self.returncode is not None:
            return self.returncode
        if self.node is None:
            if self._where in ready:
                try:
                    self.node = ray.get(self._where)
                except ray.exceptions.RayError:
                    return self._died()
                self._on_placed(self)
            elif clock.now() > self._deadline:
                self._on_not_placed(self)
                self.kill()
                self.returncode = NOT_PLACED
                return self.returncode
        if self._run in ready:
            try:
                self.returncode = int(ray.get(self._run))
            except ray.exceptions.RayError:
                return self._died()
        return self.returncode

    def _died(self) -> int:
        from areal.controller.launch.placement import alive_nodes

        if self.node is not None:
            self.node_lost = self.node["node_id"] not in {n["node_id"] for n in alive_nodes()}
        self.returncode = DIED
        return self.returncode

    def kill(self) -> None:
        import ray

        self.killed = True
        ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if timeout is not None and deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.actor_name, timeout)
            time.sleep(0.05)
        return code

    def failed_on_its_node(self) -> bool:
        """It exited with an error or died while its node lives, and nobody killed it."""
        return (
            self.returncode not in (None, 0, REJOIN_EXIT_CODE)
            and self.node is not None
            and not self.killed
            and not self.node_lost
        )


def poll_all(processes: Iterable[RayProcess]) -> None:
    """`poll` each of `processes` with one `ray.wait` over all their references: the
    liveness loop polls every worker each round, and a `ray.wait` costs the controller's
    thread a fixed price many times what each reference adds to it, so one call for
    thousands of actors costs a small fraction of one call each (bench/ray_poll.py)."""
    import ray

    running = [p for p in processes if p.returncode is None]
    refs = [ref for p in running for ref in p.pending()]  # each from its own remote call
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
    for process in running:
        process.update(ready)


class RayPool(WorkerPool):
    """Starts each worker as an actor in its placement-group bundle; the rest is WorkerPool."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        address: str,
        secret: str | None,
        keys_text: str | None,
        placement: Placement,
        keys_dir: Path | None = None,
    ) -> None:
        super().__init__(cfg, run_dir, address, secret, keys_dir)
        self.keys_text = keys_text
        """CurveZMQ client keys as text (areal.auth.client_keys_text), or None."""
        self.placement = placement
        self.failures: Counter[tuple[str, str]] = Counter()
        """(worker id, node id) -> failures of that worker on that node."""
        self.attempts: Counter[str] = Counter()
        self._actor_cls: Any = None

    async def start(self, kind: WorkerKind, index: int, rank: int = 0) -> WorkerHandle:
        """`spawn` on the loop: creating an actor and calling it return at once (Ray places
        it in the background; `RayProcess` follows it)."""
        return self.spawn(kind, index, rank)

    def spawn(self, kind: WorkerKind, index: int, rank: int = 0) -> WorkerHandle:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from areal.controller.launch.actor import WorkerActor

        worker_id = f"{kind.value}-{index}"
        handle = self.expected.get(worker_id) or WorkerHandle(
            worker_id=worker_id, kind=kind, rank=rank
        )
        if isinstance(handle.process, RayProcess):
            self._count_failure(handle.process, kind, index)
        if self._actor_cls is None:
            self._actor_cls = ray.remote(WorkerActor)
        actor_cls: Any = self._actor_cls
        self.attempts[worker_id] += 1
        attempt = self.attempts[worker_id]
        pg, bundle = self.placement.target(kind, index)
        resources = self._resources(kind)
        name = f"{self.placement.run_name}:{worker_id}:{attempt}"
        actor = actor_cls.options(
            name=name,
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            memory=int(resources.memory_gb * 2**30) or None,
            resources=dict(resources.resources) or None,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle),
            runtime_env={"env_vars": self._public_env(kind)},
        ).remote()
        where = actor.where.remote()
        run = actor.run.remote(
            kind.value,
            ["--connect", self.address, "--worker-id", worker_id, "--rank", str(rank)],
            self._secret_env(),
            str(self.run_dir / "logs" / f"{worker_id}.log"),
        )
        handle.process = RayProcess(
            actor,
            where,
            run,
            worker_id=worker_id,
            attempt=attempt,
            actor_name=name,
            placement_timeout_s=self.cfg.ray.placement_timeout_s,
            on_placed=self._placed,
            on_not_placed=self._not_placed,
        )
        handle.ready, handle.identity, handle.last_seen = False, None, clock.now()
        self.expected[worker_id] = handle
        log.info("started %s as Ray actor %s (attempt %d)", worker_id, name, attempt)
        return handle

    def _resources(self, kind: WorkerKind):
        return {
            WorkerKind.ROLLOUT: self.cfg.ray.rollout,
            WorkerKind.REWARD: self.cfg.ray.reward,
            WorkerKind.TRAINER: self.cfg.ray.trainer,
        }[kind]

    def _public_env(self, kind: WorkerKind) -> dict[str, str]:
        """The actor's runtime environment: nothing secret (Ray's dashboard shows it)."""
        threads = {
            WorkerKind.ROLLOUT: self.cfg.rollout.threads,
            WorkerKind.TRAINER: self.cfg.trainer.threads,
        }.get(kind, 1)
        env = {
            "PYTHONUNBUFFERED": "1",
            "AREAL_LOG_LEVEL": self.cfg.logging.level,
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
        }
        if self.cfg.ray.network_interface:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = self.cfg.ray.network_interface
        env.update(self.cfg.ray.env_vars)
        return env

    def _secret_env(self) -> dict[str, str]:
        """Credentials, for the worker process's environment alone (an argument of run)."""
        from areal.auth import KEYS_TEXT_ENV
        from areal.workers.base import SECRET_ENV

        env = {}
        if self.secret is not None:
            env[SECRET_ENV] = self.secret
        if self.keys_text is not None:
            env[KEYS_TEXT_ENV] = self.keys_text
        return env

    def exited(self) -> list[WorkerHandle]:
        """As WorkerPool's, every actor polled in one `ray.wait` (`poll_all`)."""
        actors = [
            (h, h.process) for h in self.expected.values() if isinstance(h.process, RayProcess)
        ]
        poll_all(process for _, process in actors)
        return [h for h, process in actors if process.returncode is not None]

    # -- per-node failures --------------------------------------------------------------------

    def _count_failure(self, previous: RayProcess, kind: WorkerKind, index: int) -> None:
        previous.poll()
        if not previous.failed_on_its_node() or previous.node is None:
            return
        node = previous.node["node_id"]
        self.failures[previous.worker_id, node] += 1
        count = self.failures[previous.worker_id, node]
        limit = self.cfg.ray.max_failures_per_node
        if count < limit:
            return
        if kind is WorkerKind.TRAINER and any(
            h.process is not None and h.process.poll() is None
            for h in self.expected.values()
            if h.kind is WorkerKind.TRAINER
        ):
            return  # its group is made again once no rank runs in it
        reason = (
            f"{previous.worker_id} failed {count} times on node {node} "
            f"({previous.node['node_ip']}; last exit code {previous.returncode}, see "
            f"{self.run_dir / 'logs' / (previous.worker_id + '.log')} there): not starting "
            "it on that node again (ray.max_failures_per_node)"
        )
        log.warning(reason)
        self._note(previous.worker_id, reason)
        self.placement.avoid(kind, index, node)

    # -- records ------------------------------------------------------------------------------

    def _placed(self, process: RayProcess) -> None:
        node = process.node or {}
        log.info(
            "%s runs on node %s (%s, GPUs %r)",
            process.worker_id,
            node.get("node_id"),
            node.get("node_ip"),
            node.get("gpus"),
        )
        self._append_placement(
            {
                "worker_id": process.worker_id,
                "attempt": process.attempt,
                "actor": process.actor_name,
                **node,
            }
        )

    def _not_placed(self, process: RayProcess) -> None:
        kind, index = _kind_index(process.worker_id)
        reason = (
            f"{process.worker_id} (attempt {process.attempt}) was not placed within "
            f"ray.placement_timeout_s={self.cfg.ray.placement_timeout_s:g}: "
            f"{self.placement.describe_wait(kind, index)}"
        )
        log.error(reason)
        self._note(process.worker_id, reason)

    def _note(self, worker_id: str, text: str) -> None:
        """A line in the worker's log on the controller's node (where a RunFailed points)."""
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{worker_id}.log", "a") as out:
            out.write(f"[launcher] {text}\n")

    def _append_placement(self, record: dict[str, Any]) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "placements.jsonl", "a") as out:
            out.write(json.dumps({"time": time.time(), **record}) + "\n")

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers to exit after Shutdown, kill the rest, release the groups."""
        super().stop_all(timeout_s)
        self.placement.remove()


def _kind_index(worker_id: str) -> tuple[WorkerKind, int]:
    kind, _, index = worker_id.rpartition("-")
    return WorkerKind(kind), int(index)
