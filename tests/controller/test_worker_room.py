"""WorkerRoom (controller/room.py) picks what the old scan picked: the least-loaded ready
worker below capacity, ties to the one offered first."""

from __future__ import annotations

import random

from areal.controller.pool import WorkerHandle
from areal.controller.room import WorkerRoom
from areal.messages import WorkerKind


def _worker(i: int) -> WorkerHandle:
    return WorkerHandle(
        worker_id=f"w{i}", kind=WorkerKind.ROLLOUT, identity=f"w{i}".encode(), ready=True
    )


def _scan(workers: list[WorkerHandle], capacity: int) -> WorkerHandle | None:
    ready = [
        w for w in workers if w.ready and w.identity is not None and len(w.in_flight) < capacity
    ]
    return min(ready, key=lambda w: len(w.in_flight), default=None)


def test_room_matches_the_scan_through_random_traffic():
    rng = random.Random(0)
    workers = [_worker(i) for i in range(6)]
    room = WorkerRoom(capacity=3)
    for w in workers:
        room.offer(w)
    for step in range(2000):
        action = rng.random()
        if action < 0.5:  # dispatch one request, as the controller does
            expected = _scan(workers, 3)
            got = room.take()
            assert got is expected, step
            if got is not None:
                got.in_flight.add(f"r{step}")
                room.offer(got)
        elif action < 0.85:  # a result comes back
            busy = [w for w in workers if w.in_flight]
            if busy:
                w = rng.choice(busy)
                w.in_flight.pop()
                room.offer(w)
        else:  # a worker is lost or becomes ready again
            w = rng.choice(workers)
            w.ready = not w.ready
            room.offer(w)


def test_no_capacity_limit_and_empty_room():
    room = WorkerRoom(capacity=None)
    assert room.peek() is None and room.take() is None
    w = _worker(0)
    w.in_flight.update(str(i) for i in range(1000))
    room.offer(w)
    assert room.peek() is w
