"""The launcher's serving loop: a pool of pre-forked supervisors blocked in accept().

    launcher loop (single thread, selector on 3 fds)
      spares < target and a slot free --> fork a supervisor (slot = uid offset), it blocks
                                          in accept() on the shared listening socket
      supervisor accepted a connection --> it writes its pid on the busy pipe; the loop
                                          marks it busy and forks a replacement spare
      SIGCHLD (wakeup fd)              --> reap, free the slot
      stdin EOF (caller gone)          --> SIGTERM every supervisor, SIGKILL stragglers

Forking the supervisor is thus off the critical path of a run: a request costs one fork
(supervisor -> program) instead of two. The kernel hands each connection to exactly one
blocked accept(). Idle supervisors die with the launcher (parent-death signal); a busy one
clears that signal and finishes its run, which its own limits bound.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import struct
import time
from typing import NoReturn

from areal.sandbox import _linux
from areal.sandbox._supervisor import RunSetup, serve_connection

_PID = struct.Struct("i")
_PR_SET_PDEATHSIG = 1


class SupervisorPool:
    def __init__(
        self, listener: socket.socket, setup: RunSetup, *, max_concurrency: int, spares: int
    ) -> None:
        self.listener = listener
        self.setup = setup
        self.spares = max(1, min(spares, max_concurrency))
        self.free_slots = list(range(max_concurrency - 1, -1, -1))
        self.slot_of: dict[int, int] = {}
        self.idle: set[int] = set()
        self.busy_r, self.busy_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def serve(self) -> None:
        """Run until the caller closes our stdin."""
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        selector = selectors.DefaultSelector()
        for fd in (0, self.busy_r, self.wake_r):
            selector.register(fd, selectors.EVENT_READ)
        while True:
            while len(self.idle) < self.spares and self.free_slots:
                self._fork_spare(selector)
            for key, _ in selector.select():
                if key.fd == 0 and not os.read(0, 4096):
                    self._shutdown()
                    return
                if key.fd == self.busy_r:
                    self._mark_busy()
                if key.fd == self.wake_r:
                    _drain(self.wake_r)
            self._reap()

    def _fork_spare(self, selector: selectors.BaseSelector) -> None:
        slot = self.free_slots.pop()
        launcher_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            selector.close()
            for fd in (self.busy_r, self.wake_r, self.wake_w):
                os.close(fd)
            _wait_for_a_run(self.listener, self.busy_w, self.setup, slot, launcher_pid)
        self.slot_of[pid] = slot
        self.idle.add(pid)

    def _mark_busy(self) -> None:
        data = _drain(self.busy_r)
        for (pid,) in _PID.iter_unpack(data[: len(data) - len(data) % _PID.size]):
            self.idle.discard(pid)

    def _reap(self) -> None:
        while self.slot_of:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.idle.discard(pid)
            if pid in self.slot_of:
                self.free_slots.append(self.slot_of.pop(pid))

    def _shutdown(self) -> None:
        """Supervisors kill their program on SIGTERM; SIGKILL whoever is left after 2 s
        (their programs then die of the parent-death signal)."""
        for pid in self.slot_of:
            _signal(pid, signal.SIGTERM)
        stop = time.monotonic() + 2.0
        while self.slot_of and time.monotonic() < stop:
            self._reap()
            time.sleep(0.01)
        for pid in self.slot_of:
            _signal(pid, signal.SIGKILL)


def _wait_for_a_run(
    listener: socket.socket, busy_w: int, setup: RunSetup, slot: int, launcher_pid: int
) -> NoReturn:
    """Body of a spare supervisor."""
    libc = _linux._libc
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # idle: die with the launcher
    if os.getppid() != launcher_pid:
        os._exit(0)  # the launcher died before the line above took effect
    try:
        conn, _ = listener.accept()
    except OSError:
        os._exit(0)
    listener.close()
    libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)  # busy: finish this run even without launcher
    try:
        os.write(busy_w, _PID.pack(os.getpid()))
    except OSError:
        pass  # the launcher is gone; the run goes on
    os.close(busy_w)
    serve_connection(conn, setup, slot)
    os._exit(1)  # not reached: serve_connection exits (mypy sees areal.sandbox as untyped)


def _drain(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
