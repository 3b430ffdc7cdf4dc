"""The controller's policy for failed weight loads (controller/weight_retry.py): one retry per
reported failure, paced by the liveness tick; a worker that fails MAX_FAILURES times in a row
is lost; any successful load forgets the failures."""

from __future__ import annotations

from areal.controller.weight_retry import MAX_FAILURES, WeightRetries


def test_each_failure_is_retried_once():
    retries = WeightRetries()
    retries.failed("rollout-0", 7, "FileNotFoundError")
    assert [(w, f.version) for w, f in retries.due()[0]] == [("rollout-0", 7)]
    assert retries.due() == ([], [])  # no retry owed until it fails again
    retries.failed("rollout-0", 8, "FileNotFoundError")
    assert [(w, f.version) for w, f in retries.due()[0]] == [("rollout-0", 8)]
    assert retries.failing["rollout-0"].attempts == 2 and retries.num_failed == 2


def test_a_worker_failing_too_often_in_a_row_is_lost_and_a_load_forgets():
    retries = WeightRetries()
    for _ in range(MAX_FAILURES - 1):
        retries.failed("rollout-0", 3, "corrupt")
        retries.due()
    retries.loaded("rollout-0")
    assert retries.failing == {}
    for _ in range(MAX_FAILURES):
        retries.failed("rollout-1", 3, "corrupt")
    retry, lose = retries.due()
    assert retry == [] and [(w, f.attempts, f.error) for w, f in lose] == [
        ("rollout-1", MAX_FAILURES, "corrupt")
    ]
    assert retries.failing == {}
