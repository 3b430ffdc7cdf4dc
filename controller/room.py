"""Which worker takes the next request: the least loaded one of a kind, below capacity.

The dispatch loop asks after almost every message it handles, and a cluster has hundreds of
workers: scanning them all each time would make dispatch the controller's largest cost at
cluster scale. `WorkerRoom` keeps a heap of (requests in flight, first-offer order, worker) entries instead. Whoever
sees a worker's load change or its state change offers it again (a result came back, it
became ready, requests of it were cancelled, a request was sent to it); entries are checked
lazily when they reach the top: one whose load is no longer the worker's, or whose worker
is gone, full or not ready, is dropped. So `take` returns what a scan of every worker
would (ties: the worker offered first), in O(log workers). `take_turns` answers for a run of
requests at once: the worker `take` would return and how many times in a row it would, each
request sent to it before the next take, so that dispatching many requests costs a heap
operation per worker rather than two per request.
"""

from __future__ import annotations

import heapq
import itertools

from areal.controller.pool import WorkerHandle


class WorkerRoom:
    """The workers of one kind that may take a request (capacity None: no limit)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity if capacity is not None else float("inf")
        self._heap: list[tuple[int, int, int, WorkerHandle]] = []
        self._order: dict[int, int] = {}
        self._counter = itertools.count()

    def offer(self, handle: WorkerHandle) -> None:
        """`handle`'s load or state may have changed: consider it again."""
        load = len(handle.in_flight)
        if handle.ready and load < self.capacity:
            order = self._order.setdefault(id(handle), len(self._order))
            heapq.heappush(self._heap, (load, order, next(self._counter), handle))

    def peek(self) -> WorkerHandle | None:
        """The least-loaded ready worker below capacity, or None (nothing is taken)."""
        heap = self._heap
        while heap:
            load, _, _, handle = heap[0]
            if (
                handle.ready
                and handle.identity is not None
                and load < self.capacity
                and len(handle.in_flight) == load
            ):
                return handle
            heapq.heappop(heap)
        return None

    def take(self) -> WorkerHandle | None:
        """`peek`, and its entry is used up: offer the worker again after sending to it."""
        handle = self.peek()
        if handle is not None:
            heapq.heappop(self._heap)
        return handle

    def take_turns(self, limit: int) -> tuple[WorkerHandle, int] | None:
        """`take`, and how many of the next `limit` takes would return the same worker were
        each request sent to it (its load rising by one) before the next: while it stays
        below capacity and ahead of the next worker in the room, by load and then by first
        offer. Send it that many, then offer it again. None when no worker has room."""
        handle = self.take()
        if handle is None:
            return None
        heap, load = self._heap, len(handle.in_flight)
        rival = self.peek()
        while rival is handle:  # its own older entry at the same load: stale once it is sent to
            heapq.heappop(heap)
            rival = self.peek()
        turns = self.capacity - load
        if rival is not None:
            rival_load, rival_order = heap[0][0], heap[0][1]
            ahead = self._order[id(handle)] < rival_order
            turns = min(turns, rival_load - load + ahead)
        return handle, int(min(turns, limit))
