"""The controller's 'something changed' signal (controller/signal.py): which waiters a
notify wakes, and where their predicates are checked."""

from __future__ import annotations

import asyncio

import pytest

from areal.controller.signal import Changed


class Probe:
    """A predicate that records, per call, whether the waiter's own task made it."""

    def __init__(self, value: bool = False) -> None:
        self.value, self.waiter, self.calls = value, None, []

    def __call__(self) -> bool:
        self.calls.append(asyncio.current_task() is self.waiter)
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


async def _start(changed: Changed, probe: Probe, **kwargs) -> asyncio.Task:
    task = asyncio.create_task(changed.wait_for(probe, **kwargs))
    probe.waiter = task
    await asyncio.sleep(0)  # it checks once and waits
    assert probe.calls == [True] and not task.done()
    return task


async def test_a_waiter_checked_at_notify_is_not_woken_while_its_predicate_is_false():
    changed, probe = Changed(), Probe()
    task = await _start(changed, probe, at_notify=True)
    for _ in range(3):
        changed.notify()
        await asyncio.sleep(0)
    assert probe.calls == [True, False, False, False]  # checked by notify, never by the waiter
    probe.value = True
    changed.notify()
    assert await task is True
    assert probe.calls == [True, False, False, False, False, True]  # at notify, then its own


async def test_a_plain_waiter_wakes_on_every_notify_and_checks_in_its_own_task():
    changed, probe = Changed(), Probe()
    task = await _start(changed, probe)
    for _ in range(3):
        changed.notify()
        await asyncio.sleep(0)
    assert probe.calls == [True] * 4
    probe.value = True
    changed.notify()
    assert await task is True


async def test_both_kinds_wait_on_one_signal_and_none_takes_the_other_s_wake_up():
    changed, eager, plain = Changed(), Probe(), Probe()
    eager_task = await _start(changed, eager, at_notify=True)
    plain_task = await _start(changed, plain)
    eager.value = plain.value = True
    changed.notify()
    assert await eager_task is True and await plain_task is True


async def test_a_predicate_that_raises_at_notify_raises_in_its_waiter():
    changed, probe = Changed(), Probe()
    task = await _start(changed, probe, at_notify=True)
    probe.value = KeyError("gone")
    changed.notify()
    with pytest.raises(KeyError, match="gone"):
        await task


async def test_a_waiter_checked_at_notify_still_times_out():
    changed, probe = Changed(), Probe()
    assert await changed.wait_for(probe, timeout=0.05, at_notify=True) is False
    changed.notify()  # its cancelled wait is dropped, not woken
    assert changed._waiters == []
