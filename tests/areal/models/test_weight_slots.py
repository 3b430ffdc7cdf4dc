"""Shared-memory weight slots (weight_sync.mode=shm): versions round-trip exactly; nothing is
read half-written (a slot being written is refused, a reader keeps the writer out of its
slot until it is done); a writer killed mid-publication (kill -9, a real process) leaves its
slot refused and the previous version loadable, and the next writer goes on from there."""

from __future__ import annotations

import fcntl
import os
import signal
import threading

import pytest
import torch
import torch.multiprocessing as mp

from areal.models.weight_slots import SlotError, SlotReader, SlotWriter


def _weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * scale
    return [
        ("w", base),
        ("bf", (base[:, :3] + 1).to(torch.bfloat16)),  # a strided view, bf16
        ("t", base.t()),
        ("empty", torch.empty(0, 3)),
        ("i", torch.tensor([7, -1]) * int(scale)),
    ]


def _assert_equal(views, expected) -> None:
    assert [n for n, _ in views] == [n for n, _ in expected]
    for (name, got), (_, want) in zip(views, expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.fixture
def slots(tmp_path):
    writer, reader = SlotWriter(tmp_path / "slots", 2, lock_timeout_s=10), SlotReader()
    yield writer, reader
    reader.close()
    writer.close(remove=True)


def test_versions_round_trip_and_alternate_slots(slots):
    writer, reader = slots
    paths = [writer.publish(_weights(v), v) for v in (1, 2, 3)]
    assert paths[0] == paths[2] != paths[1]  # never the slot of the newest complete version
    for version in (2, 3):
        with reader.read(paths[version - 1], version) as views:
            _assert_equal(views, _weights(version))
    with pytest.raises(SlotError, match="holds version 3, not 1"), reader.read(paths[0], 1):
        pass
    with (
        pytest.raises(SlotError, match="does not exist"),
        reader.read(writer.directory / "slot-9.bin", 1),
    ):
        pass
    (writer.directory / "empty.bin").touch()  # a writer's file not sized yet
    with (
        pytest.raises(SlotError, match="holds no version yet"),
        reader.read(writer.directory / "empty.bin", 1),
    ):
        pass
    (writer.directory / "other.bin").write_bytes(b"x" * 100)
    with (
        pytest.raises(SlotError, match="is not a weight slot"),
        reader.read(writer.directory / "other.bin", 1),
    ):
        pass


def test_a_slot_being_written_is_refused(slots):
    writer, reader = slots
    path = writer.publish(_weights(1), 1)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a writer holds while it writes
        with pytest.raises(SlotError, match="being overwritten"), reader.read(path, 1):
            pass
    finally:
        os.close(fd)
    with reader.read(path, 1) as views:
        _assert_equal(views, _weights(1))


def test_a_reader_keeps_the_writer_out_of_its_slot(tmp_path, slots):
    writer, reader = slots
    first = writer.publish(_weights(1), 1)
    writer.publish(_weights(2), 2)
    done = threading.Event()
    with reader.read(first, 1) as views:
        thread = threading.Thread(target=lambda: (writer.publish(_weights(3), 3), done.set()))
        thread.start()
        assert not done.wait(0.3), "version 3 was written into a slot being read"
        _assert_equal(views, _weights(1))  # still intact
    thread.join(10)
    assert done.is_set()
    with reader.read(first, 3) as views:
        _assert_equal(views, _weights(3))
    impatient = SlotWriter(writer.directory, 2, lock_timeout_s=0.05)
    try:
        with reader.read(first, 3):  # v3's slot is next after v4: blocked by this reader
            impatient.publish(_weights(4), 4)
            with pytest.raises(SlotError, match="still being read after 0.05 s"):
                impatient.publish(_weights(5), 5)
    finally:
        impatient.close()


_STALLED = None
"""Set in the writer process: the event it sets when it stalls."""


class _Stall(torch.Tensor):
    """A tensor whose copy never starts: the writer stalls mid-publication on it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            _STALLED.set()
            threading.Event().wait()  # until killed
        return super().__torch_function__(func, types, args, kwargs or {})


def _publish_then_stall(directory: str, stalled) -> None:
    global _STALLED
    _STALLED = stalled
    writer = SlotWriter(directory, 2)
    writer.publish(_weights(1), 1)
    writer.publish([("w", _weights(2)[0][1]), ("bf", torch.ones(3).as_subclass(_Stall))], 2)


def test_a_writer_killed_mid_publication_leaves_the_previous_version(tmp_path):
    directory = tmp_path / "slots"
    ctx = mp.get_context("spawn")
    stalled = ctx.Event()
    child = ctx.Process(target=_publish_then_stall, args=(str(directory), stalled))
    child.start()
    try:
        assert stalled.wait(60), f"the writer never stalled (exit code {child.exitcode})"
        os.kill(child.pid, signal.SIGKILL)  # version 2 is half-written now
    finally:
        child.kill()
        child.join(30)
    reader = SlotReader()
    slot_1, slot_2 = directory / "slot-0.bin", directory / "slot-1.bin"
    with (
        pytest.raises(SlotError, match=r"being written \(or abandoned mid-write\)"),
        reader.read(slot_2, 2),
    ):
        pass
    with reader.read(slot_1, 1) as views:
        _assert_equal(views, _weights(1))
    writer = SlotWriter(directory, 2)  # a restarted trainer: reuses the abandoned slot
    try:
        assert writer.publish(_weights(2), 2) == str(slot_2)
        with reader.read(slot_2, 2) as views:
            _assert_equal(views, _weights(2))
    finally:
        reader.close()
        writer.close(remove=True)
