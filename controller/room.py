"""Which worker takes the next request: the least loaded one of a kind, below capacity.

The dispatch loop asks after almost every message it handles, and a cluster has hundreds of
workers: scanning them all each time would make dispatch the controller's largest cost at
cluster scale. `WorkerRoom` keeps a heap of (requests in flight, first-offer order, worker) entries instead. Whoever
sees a worker's load change or its state change offers it again (a result came back, it
became ready, requests of it were cancelled, a request was sent to it); entries are checked
lazily when they reach the top: one whose load is no longer the worker's, or whose worker
is gone, full or not ready, is dropped. So `take` returns what a scan of every worker
would (ties: the worker offered first), in O(log workers).
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
