"""launcher=ray as a controller runtime (areal.controller.runtime): join a Ray cluster,
reserve the run's placement groups, and start every worker as a Ray actor.

    prepare_run (in a thread)  ray.init(ray.address) -> the controller's address on the
                               cluster's network -> placement groups reserved (a clear
                               PlacementError, not a hang) -> the usual prepare_run
    connect                    the local runtime's ROUTER socket (+ CurveZMQ when it binds a
                               non-loopback address), with a RayPool (ray_pool.py)
    close                      socket closed, placement groups removed, Ray left (the run's
                               actors die with their owner, this process)

The controller binds `controller.host`; when that is loopback but the cluster's nodes are
not, it binds this node's Ray address instead (or that of ray.network_interface), and
`controller.auth=auto` then means CurveZMQ: the keys reach workers as text in their
environment (areal.auth.client_keys_text), the shared secret likewise, never through the
runtime environment, a command line or a log. The run directory is made absolute, so that
workers on every node name the same path (it must be storage the nodes share for disk
weight sync, checkpoints and the workers' logs; see docs/guides/cluster.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any

from areal.auth import client_keys_text
from areal.config import RunConfig, is_loopback
from areal.controller.launch.placement import Placement, alive_nodes, requested_groups
from areal.controller.launch.ray_pool import RayPool
from areal.controller.pool import WorkerPool
from areal.controller.runtime import LocalRuntime
from areal.controller.setup import RunSetup, prepare_run, resolve_run_dir

log = logging.getLogger(__name__)


class RayRuntime(LocalRuntime):
    """The local runtime's socket and credentials, with workers started as Ray actors."""

    def __init__(self) -> None:
        super().__init__()
        self.placement: Placement | None = None
        self.started_ray = False
        """This runtime called ray.init (and so calls ray.shutdown)."""

    def prepare_run(self, cfg: RunConfig) -> RunSetup:
        self._join(cfg)
        run_dir = resolve_run_dir(cfg).expanduser().absolute()
        cfg = dataclasses.replace(
            cfg,
            run_dir=str(run_dir),
            controller=dataclasses.replace(cfg.controller, host=controller_host(cfg)),
            rollout=dataclasses.replace(
                cfg.rollout,
                devices=_devices(
                    cfg.rollout.devices, cfg.ray.rollout.num_gpus, cfg.rollout.num_workers
                ),
            ),
            trainer=dataclasses.replace(
                cfg.trainer,
                devices=_devices(
                    cfg.trainer.devices, cfg.ray.trainer.num_gpus, cfg.trainer.num_ranks
                ),
            ),
        )
        self.placement = Placement(cfg, run_dir.name)
        self.placement.reserve()
        try:
            return prepare_run(cfg)
        except BaseException:
            self.placement.remove()
            raise

    def _join(self, cfg: RunConfig) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("launcher=ray needs Ray: pip install -e '.[ray]'") from None
        if ray.is_initialized():  # an application embedding the controller joined already
            return
        common: dict[str, Any] = dict(
            namespace=cfg.ray.namespace, log_to_driver=False, configure_logging=False
        )
        if cfg.ray.address is None:
            # A Ray instance of this machine only, on loopback, with logical CPUs enough for
            # the run's bundles (the local launcher reserves no cores either).
            from areal.controller.launch.local_cluster import keep_ray_on_loopback

            keep_ray_on_loopback()
            needed = sum(
                bundle.get("CPU", 0)
                for group in requested_groups(cfg).values()
                for bundle in group.bundles
            )
            ray.init(
                num_cpus=max(os.cpu_count() or 1, math.ceil(needed)),
                include_dashboard=False,
                **common,
            )
        else:
            ray.init(address=cfg.ray.address, **common)
        self.started_ray = True
        nodes = alive_nodes()
        log.info(
            "joined Ray (%d nodes: %s)",
            len(nodes),
            ", ".join(sorted({n["address"] for n in nodes})),
        )

    def make_pool(
        self,
        cfg: RunConfig,
        setup: RunSetup,
        address: str,
        secret: str | None,
        keys_dir: Path | None,
    ) -> WorkerPool:
        assert self.placement is not None, "prepare_run reserves the placement groups first"
        keys_text = client_keys_text(keys_dir) if keys_dir is not None else None
        return RayPool(cfg, setup.run_dir, address, secret, keys_text, self.placement, keys_dir)

    def closed(self) -> None:
        if self.placement is not None:
            self.placement.remove()
        if self.started_ray:
            import ray

            ray.shutdown()


def controller_host(cfg: RunConfig) -> str:
    """The address the controller binds so that every node's workers reach it."""
    if cfg.ray.network_interface:
        return interface_address(cfg.ray.network_interface)
    if not is_loopback(cfg.controller.host):
        return cfg.controller.host
    nodes = alive_nodes()
    if all(is_loopback(node["address"]) for node in nodes):
        return cfg.controller.host  # every node is on this machine
    import ray

    host = ray.util.get_node_ip_address()
    log.info(
        "controller.host=%s is loopback but the Ray nodes are not: binding %s, this "
        "node's Ray address",
        cfg.controller.host,
        host,
    )
    return host


def interface_address(name: str) -> str:
    """The IPv4 address of interface `name` on this node."""
    import socket

    import psutil

    addresses = psutil.net_if_addrs()
    if name not in addresses:
        raise ValueError(
            f"ray.network_interface={name!r} is not an interface of this node "
            f"(it has {', '.join(sorted(addresses))})"
        )
    for address in addresses[name]:
        if address.family == socket.AF_INET:
            return address.address
    raise ValueError(f"ray.network_interface={name!r} has no IPv4 address")


def _devices(devices: list[str], num_gpus: float, count: int) -> list[str]:
    """Each worker sees only the GPUs Ray gave it: the first is cuda:0."""
    if devices or not num_gpus:
        return devices
    return ["cuda:0"] * count
