"""Whose CPU time is it: the controller's or the simulated workers'?

Both run in one process and one event loop, so the process's CPU time mixes them. Every
task records the CPU time spent inside its own steps (each `send` into its coroutine), for
its owner: a simulated worker's tasks (started under `as_worker`, and every task they start
in turn) are the workers'; every other task is the controller's. What runs outside any
task (the loop's own scheduling, timer callbacks) is neither and is reported apart.

So the controller's share is what its own coroutines cost, message decoding and encoding
included (the in-process channel decodes inside the receiving task), as on a real socket.
It is the CPU time of the event loop's thread (`time.thread_time`): work the controller
hands to another thread (packing Train messages, `asyncio.to_thread`) runs beside its loop
on a real machine and is reported apart (the step records' perf/pack_cpu_s).

Garbage collections are the exception that the shared process makes: one runs inside
whichever step's allocation triggered it and walks every tracked object of the process, the
simulated cluster's included, which a real controller's process does not hold. Their pauses
are timed apart as well (`gc_s`, by the owner of the step they ran in; still inside its CPU
time), so that a step time inflated by collecting the simulation's objects shows as such.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import gc
import threading
import time
from typing import Any
from collections.abc import Callable, Coroutine

CONTROLLER, WORKERS = "controller", "workers"
_OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("areal_sim_owner", default=CONTROLLER)


class CpuAccounts:
    """CPU seconds spent inside tasks, by owner, and the controller's by task name (its
    loops: `recv`, `dispatch`, `admission`, `liveness`, `train-driver`, `eval`; a task
    without a name of its own by its coroutine). Install with `install(loop)`."""

    def __init__(self) -> None:
        self.cpu_s = {CONTROLLER: 0.0, WORKERS: 0.0}
        self.gc_s = {CONTROLLER: 0.0, WORKERS: 0.0}
        """Of `cpu_s`, the garbage collector's pauses inside each owner's steps."""
        self.running: str | None = None
        """The owner of the step running now (None between steps)."""
        self._gc_started = 0.0
        self._loop_thread = threading.get_ident()
        """The event loop's thread (`install`): collections in another run in no step."""
        self.by_task: dict[str, float] = {}
        self.controller_steps = 0
        """Steps the controller's tasks have taken: where in its own work a message arrived
        (sim/alone.py replays messages at the same places)."""
        self.after_controller_step: Callable[[], None] | None = None
        """Called after each of them, outside the time measured."""

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Account `loop`'s tasks and time the collector's pauses until `uninstall`."""
        # typeshed's _TaskFactory has no `context` parameter; asyncio passes one when given.
        loop.set_task_factory(self._factory)  # type: ignore[arg-type]
        self._loop_thread = threading.get_ident()
        gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self._loop_thread:  # another thread's (sim/alone.py's
            return  # frame writer), inside none of the loop's steps
        if phase == "start":
            self._gc_started = time.thread_time()
        elif self.running is not None:
            self.gc_s[self.running] += time.thread_time() - self._gc_started

    def _factory(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task:
        owner = context[_OWNER] if context is not None and _OWNER in context else _OWNER.get()
        timed = _Timed(coro, self, owner)
        task = asyncio.Task(timed, loop=loop, context=context)
        if owner == CONTROLLER:
            timed.task = task  # its name is set after the factory returns
        return task


def as_worker(loop: asyncio.AbstractEventLoop, coro: Coroutine, name: str) -> asyncio.Task:
    """Start `coro` as a simulated worker's task: it and its children count as workers."""
    context = contextvars.copy_context()
    context.run(_OWNER.set, WORKERS)
    return loop.create_task(coro, name=name, context=context)


class _Timed(collections.abc.Coroutine):
    """A coroutine that adds the CPU time of each of its steps to an account."""

    __slots__ = ("_accounts", "_coro", "_name", "_owner", "task")

    def __init__(self, coro: Coroutine, accounts: CpuAccounts, owner: str) -> None:
        self._coro, self._accounts, self._owner = coro, accounts, owner
        self._name: str | None = None
        self.task: asyncio.Task | None = None
        """The controller's task running it (None for the workers')."""

    def _account_name(self, task: asyncio.Task) -> str:
        name = task.get_name()
        if name.startswith("Task-"):  # asyncio's default: no name of its own
            name = getattr(self._coro, "__qualname__", "?")
        self._name = name
        return name

    def _add(self, seconds: float) -> None:
        self._accounts.running = None
        self._accounts.cpu_s[self._owner] += seconds
        if self.task is not None:  # the controller's
            name = self._name or self._account_name(self.task)
            accounts = self._accounts
            accounts.by_task[name] = accounts.by_task.get(name, 0.0) + seconds
            accounts.controller_steps += 1
            if accounts.after_controller_step is not None:
                accounts.after_controller_step()

    def send(self, value: Any) -> Any:
        self._accounts.running = self._owner
        start = time.thread_time()
        try:
            return self._coro.send(value)
        finally:
            self._add(time.thread_time() - start)

    def throw(self, *args: Any) -> Any:
        self._accounts.running = self._owner
        start = time.thread_time()
        try:
            return self._coro.throw(*args)
        finally:
            self._add(time.thread_time() - start)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        return self.send(None)
