"""Garbage-collection pauses are timed by the owner of the step they ran in."""

import asyncio
import gc
import threading

import pytest

from areal.sim.accounting import CONTROLLER, WORKERS, CpuAccounts, as_worker
from areal.sim.loop import run_virtual


def _collect_cycles() -> None:
    for _ in range(2000):  # cycles: only the collector frees them
        a: list = []
        a.append(a)
    gc.collect()


@pytest.mark.slow
def test_collections_are_charged_to_the_step_that_ran_them_until_uninstalled():
    accounts = CpuAccounts()

    async def worker():
        _collect_cycles()

    async def controller():
        _collect_cycles()

    async def main():
        accounts.install(asyncio.get_running_loop())
        await as_worker(asyncio.get_running_loop(), worker(), "w")
        after_worker = dict(accounts.gc_s)
        await asyncio.create_task(controller())
        after_controller = dict(accounts.gc_s)
        _collect_cycles()  # in no accounted step (main started before install): nobody's
        outside = dict(accounts.gc_s)
        accounts.uninstall()
        return after_worker, after_controller, outside

    after_worker, after_controller, outside = run_virtual(main)
    assert after_worker[WORKERS] > 0 and after_worker[CONTROLLER] == 0
    assert after_controller[CONTROLLER] > 0 and after_controller[WORKERS] == after_worker[WORKERS]
    assert outside == after_controller
    for owner in (CONTROLLER, WORKERS):  # the pauses are part of the step's CPU time
        assert accounts.gc_s[owner] <= accounts.cpu_s[owner]
    assert accounts._on_collection not in gc.callbacks
    accounts.uninstall()  # twice: nothing to remove, no error


@pytest.mark.slow
def test_a_collection_in_another_thread_is_charged_to_no_step():
    accounts = CpuAccounts()

    async def controller():
        # the step runs while another thread (the replay's frame writer) collects
        thread = threading.Thread(target=_collect_cycles)
        thread.start()
        thread.join()

    async def main():
        accounts.install(asyncio.get_running_loop())
        await asyncio.create_task(controller())
        accounts.uninstall()
        return dict(accounts.gc_s)

    assert run_virtual(main) == {CONTROLLER: 0.0, WORKERS: 0.0}
