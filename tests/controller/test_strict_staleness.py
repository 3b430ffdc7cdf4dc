"""The strict staleness bound's rules on ledger groups: a group's deadline is its oldest
generated token's version + eta, a group past it is expired, and batches are taken earliest
deadline first. The real-run property (staleness/max <= eta in every step record) is in
test_strict_staleness_run.py."""

from __future__ import annotations

import math

import numpy as np

from areal.controller.ledger import Ledger
from areal.controller.strict_staleness import deadline, expired, expired_groups, oldest_version
from areal.messages import FinishReason, Generated
from areal.tasks.base import Prompt, RewardOutcome, Verdict

W, R = b"rollout-1", b"reward-1"


def _group(ledger: Ledger, versions_per_sample: list[list[int] | None], score: bool = False):
    """A group of len(versions_per_sample) samples; a list of token versions generates that
    sample (scored too if `score`), None leaves it pending."""
    group = ledger.add_group(
        Prompt(prompt_id="p", text="1+1=", reference="2"),
        np.array([5, 6], np.int32),
        size=len(versions_per_sample),
        version=0,
    )
    for sample, versions in zip(group.samples, versions_per_sample, strict=True):
        if versions is None:
            continue
        ledger.pending.remove(sample)
        ledger.start_generation(sample, W, now=0.0)
        n = len(versions)
        ledger.finish_generation(
            Generated(
                request_id=sample.request_id,
                output_ids=np.arange(n, dtype=np.int32),
                logprobs=np.full(n, -0.5, np.float32),
                versions=np.array(versions, np.int32),
                finish_reason=FinishReason.STOP,
            ),
            W,
        )
        if score:
            ledger.start_scoring(sample, R)
            ledger.finish_scoring(
                sample.request_id, RewardOutcome(reward=1.0, verdict=Verdict.OK), R
            )
    return group


def test_the_deadline_is_the_oldest_generated_token_version_plus_eta():
    ledger = Ledger()
    # An interrupted sample mixes versions 3 and 5; another is wholly 4; one is still pending.
    group = _group(ledger, [[3, 3, 5, 5], [4, 4], None])
    assert oldest_version(group) == 3
    assert deadline(group, eta=2) == 5
    assert not expired(group, version=5, eta=2)  # trained at 5: tokens of 3 are 2 behind
    assert expired(group, version=6, eta=2)
    assert expired(group, version=4, eta=0) and not expired(group, version=3, eta=0)


def test_a_group_with_nothing_generated_has_no_deadline_yet():
    ledger = Ledger()
    group = _group(ledger, [None, None])
    assert oldest_version(group) is None
    assert deadline(group, eta=0) == math.inf
    assert not expired(group, version=10**6, eta=0)
    # An empty completion carries no token to be stale.
    assert oldest_version(_group(ledger, [[], [7]])) == 7


def test_expired_groups_selects_exactly_those_past_their_deadline():
    ledger = Ledger()
    fresh, edge, late = _group(ledger, [[4]]), _group(ledger, [[3]]), _group(ledger, [[2, 9]])
    assert expired_groups([fresh, edge, late], version=4, eta=1) == [late]
    assert expired_groups([fresh, edge, late], version=5, eta=1) == [edge, late]


def test_batches_are_taken_earliest_deadline_first_ties_oldest_first():
    ledger = Ledger()
    groups = [_group(ledger, [[v]], score=True) for v in (5, 2, 4, 2, 3)]
    assert list(ledger.buffer) == groups
    batch = ledger.take_batch(3, lambda g: deadline(g, eta=1))
    assert batch == [groups[1], groups[3], groups[4]]
    assert list(ledger.buffer) == [groups[0], groups[2]]
    assert ledger.trained_group_ids == [g.group_id for g in batch]
    assert ledger.take_batch(1) == [groups[0]]  # without a priority: the oldest in the buffer
