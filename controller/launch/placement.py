"""The placement groups of a run on Ray, and why one cannot be placed.

    rollout worker i   its own group: one bundle with all its GPUs (a tensor-parallel server
                       is one process; a bundle is never split over nodes)
    reward worker i    its own group: one bundle
    trainer ranks      one group of trainer.num_ranks bundles (ray.trainer_strategy), reserved
                       all at once, so a trainer group is never half placed and left waiting
                       in its rendezvous; rank r runs in bundle r

Groups are reserved before any worker starts (`reserve`), and a placement that cannot be
satisfied within ray.placement_timeout_s fails the run with the resources it lacks
(`shortfall`), instead of leaving actors pending forever. A bundle stays reserved while its
worker is replaced, so a restart after a crash starts at once; when a node is lost, Ray
places the group's bundles again on nodes with free resources, and the replacement starts
there. A worker that failed too often on one node gets a group that avoids that node
(`avoid`: a node-id label selector). Kinds in controller.remote_kinds are not placed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from areal.config import RunConfig
from areal.messages import WorkerKind

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(ValueError):
    """Resources a run needs are not in the cluster (or not free) within the timeout."""


@dataclass
class Group:
    """One placement group as requested: what it holds and where it may not go."""

    name: str
    bundles: list[dict[str, float]]
    strategy: str
    avoid: set[str] = field(default_factory=set)
    """Node ids its bundles may not be placed on."""
    pg: Any = None


def requested_groups(cfg: RunConfig) -> dict[tuple[WorkerKind, int], Group]:
    """The groups of `cfg`'s workers, by (kind, index); trainer ranks share index 0's."""
    remote = set(cfg.controller.remote_kinds)
    groups: dict[tuple[WorkerKind, int], Group] = {}
    for kind, count, resources in (
        (WorkerKind.ROLLOUT, cfg.rollout.num_workers, cfg.ray.rollout),
        (WorkerKind.REWARD, cfg.reward.num_workers, cfg.ray.reward),
    ):
        if kind.value in remote:
            continue
        for index in range(count):
            groups[kind, index] = Group(
                f"{kind.value}-{index}", [resources.bundle()], "STRICT_PACK"
            )
    if "trainer" not in remote:
        groups[WorkerKind.TRAINER, 0] = Group(
            "trainer", [cfg.ray.trainer.bundle()] * cfg.trainer.num_ranks, cfg.ray.trainer_strategy
        )
    return groups


class Placement:
    """Creates, waits for, re-creates and removes the run's placement groups (Ray calls)."""

    def __init__(self, cfg: RunConfig, run_name: str) -> None:
        self.cfg = cfg
        self.run_name = run_name
        self.groups = requested_groups(cfg)

    def key(self, kind: WorkerKind, index: int) -> tuple[WorkerKind, int]:
        return (kind, 0) if kind is WorkerKind.TRAINER else (kind, index)

    def target(self, kind: WorkerKind, index: int) -> tuple[Any, int]:
        """(placement group, bundle index) of worker `index` (a trainer rank) of `kind`."""
        group = self.groups[self.key(kind, index)]
        return group.pg, index if kind is WorkerKind.TRAINER else 0

    def reserve(self) -> None:
        """Create every group and wait until all are placed; PlacementError naming what is
        missing after ray.placement_timeout_s (and nothing stays reserved)."""
        import ray

        for group in self.groups.values():
            self._create(group)
        refs = {group.pg.ready(): group for group in self.groups.values()}
        timeout = self.cfg.ray.placement_timeout_s
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        if pending:
            waiting = [refs[ref] for ref in pending]
            message = shortfall(
                list(self.groups.values()), waiting, alive_nodes(), ray.available_resources()
            )
            self.remove()
            raise PlacementError(
                f"cannot place the run's workers within "
                f"ray.placement_timeout_s={timeout:g}: {message}"
            )

    def avoid(self, kind: WorkerKind, index: int, node_id: str) -> None:
        """From now on place `kind` `index` off `node_id`: its group is made again (a trainer
        group only once none of its ranks runs: the caller's business)."""
        group = self.groups[self.key(kind, index)]
        group.avoid.add(node_id)
        self._remove(group)
        self._create(group)

    def ready(self, kind: WorkerKind, index: int) -> bool:
        """Whether the group of `kind` `index` holds all its bundles now."""
        from ray.util import placement_group_table

        pg = self.groups[self.key(kind, index)].pg
        return placement_group_table(pg).get("state") == "CREATED"

    def describe_wait(self, kind: WorkerKind, index: int) -> str:
        """Why the group of `kind` `index` is not placed (for a replacement that waits)."""
        import ray

        group = self.groups[self.key(kind, index)]
        return shortfall(
            list(self.groups.values()), [group], alive_nodes(), ray.available_resources()
        )

    def remove(self) -> None:
        for group in self.groups.values():
            self._remove(group)

    def _create(self, group: Group) -> None:
        from ray.util import placement_group

        selector = None
        if group.avoid:
            selector = [{NODE_ID_LABEL: f"!in({','.join(sorted(group.avoid))})"}] * len(
                group.bundles
            )
        group.pg = placement_group(
            group.bundles,
            strategy=group.strategy,
            name=f"{self.run_name}:{group.name}",
            bundle_label_selector=selector,
        )

    def _remove(self, group: Group) -> None:
        from ray.util import remove_placement_group

        if group.pg is not None:
            remove_placement_group(group.pg)
            group.pg = None


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's alive nodes: {node_id, address, resources (totals)}."""
    import ray

    return [
        {
            "node_id": n["NodeID"],
            "address": n.get("NodeManagerAddress", "?"),
            "resources": dict(n.get("Resources", {})),
        }
        for n in ray.nodes()
        if n.get("Alive")
    ]


