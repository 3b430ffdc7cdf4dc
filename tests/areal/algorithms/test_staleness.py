"""Staleness admission: the docs/design.md section 5 bound at its boundaries, slot accounting, and a
random simulation of the controller's life checking the bound at every admission."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.algorithms.staleness import StalenessController

B_ETA_PAIRS = [(1, 0), (1, 3), (4, 0), (4, 1), (8, 2), (3, 5)]


def _bound_holds(num_live_after: int, batch_size: int, version: int, eta: int) -> bool:
    """The literal docs/design.md rule for the last admitted trajectory (N_r includes it)."""
    return (num_live_after - 1) // batch_size <= version + eta


def test_eta_zero_admits_exactly_one_batch_ahead_of_training():
    ctl = StalenessController(batch_size=4, eta=0)
    assert ctl.capacity(0) == 4
    ctl.admit(4, version=0)
    assert ctl.capacity(0) == 0
    with pytest.raises(ValueError, match="at most 0 may be admitted until the version advances"):
        ctl.admit(1, version=0)
    ctl.finish(4)
    ctl.consume(4)
    assert ctl.capacity(0) == 0, "training the batch is not enough; the version must advance"
    assert ctl.capacity(1) == 4
    ctl.admit(4, version=1)
    assert ctl.capacity(1) == 0 and ctl.capacity(2) == 4


@pytest.mark.parametrize(("batch_size", "eta"), B_ETA_PAIRS)
@pytest.mark.parametrize("version", [0, 1, 3])
def test_the_last_admissible_trajectory_is_the_formula_boundary(batch_size, eta, version):
    ctl = StalenessController(batch_size, eta)
    for step in range(version):  # `version` training steps, one batch each
        ctl.admit(batch_size, version=step)
        ctl.finish(batch_size)
        ctl.consume(batch_size)
    limit = (version + eta + 1) * batch_size  # largest N_r allowed at this version
    assert ctl.capacity(version) == limit - ctl.num_live == (eta + 1) * batch_size
    ctl.admit(limit - ctl.num_live - 1, version)
    assert ctl.capacity(version) == 1
    assert _bound_holds(ctl.num_live + 1, batch_size, version, eta)
    ctl.admit(1, version)
    assert not _bound_holds(ctl.num_live + 1, batch_size, version, eta)
    assert ctl.capacity(version) == 0
    with pytest.raises(ValueError, match="would break the staleness bound"):
        ctl.admit(1, version)
    assert ctl.num_live == limit, "a refused admission must change nothing"
    assert ctl.capacity(version + 1) == batch_size


@pytest.mark.parametrize(("batch_size", "eta"), B_ETA_PAIRS)
def test_capacity_is_the_largest_count_the_formula_admits(batch_size, eta):
    for version in range(4):
        for num_live in range((version + eta + 3) * batch_size):
            ctl = StalenessController(batch_size, eta)
            ctl.num_admitted = num_live  # state as if that many were generated or in flight
            brute = 0
            while _bound_holds(num_live + brute + 1, batch_size, version, eta):
                brute += 1
            assert ctl.capacity(version) == brute, (batch_size, eta, version, num_live)


def test_aborted_and_rejected_free_their_slots_but_consumed_do_not():
    ctl = StalenessController(batch_size=2, eta=1)
    ctl.admit(4, version=0)
    ctl.abort(1)  # worker lost
    assert (ctl.num_in_flight, ctl.capacity(0)) == (3, 1)
    ctl.finish(3)
    ctl.reject(1)  # filtered out, never trained on
    assert (ctl.num_buffered, ctl.capacity(0)) == (2, 2)
    ctl.consume(2)
    assert ctl.capacity(0) == 2, "consumption alone does not move the window"
    assert ctl.num_live == ctl.num_in_flight + ctl.num_buffered + ctl.num_consumed == 2


def test_impossible_transitions_are_refused_without_changing_state():
    ctl = StalenessController(batch_size=2, eta=1)
    ctl.admit(2, version=0)
    before = ctl.state_dict()
    with pytest.raises(ValueError, match="cannot finish 3 trajectories: only 2 are in flight"):
        ctl.finish(3)
    with pytest.raises(ValueError, match="cannot consume 1 trajectories: only 0 are buffered"):
        ctl.consume(1)
    with pytest.raises(ValueError, match="cannot reject 1 trajectories: only 0 are buffered"):
        ctl.reject()
    with pytest.raises(ValueError, match="n=-1 must be a non-negative int"):
        ctl.abort(-1)
    assert ctl.state_dict() == before
    ctl.admit(1, version=3)
    with pytest.raises(ValueError, match="version 2 is older than version 3"):
        ctl.capacity(2)
    with pytest.raises(ValueError, match="version=-1 must be >= 0"):
        StalenessController(2, 0).capacity(-1)
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        StalenessController(0, 1)
    with pytest.raises(ValueError, match="eta=-1 must be >= 0"):
        StalenessController(1, -1)


def test_state_dict_round_trip_and_consistency_check():
    ctl = StalenessController(batch_size=3, eta=2)
    ctl.admit(7, version=1)
    ctl.finish(5)
    ctl.abort(1)
    ctl.reject(1)
    ctl.consume(3)
    restored = StalenessController.from_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    assert restored.capacity(1) == ctl.capacity(1) == (1 + 2 + 1) * 3 - (7 - 1 - 1)
    broken = dict(ctl.state_dict(), num_consumed=9)
    with pytest.raises(ValueError, match="inconsistent staleness counters"):
        StalenessController.from_state_dict(broken)


def test_metrics_are_namespaced_counts():
    ctl = StalenessController(batch_size=2, eta=0)
    ctl.admit(2, version=0)
    ctl.finish(1)
    assert ctl.metrics(version=0) == {
        "staleness/in_flight": 1.0,
        "staleness/buffered": 1.0,
        "staleness/capacity": 0.0,
    }


@pytest.mark.parametrize("batch_size", [1, 3, 4])
@pytest.mark.parametrize("eta", [0, 1, 2, 3])
def test_greedy_in_order_generation_reaches_but_never_exceeds_eta(batch_size, eta):
    """Admit all that is allowed, finish in admission order, train FIFO: the version gap
    between admission and training is exactly bounded by eta, and eta is reached."""
    ctl = StalenessController(batch_size, eta)
    queue: deque[int] = deque()  # admission version of each trajectory, in order
    gaps = []
    for version in range(12):
        n = ctl.capacity(version)
        ctl.admit(n, version)
        queue.extend([version] * n)
        ctl.finish(ctl.num_in_flight)
        batch = [queue.popleft() for _ in range(batch_size)]
        ctl.consume(batch_size)
        gaps.extend(version - admitted for admitted in batch)
    assert max(gaps) == eta, f"gaps seen: {sorted(set(gaps))}"


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "finish", "abort", "reject", "train", "admit_max"]),
        st.integers(0, 9),
    ),
    max_size=80,
)


@given(batch_size=st.integers(1, 6), eta=st.integers(0, 4), script=ops)
@settings(max_examples=300, deadline=None)
def test_random_lifecycles_never_break_the_bound(batch_size, eta, script):
    ctl = StalenessController(batch_size, eta)
    version = 0
    for op, k in script:
        if op in ("admit", "admit_max"):
            allowed = ctl.capacity(version)
            n = allowed if op == "admit_max" else k
            if n > allowed:
                with pytest.raises(ValueError):
                    ctl.admit(n, version)
                continue
            live_before = ctl.num_live
            ctl.admit(n, version)
            for j in range(1, n + 1):  # each admitted trajectory satisfies the rule
                assert _bound_holds(live_before + j, batch_size, version, eta)
            if op == "admit_max":  # and the capacity was the maximum
                assert not _bound_holds(ctl.num_live + 1, batch_size, version, eta)
        elif op == "finish":
            ctl.finish(min(k, ctl.num_in_flight))
        elif op == "abort":
            ctl.abort(min(k, ctl.num_in_flight))
        elif op == "reject":
            ctl.reject(min(k, ctl.num_buffered))
        elif ctl.num_buffered >= batch_size:  # "train": one step consumes one batch
            ctl.consume(batch_size)
            version += 1
        assert ctl.num_in_flight >= 0 and ctl.num_buffered >= 0, ctl.state_dict()
        assert ctl.num_live == ctl.num_in_flight + ctl.num_buffered + ctl.num_consumed
        assert ctl.num_live <= (version + eta + 1) * batch_size, ctl.state_dict()
        if ctl.num_in_flight == 0 and ctl.num_buffered < batch_size:  # never deadlocked
            assert ctl.capacity(version) >= batch_size - ctl.num_buffered, ctl.state_dict()


def test_resume_starts_as_a_run_that_trained_that_many_and_holds_nothing():
    ctl = StalenessController(batch_size=4, eta=1)
    ctl.resume(12)  # 3 steps of 4 trajectories
    assert (ctl.num_live, ctl.num_in_flight, ctl.num_buffered) == (12, 0, 0)
    assert ctl.capacity(3) == (3 + 1 + 1) * 4 - 12  # the same window as at version 3
    with pytest.raises(RuntimeError, match="only for a fresh controller"):
        ctl.resume(4)
