"""The controller's garbage-collection policy (controller/collector.py)."""

from __future__ import annotations

import gc

import pytest

from areal.algorithms.staleness import StalenessController
from areal.config import RunConfig
from areal.controller.collector import collection_thresholds
from areal.sim.config import sim_config
from areal.sim.run import simulate


def test_thresholds_hold_inside_the_block_and_are_restored_after_it_even_on_error():
    before = gc.get_threshold()
    with collection_thresholds([12345, 7, 9]):
        assert gc.get_threshold() == (12345, 7, 9)
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError, match="boom"), collection_thresholds([12345, 7, 9]):
        raise RuntimeError("boom")
    assert gc.get_threshold() == before


def test_blocks_that_close_out_of_order_give_the_process_its_thresholds_back():
    # Two controllers running at once in one process: the first to start ends first.
    with collection_thresholds([700, 10, 10]):
        first = collection_thresholds([50000, 20, 100])
        second = collection_thresholds([40000, 30, 90])
        first.__enter__()
        second.__enter__()
        assert gc.get_threshold() == (40000, 30, 90)
        first.__exit__(None, None, None)
        assert gc.get_threshold() == (40000, 30, 90)  # the one still running keeps its own
        second.__exit__(None, None, None)
        assert gc.get_threshold() == (700, 10, 10)
        # ... and the other order
        first = collection_thresholds([50000, 20, 100])
        second = collection_thresholds([40000, 30, 90])
        first.__enter__()
        second.__enter__()
        second.__exit__(None, None, None)
        assert gc.get_threshold() == (50000, 20, 100)
        first.__exit__(None, None, None)
        assert gc.get_threshold() == (700, 10, 10)


def test_no_thresholds_leave_the_collector_as_it_is():
    before = gc.get_threshold()
    with collection_thresholds([]):
        assert gc.get_threshold() == before


def test_a_run_goes_under_the_configured_thresholds_and_restores_the_process_ones(monkeypatch):
    """A real (simulated) run: what the collector's thresholds are while its controller
    admits groups, and after it ends."""
    seen: list[tuple[int, int, int]] = []
    real_admit = StalenessController.admit

    def admit(self, n: int, version: int) -> None:
        seen.append(gc.get_threshold())
        real_admit(self, n, version)

    monkeypatch.setattr(StalenessController, "admit", admit)
    # Python's own default, whatever an earlier test in this process left behind
    with collection_thresholds([700, 10, 10]):
        before = gc.get_threshold()
        _simulate_small_run()
        configured = tuple(RunConfig().controller.gc_thresholds)
        assert configured != before  # the default differs from Python's: the test tells them apart
        assert seen and set(seen) == {configured}
        assert gc.get_threshold() == before


def _simulate_small_run() -> None:
    simulate(
        sim_config(
            num_accelerators=16,
            num_prompts=4,
            group_size=4,
            max_new_tokens=2048,
            max_concurrent_prompts=8,
            num_minibatches=1,
            steps=2,
            measure_from=1,
            seed=3,
            mode="async",
            eta=1,
        )
    )
