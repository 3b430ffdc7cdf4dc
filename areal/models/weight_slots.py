"""Weight versions in shared-memory slots: one copy to publish, none to read (one host).

    <shm_dir>/areal-<run key>/slot-<i>.bin, i < num_slots (weight_sync.keep_versions)

    bytes [0, 64)            header: magic, state (EMPTY | WRITING | COMPLETE), version,
                             payload offset and size, manifest size
    bytes [64, 64 + m)       manifest: JSON [[name, dtype, shape, offset, num_bytes], ...]
    bytes [payload, ...)     the tensors, 16-byte aligned (areal.models.weights.TensorSpec)

Trainer rank 0 holds a `SlotWriter`; it maps every slot once, with its pages allocated
(`posix_fallocate`, `MAP_POPULATE`) at the first publication, so publishing a version is
one memory copy into pages that are already there: no file system call, no page fault
(a fresh tmpfs file costs page allocation and zeroing on every write, several times the
copy itself). A reader (`SlotReader`: the rollout worker, vLLM's worker processes) maps a
slot once, read-only and shared, and gets tensors that are views of it: nothing is copied
until the engine copies them into its parameters.

Nothing is read half-written:
- the writer takes an exclusive `flock` on the slot for the whole write, marks it WRITING
  first and COMPLETE last; it never writes into the slot holding the newest complete
  version, so the version being served stays intact;
- a reader takes a shared `flock` (never waiting: a slot locked exclusively is being
  overwritten, so the version asked for is gone) and checks, under that lock, that the slot
  is COMPLETE and holds the version asked for; it keeps the lock until the engine has
  copied the tensors (`SlotReader.read` is a context manager), and the writer waits for it;
- a writer that dies mid-write leaves its slot WRITING (the kernel drops the lock), which
  no reader accepts; the previous version, in another slot, stays loadable, and the next
  writer (a restarted trainer) reuses the slots as they are.

Not here: which version a worker should load (the controller says), engines, transport.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import struct
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Iterator

import torch

from areal.models.weights import TensorSpec, bucket_layout, unflatten_bucket

_MAGIC = b"ARSLOT01"
_HEADER = struct.Struct(
    "<8sIIqQQQ"
)  # magic, state, reserved, version, payload offset/size, manifest size
_HEADER_BYTES = 64
_PAGE = 4096
EMPTY, WRITING, COMPLETE = 0, 1, 2
_STATE_NAMES = {
    EMPTY: "empty",
    WRITING: "being written (or abandoned mid-write)",
    COMPLETE: "complete",
}


class SlotError(RuntimeError):
    """A slot does not hold the version asked for, complete (overwritten, being written,
    abandoned mid-write, or not a slot file)."""


def slot_directory(shm_dir: str | Path, run_dir: str | Path) -> Path:
    """The run's slot directory: one per run directory, so a restarted trainer of the same
    run finds the slots the workers read."""
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return Path(shm_dir) / f"areal-weights-{key}"


@dataclass(frozen=True)
class _Header:
    state: int
    version: int
    payload_offset: int
    payload_bytes: int
    manifest_bytes: int

    @classmethod
    def read(cls, buffer: mmap.mmap, path: Path) -> _Header:
        if len(buffer) < _HEADER_BYTES:
            raise SlotError(f"{path} is too short to be a weight slot")
        magic, state, _, version, offset, size, manifest = _HEADER.unpack_from(buffer, 0)
        if magic != _MAGIC:
            raise SlotError(f"{path} is not a weight slot (magic {magic!r})")
        return cls(state, version, offset, size, manifest)

    def write(self, buffer: mmap.mmap) -> None:
        _HEADER.pack_into(
            buffer,
            0,
            _MAGIC,
            self.state,
            0,
            self.version,
            self.payload_offset,
            self.payload_bytes,
            self.manifest_bytes,
        )


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorSpec], bytes, int, int]:
    """(specs, manifest JSON, payload offset, file size) of a weight set."""
    specs, offset = bucket_layout(tensors)
    manifest = json.dumps(
        [[s.name, s.dtype, list(s.shape), s.offset, s.num_bytes] for s in specs]
    ).encode()
    payload_offset = -(-(_HEADER_BYTES + len(manifest)) // _PAGE) * _PAGE
    return specs, manifest, payload_offset, payload_offset + max(offset, 1)


def _map(path: Path, size: int, *, writable: bool) -> tuple[int, mmap.mmap]:
    fd = os.open(path, (os.O_RDWR | os.O_CREAT) if writable else os.O_RDONLY, 0o644)
    try:
        if writable and os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # tmpfs pages allocated (and zeroed) now, once
        size = os.fstat(fd).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return fd, mmap.mmap(fd, size, flags=flags, prot=prot)
    except BaseException:
        os.close(fd)
        raise


def _as_bytes_tensor(buffer: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: the views are only read
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(buffer, dtype=torch.uint8)


class _Slot:
    def __init__(self, path: Path, fd: int, buffer: mmap.mmap) -> None:
        self.path, self.fd, self.buffer = path, fd, buffer
        self.data = _as_bytes_tensor(buffer)

    def close(self) -> None:
        del self.data
        try:
            self.buffer.close()
        except BufferError:  # views still alive: the mapping goes when they do
            pass
        os.close(self.fd)


class SlotWriter:
    """Trainer rank 0's side: publishes versions into `num_slots` slots of `directory`."""

    def __init__(
        self, directory: str | Path, num_slots: int, *, lock_timeout_s: float = 60.0
    ) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_slots={num_slots} must be >= 2: a version is written into "
                "another slot than the newest complete one"
            )
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.num_slots = num_slots
        self.lock_timeout_s = lock_timeout_s
        self._slots: list[_Slot] = []

    def slot_path(self, index: int) -> Path:
        return self.directory / f"slot-{index}.bin"

    def publish(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> str:
        """Write `tensors` as `version` into a slot; returns the slot's path."""
        pairs = list(tensors)
        specs, manifest, payload_offset, size = _layout(pairs)
        self._ensure_slots(size)
        slot = self._choose_slot()
        self._lock_exclusive(slot)
        try:
            payload = size - payload_offset
            header = _Header(WRITING, version, payload_offset, payload, len(manifest))
            header.write(slot.buffer)
            slot.buffer[_HEADER_BYTES : _HEADER_BYTES + len(manifest)] = manifest
            data = slot.data
            for spec, (_, tensor) in zip(specs, pairs, strict=True):
                start = payload_offset + spec.offset
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                data[start : start + spec.num_bytes].copy_(raw)
            _Header(COMPLETE, version, payload_offset, payload, len(manifest)).write(slot.buffer)
        finally:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)
        return str(slot.path)

    def close(self, *, remove: bool = False) -> None:
        for slot in self._slots:
            slot.close()
        self._slots = []
        if remove:
            for index in range(self.num_slots):
                self.slot_path(index).unlink(missing_ok=True)
            try:
                self.directory.rmdir()
            except OSError:
                pass

    def _ensure_slots(self, size: int) -> None:
        if self._slots and all(len(s.buffer) >= size for s in self._slots):
            return
        self.close()
        for index in range(self.num_slots):
            path = self.slot_path(index)
            fd, buffer = _map(path, size, writable=True)
            self._slots.append(_Slot(path, fd, buffer))

    def _choose_slot(self) -> _Slot:
        """The slot with the oldest content, never the one with the newest complete version."""

        def rank(slot: _Slot) -> tuple[int, int]:
            try:
                header = _Header.read(slot.buffer, slot.path)
            except SlotError:
                return (0, -1)  # a fresh file
            return (1, header.version) if header.state == COMPLETE else (0, header.version)

        return min(self._slots, key=rank)

    def _lock_exclusive(self, slot: _Slot) -> None:
        """Wait for readers of the slot (they hold shared locks while loading)."""
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SlotError(
                        f"{slot.path} is still being read after "
                        f"{self.lock_timeout_s} s (a rollout worker stuck in a "
                        "load?); raise weight_sync.timeout_s or keep_versions"
                    ) from None
                time.sleep(0.005)  # readers hold the lock for one load; flock has no timeout


