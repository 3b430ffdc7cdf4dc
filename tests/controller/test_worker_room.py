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


def _other_traffic(
    rng: random.Random, workers: list[WorkerHandle], room: WorkerRoom, *, result_back: bool
) -> None:
    """A result comes back from a busy worker, or else a worker is lost or becomes ready
    again; either way it is offered to the room again."""
    if result_back:
        busy = [w for w in workers if w.in_flight]
        if busy:
            w = rng.choice(busy)
            w.in_flight.pop()
            room.offer(w)
        return
    w = rng.choice(workers)
    w.ready = not w.ready
    room.offer(w)


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
        else:
            _other_traffic(rng, workers, room, result_back=action < 0.85)


def test_no_capacity_limit_and_empty_room():
    room = WorkerRoom(capacity=None)
    assert room.peek() is None and room.take() is None
    w = _worker(0)
    w.in_flight.update(str(i) for i in range(1000))
    room.offer(w)
    assert room.peek() is w


def test_take_turns_sends_what_taking_one_request_at_a_time_would():
    """Dispatching a run of requests by turns (the controller's dispatch) sends each to the
    worker the scan would pick, one at a time, through random traffic: results coming
    back, workers lost and ready again, and workers offered again unchanged (duplicate
    entries in the heap)."""
    rng = random.Random(1)
    workers = [_worker(i) for i in range(6)]
    room = WorkerRoom(capacity=5)
    for w in workers:
        room.offer(w)
    sent = 0
    for step in range(3000):
        action = rng.random()
        if action < 0.35:  # dispatch a run of requests
            limit = rng.randint(1, 12)
            expected, loads = [], {id(w): len(w.in_flight) for w in workers}
            for _ in range(limit):  # the scan, one request at a time
                ready = [w for w in workers if w.ready and w.identity and loads[id(w)] < 5]
                if not ready:
                    break
                pick = min(ready, key=lambda w: loads[id(w)])
                loads[id(pick)] += 1
                expected.append(pick)
            got: list[WorkerHandle] = []
            while len(got) < limit and (turn := room.take_turns(limit - len(got))):
                worker, count = turn
                assert count >= 1, step
                for _ in range(count):
                    worker.in_flight.add(f"r{sent}")
                    sent += 1
                got += [worker] * count
                room.offer(worker)
            assert got == expected, step
        elif 0.75 <= action < 0.9:  # offered again with nothing changed
            room.offer(rng.choice(workers))
        else:
            _other_traffic(rng, workers, room, result_back=action < 0.75)


def test_take_turns_without_a_capacity_limit_stops_at_the_limit_asked():
    room = WorkerRoom(capacity=None)
    assert room.take_turns(5) is None
    w = _worker(0)
    room.offer(w)
    assert room.take_turns(7) == (w, 7)
