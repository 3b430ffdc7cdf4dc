"""The strict staleness bound (`staleness.strict`): held where a batch is consumed.

Admission (areal.algorithms.staleness) lets generation run at most eta batches ahead of
training, counting trajectories. That bounds staleness only if batches are consumed in
admission order, and they are not: the buffer fills in completion order, so a long
completion admitted early is trained in a later batch than its slot, with tokens more than
eta versions old (the default run, eta=2, trained tokens 4 versions old). With `strict` on,
the controller also holds every trained token to

    version being trained - version that sampled the token <= eta.

A training group's *deadline* is the last version that may train it: the oldest version
among the tokens generated for it so far, plus eta. The controller

- takes each batch earliest deadline first (`deadline`): of the complete groups in the
  buffer, those closest to their deadline are trained first, fresher ones wait;
- drops a group whose deadline has passed (`expired`) as soon as it can know: when one of
  its samples comes back with too old a token, and when the version advances. It can then
  never be trained; the shared drop mechanism cancels its generations, frees its slots (so
  admission replaces it) and counts it (`rollout/dropped_groups/stale`), with its tokens
  (`rollout/dropped_tokens`); the trainer's longer wait shows in `perf/train_wait_s`.

Samples still generating are not judged: their tokens' versions are known when they return.
Pure functions of ledger groups; the controller decides when to call them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from areal.types import PROMPT_VERSION
from areal.controller.ledger import Group

STALE = "stale"
"""The drop reason of a group that can no longer be trained within the bound."""


def oldest_version(group: Group) -> int | None:
    """Oldest policy version among the tokens generated for `group` so far; None if none."""
    versions = [
        t.oldest_version() for s in group.samples if s.is_generated for t in s.trajectories()
    ]
    versions = [v for v in versions if v != PROMPT_VERSION]  # an empty completion: no tokens
    return min(versions) if versions else None


def deadline(group: Group, eta: int) -> float:
    """The last policy version that may train `group` (inf while none of it is generated)."""
    oldest = oldest_version(group)
    return math.inf if oldest is None else oldest + eta


def expired(group: Group, version: int, eta: int) -> bool:
    """True if training at `version` or later would break the bound for `group`."""
    return deadline(group, eta) < version


def expired_groups(groups: Iterable[Group], version: int, eta: int) -> list[Group]:
    """The groups among `groups` that can no longer be trained within the bound."""
    return [g for g in groups if expired(g, version, eta)]
