"""A real multi-node Ray cluster on this machine: for trying launcher=ray, its tests and
bench/launchers.py.

Ray's own cluster utilities start a head node (no CPUs: nothing runs there, so that killing
another node never kills the driver's own) and worker nodes with their own resources, as
separate raylet processes. Every address stays on loopback: nodes bind 127.0.0.1, and
drivers are told not to swap 127.0.0.1 for the machine's address (Ray does so unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which only matters on a one-machine cluster).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
"""For every process that joins the cluster (drivers, controllers)."""
OBJECT_STORE = 80 << 20
"""Per node (Ray's minimum is 75 MiB); the runs here pass no objects through it."""


def keep_ray_on_loopback() -> None:
    """Make this process's Ray leave 127.0.0.1 as it is (before ray.init): Ray otherwise
    replaces it by the machine's address, for nodes, drivers and the addresses they join.
    This is what Ray does itself where it supports one machine only (macOS, Windows)."""
    os.environ.update(LOOPBACK_ENV)
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # read where Ray resolves 127.0.0.1


@contextlib.contextmanager
def local_cluster(nodes: list[dict]) -> Iterator:
    """A running cluster with one worker node per entry of `nodes` (add_node arguments,
    e.g. {"num_cpus": 1}); this process is connected to it as a driver."""
    keep_ray_on_loopback()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=0,
            node_ip_address="127.0.0.1",
            include_dashboard=False,
            object_store_memory=OBJECT_STORE,
        ),
    )
    try:
        for args in nodes:
            cluster.add_node(node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE, **args)
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address, namespace="areal", log_to_driver=False, configure_logging=False
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
