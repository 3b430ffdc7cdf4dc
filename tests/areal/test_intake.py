"""The intake's thread: what it is given is prepared there, in order, and its CPU counted."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from areal.intake import Intake


class Job:
    def __init__(self, n: int) -> None:
        self.n = n
        self.thread: str | None = None


class Other:
    pass


def _mark(job: Job, order: list[int]) -> None:
    job.thread = threading.current_thread().name
    order.append(job.n)


def test_each_item_of_its_kinds_is_prepared_on_its_thread_in_order_its_future_holding_the_result():
    order: list[int] = []
    intake = Intake(lambda job: _mark(job, order) or -job.n, lambda msg: type(msg) is Job)
    try:
        jobs = [Job(n) for n in range(50)]
        done = [intake.submit(job) for job in jobs]
        results = []
        for future in done:
            assert future is not None
            results.append(future.result(timeout=10))
        assert results == [-n for n in range(50)]  # what prepare returned for each
        assert order == list(range(50))
        assert {job.thread for job in jobs} == {"intake"}
        assert intake.submit(Other()) is None  # not wanted: nothing to wait for
    finally:
        intake.close()


def test_what_prepare_raises_is_held_by_the_message_future_and_the_thread_goes_on():
    def prepare(job: Job) -> None:
        if job.n == 1:
            raise ValueError("bad job")
        job.thread = "done"

    intake = Intake(prepare, lambda msg: type(msg) is Job)
    try:
        first, second, third = Job(0), Job(1), Job(2)
        futures = [intake.submit(job) for job in (first, second, third)]
        futures[0].result(timeout=10)
        with pytest.raises(ValueError, match="bad job"):
            futures[1].result(timeout=10)
        futures[2].result(timeout=10)
        assert third.thread == "done"
    finally:
        intake.close()


def test_its_cpu_time_is_its_threads_and_is_kept_after_it_ends():
    values = np.ones(2_000_000, np.float32)
    intake = Intake(lambda job: [values.max() for _ in range(job.n)], lambda msg: True)
    before_caller = time.thread_time()
    assert intake.cpu_s < 0.05  # started, nothing done yet
    intake.submit(Job(50)).result(timeout=60)
    used = intake.cpu_s
    assert used > 0
    intake.close()
    intake._thread.join(timeout=10)
    assert not intake._thread.is_alive()  # close ends the thread once its work is done
    assert intake.cpu_s >= used  # read after the thread ended: its last count
    # the caller's thread did not do the work (it only waited)
    assert time.thread_time() - before_caller < used