class SlotReader:
    """A reading side: maps each slot file once and hands out views of the version asked for.
    One per process (the rollout worker; each vLLM worker process)."""

    def __init__(self) -> None:
        self._slots: dict[Path, _Slot] = {}

    @contextmanager
    def read(self, path: str | Path, version: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """(name, tensor) views of `version` in slot `path`, valid inside the block, during
        which the slot cannot be overwritten. SlotError when the slot does not hold that
        version complete."""
        slot = self._slot(Path(path))
        try:
            fcntl.flock(slot.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SlotError(
                f"{slot.path} is being overwritten with a newer version: version "
                f"{version} is gone; load a newer one"
            ) from None
        try:
            yield self._views(slot, version)
        finally:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)

    def check(self, path: str | Path, version: int) -> list[tuple[str, torch.Tensor]]:
        """Views of `version` without taking the lock: for a process reading on behalf of
        another that holds it (vLLM's workers under the rollout worker's lock)."""
        return self._views(self._slot(Path(path)), version)

    def close(self) -> None:
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()

    def _slot(self, path: Path) -> _Slot:
        slot = self._slots.get(path)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise SlotError(
                f"weight slot {path} does not exist (the trainer removed it, or "
                "it runs on another host: shm mode needs one host)"
            ) from None
        if slot is not None and len(slot.buffer) < size:  # the writer grew the slot
            slot.close()
            slot = None
        if slot is None:
            if size < _HEADER_BYTES:  # created, not sized yet: no version is in it
                raise SlotError(f"weight slot {path} holds no version yet")
            fd, buffer = _map(path, size, writable=False)
            slot = self._slots[path] = _Slot(path, fd, buffer)
        return slot

    @staticmethod
    def _views(slot: _Slot, version: int) -> list[tuple[str, torch.Tensor]]:
        header = _Header.read(slot.buffer, slot.path)
        if header.state != COMPLETE:
            raise SlotError(
                f"{slot.path} is {_STATE_NAMES.get(header.state, header.state)} "
                f"(version {header.version}), not a complete version {version}"
            )
        if header.version != version:
            raise SlotError(
                f"{slot.path} holds version {header.version}, not {version} (it "
                "was overwritten: load a newer version)"
            )
        raw = bytes(slot.buffer[_HEADER_BYTES : _HEADER_BYTES + header.manifest_bytes])
        specs = [
            TensorSpec(name=n, dtype=d, shape=tuple(s), offset=o, num_bytes=b)
            for n, d, s, o, b in json.loads(raw)
        ]
        payload = slot.data[header.payload_offset : header.payload_offset + header.payload_bytes]
        return unflatten_bucket(payload, specs)
