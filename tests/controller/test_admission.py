"""Admission (admission.py): groups enter under the staleness bound, are logged, and leave
the window when trained or dropped; closed admission admits nothing."""

from __future__ import annotations

from decisions import Decisions, config

from areal.controller.outbox import Outbox


def test_admission_stops_at_the_bound_and_reopens_as_batches_are_consumed(tmp_path):
    run = Decisions(config(tmp_path), tmp_path)  # B=4, G=2, eta=1: (0 + 1 + 1) * 4 = 8 live
    admission = run.core.admission
    admitted = 0
    while admission.can_admit():
        run.admit(1)
        admitted += 1
    assert admitted == 4 and admission.staleness.num_live == 8
    assert [e["num_admitted"] for e in admission.log] == [2, 4, 6, 8]
    assert all(e["version"] == 0 for e in admission.log)
    for _ in range(4):
        admission.generated()
    admission.consumed(4)  # a batch trained at version 0: still capped until version 1
    assert not admission.can_admit()
    run.core.weights.version = 1  # published (weight_sync.py owns it; set here for the bound)
    assert admission.can_admit()


def test_a_dropped_group_frees_its_slots_and_a_closed_admission_admits_nothing(tmp_path):
    run = Decisions(config(tmp_path), tmp_path)
    admission = run.core.admission
    run.admit(4)
    assert not admission.can_admit()
    run.core.drop_group(run.core.ledger.groups[0], "by_test", Outbox())
    assert admission.can_admit() and admission.staleness.num_aborted == 2
    admission.close()
    assert not admission.can_admit()


def test_a_stopping_run_admits_nothing(tmp_path):
    run = Decisions(config(tmp_path), tmp_path)
    run.stopping = True
    assert not run.core.admission.can_admit()