def _fmt(resources: Mapping[str, float]) -> str:
    def amount(name: str, value: float) -> str:
        if name == "memory":
            return f"memory {value / 2**30:g} GiB"
        return f"{name} {value:g}"

    shown = {
        k: v
        for k, v in resources.items()
        if not k.startswith("node:") and k != "object_store_memory"
    }
    return ", ".join(amount(k, v) for k, v in sorted(shown.items())) or "nothing"


def shortfall(
    groups: list[Group],
    waiting: list[Group],
    nodes: list[dict[str, Any]],
    available: dict[str, float],
) -> str:
    """What keeps `waiting` (some of `groups`) from being placed on `nodes`: resources the
    whole cluster lacks, bundles no single node can hold, or resources in use."""
    totals: Counter[str] = Counter()
    for node in nodes:
        totals.update(node["resources"])
    needed: Counter[str] = Counter()
    for group in groups:
        for bundle in group.bundles:
            needed.update(bundle)
    what = "; ".join(
        f"{g.name} ({len(g.bundles)} x {{{_fmt(g.bundles[0])}}}, {g.strategy}"
        + (f", avoiding {len(g.avoid)} node(s)" if g.avoid else "")
        + ")"
        for g in waiting
    )
    missing = {
        name: needed[name] - totals[name] for name in needed if needed[name] > totals[name] + 1e-9
    }
    cluster = f"{len(nodes)} alive node(s) with {_fmt(dict(totals))} in all"
    if missing:
        return (
            f"waiting for {what}; missing {_fmt(missing)} (the run needs "
            f"{_fmt(dict(needed))}; the cluster has {cluster}). Add nodes with these "
            "resources, or ask for less (ray.rollout/reward/trainer.*)"
        )
    for group in waiting:
        usable = [n for n in nodes if n["node_id"] not in group.avoid]
        for bundle in group.bundles:
            if not any(
                all(n["resources"].get(k, 0) >= v for k, v in bundle.items()) for n in usable
            ):
                largest = {
                    k: max((n["resources"].get(k, 0) for n in usable), default=0) for k in bundle
                }
                return (
                    f"waiting for {what}; no single node can hold {{{_fmt(bundle)}}} "
                    f"(the most one node has: {_fmt(largest)}; {cluster})"
                )
        if group.strategy == "STRICT_SPREAD" and len(group.bundles) > len(usable):
            return (
                f"waiting for {what}; STRICT_SPREAD needs {len(group.bundles)} nodes, "
                f"{len(usable)} usable"
            )
    return (
        f"waiting for {what}; the cluster has the resources ({cluster}) but they are in "
        f"use: free now {_fmt(available)}"
    )


def first_fit(groups: list[Group], nodes: list[dict[str, float]]) -> list[list[int]]:
    """Where `groups` could go on nodes with these total resources, bundle by bundle (node
    indices), placing each group as its strategy says, first fit; PlacementError with the
    shortfall when one does not fit. A check of a config against a cluster's shape (Ray's
    own scheduler decides for real, and may find placements first fit misses)."""
    free = [dict(node) for node in nodes]
    plan: list[list[int]] = []

    def fits(node: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
        return all(node.get(k, 0) >= v - 1e-9 for k, v in bundle.items())

    def take(index: int, bundle: Mapping[str, float]) -> None:
        for k, v in bundle.items():
            free[index][k] = free[index].get(k, 0) - v

    for group in groups:
        spots: list[int] = []
        if group.strategy == "STRICT_PACK":
            total: dict[str, float] = {}
            for bundle in group.bundles:
                for k, v in bundle.items():
                    total[k] = total.get(k, 0) + v
            node = next((i for i, n in enumerate(free) if fits(n, total)), None)
            if node is not None:
                take(node, total)
                spots = [node] * len(group.bundles)
        else:
            for bundle in group.bundles:
                avoid = set(spots) if group.strategy in ("SPREAD", "STRICT_SPREAD") else set()
                order = [i for i in range(len(free)) if i not in avoid] + (
                    [i for i in range(len(free)) if i in avoid]
                    if group.strategy == "SPREAD"
                    else []
                )
                node = next((i for i in order if fits(free[i], bundle)), None)
                if node is None:
                    spots = []
                    break
                take(node, bundle)
                spots.append(node)
        if len(spots) != len(group.bundles):
            described = [
                {"node_id": str(i), "address": "-", "resources": n} for i, n in enumerate(nodes)
            ]
            raise PlacementError(shortfall(groups, [group], described, {}))
        plan.append(spots)
    return plan
