"""One run, start to finish, in a process the launcher forked for it. Never returns.

    launcher --fork--> supervisor --(unshare pid/mount[/user] ns)--fork--> program (PID 1)
                        |  feeds stdin from a memfd, reads stdout/stderr up to the caps,
                        |  waits on a pidfd, kills at the wall deadline, answers the caller
                        '--> result on the caller's unix connection, then exits

Containment: with a PID namespace the program is its init, so when it exits or is killed
the kernel kills everything it left behind (daemons included) before the supervisor's
pidfd becomes readable. Without one the supervisor is a child subreaper: orphans re-parent
to it, and it kills and reaps every descendant until none is left. Timing starts when the
program starts (the status pipe reaches EOF), so sandbox set-up is not charged to it.
"""

from __future__ import annotations

import dataclasses
import os
import select
import shutil
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

from areal.sandbox import _cgroup, _linux, _wire
from areal.sandbox._cgroup import CgroupRoot
from areal.sandbox._child import NS_WORKDIR, ChildPlan, child_main
from areal.sandbox.result import Ending, ExecResult, ExecStatus, classify
from areal.sandbox.spec import Language, Limits, language_from_json, limits_from_json

SETUP_ALLOWANCE_S = 10.0
"""Wall time the jail set-up (before the program starts) may take."""
_CHUNK = 1 << 16


@dataclass(frozen=True, kw_only=True)
class RunSetup:
    """Isolation steps a launcher applies to every run (decided once, by the start-up probe)."""

    mode: str
    """root, userns or none."""
    pid_namespace: bool
    mount_jail: bool
    read_only_root: bool
    private_network: bool
    uid_base: int
    exposures: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """See `ChildPlan.exposures`; root mode only."""
    minimal_root: bool = False
    """The launcher lives in a minimal root (_root.py): runs need no read-only pass of their own."""
    tmp_binds: tuple[str, ...] = ()
    """See `ChildPlan.tmp_binds`."""
    memory_cgroup_root: CgroupRoot | None = None
    """Folder for per-run memory cgroups (see _cgroup.py), or None."""
    env: tuple[tuple[str, str], ...]
    python: str


@dataclass(kw_only=True)
class _Capture:
    cap: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    overflow: bool = False
    open: bool = True

    def feed(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.overflow = self.overflow or len(chunk) > room


def serve_connection(conn: socket.socket, setup: RunSetup, slot: int) -> NoReturn:
    """Read one request from `conn`, run it, answer, exit."""
    try:
        conn.settimeout(30.0)
        header, blobs = _wire.recv(conn)
        conn.settimeout(None)
        result = run_request(header, blobs, setup, slot)
    except BaseException as exc:  # fault boundary: the caller always gets an answer
        result = ExecResult(
            status=ExecStatus.SANDBOX_ERROR,
            detail=f"supervisor failed: {exc!r}\n{traceback.format_exc(limit=5)}",
        )
    try:
        conn.sendall(_wire.encode(result.header(), [result.stdout, result.stderr]))
    finally:
        os._exit(0)


def request_message(
    source: str | bytes,
    stdin: bytes,
    language: Language,
    limits: Limits,
    files: dict[str, bytes],
    argv: tuple[str, ...],
) -> bytes:
    """The request `run_request` decodes: extra files, then the source, then stdin."""
    source_bytes = source.encode() if isinstance(source, str) else source
    header = {
        "language": dataclasses.asdict(language),
        "limits": dataclasses.asdict(limits),
        "files": list(files),
        "argv": list(argv),
    }
    return _wire.encode(header, [*files.values(), source_bytes, stdin])


def run_request(
    header: dict[str, Any], blobs: list[bytes], setup: RunSetup, slot: int
) -> ExecResult:
    language = language_from_json(header["language"])
    limits = limits_from_json(header["limits"])
    names = header["files"]
    files = dict(zip(names, blobs[: len(names)], strict=True))
    files[language.source_file] = blobs[len(names)]
    stdin = blobs[len(names) + 1]
    return supervise(
        language=language,
        limits=limits,
        files=files,
        stdin=stdin,
        argv=tuple(header.get("argv", ())),
        setup=setup,
        slot=slot,
    )


def supervise(
    *,
    language: Language,
    limits: Limits,
    files: dict[str, bytes],
    stdin: bytes,
    argv: tuple[str, ...],
    setup: RunSetup,
    slot: int,
) -> ExecResult:
    run_uid = (
        setup.uid_base + slot if setup.mode in ("root", "none") and os.geteuid() == 0 else None
    )
    root = setup.memory_cgroup_root  # the run's memory cgroup: (its root, its name)
    cgroup = (root, _cgroup.create_run(root, limits.run_memory_bytes)) if root else None
    workdir = _enter_namespaces(setup, run_uid)
    stdin_fd = _memfd_with(stdin)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe2(os.O_CLOEXEC)
    env = dict(setup.env) | {"HOME": workdir, "TMPDIR": "/tmp" if setup.mount_jail else workdir}
    plan = ChildPlan(
        language=language,
        limits=limits,
        files=files,
        argv=argv,
        env=env,
        python=setup.python,
        workdir=workdir,
        run_uid=run_uid,
        drop_capabilities=setup.mode == "userns",
        mount_jail=setup.mount_jail,
        read_only_root=setup.read_only_root and not setup.minimal_root,
        exposures=setup.exposures if run_uid is not None and setup.mount_jail else (),
        tmp_binds=setup.tmp_binds,
        cgroup=cgroup,
        stdin_fd=stdin_fd,
        stdout_fd=out_w,
        stderr_fd=err_w,
        status_fd=st_w,
    )
    pid = os.fork()
    if pid == 0:
        child_main(plan)
    for fd in (stdin_fd, out_w, err_w, st_w):
        os.close(fd)

    def kill_run_and_exit(*_: object) -> None:
        os.kill(pid, signal.SIGKILL)
        os._exit(1)

    signal.signal(signal.SIGTERM, kill_run_and_exit)
    try:
        return _watch(pid, out_r, err_r, st_r, language, limits, setup, cgroup)
    finally:
        if not setup.mount_jail:
            shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None:
            _cgroup.remove_run(*cgroup)


def _memfd_with(data: bytes) -> int:
    """stdin as an in-memory file: the program can read it at its own pace, no pump needed."""
    fd = os.memfd_create("stdin", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _enter_namespaces(setup: RunSetup, run_uid: int | None) -> str:
    if not setup.pid_namespace:
        _linux.set_child_subreaper()
        return _private_workdir(run_uid)
    # The mount namespace is the program's own (it unshares it, see _child._mount_jail):
    # the supervisor keeps the launcher's view, to clean up the cgroup and workdir after.
    flags = _linux.CLONE_NEWPID
    if setup.private_network:
        flags |= _linux.CLONE_NEWNET
    if setup.mode == "userns":
        flags |= _linux.CLONE_NEWUSER
    _linux.unshare(flags)
    if setup.mode == "userns":
        # A fresh user namespace per run, so RLIMIT_NPROC counts only this run's processes.
        _linux.write_id_maps("self", "0 0 1", "0 0 1")
    return NS_WORKDIR if setup.mount_jail else _private_workdir(run_uid)


def _private_workdir(run_uid: int | None) -> str:
    workdir = tempfile.mkdtemp(prefix="areal-sandbox-")
    if run_uid is not None:
        os.chown(workdir, run_uid, run_uid)
    return workdir


def _watch(
    pid: int,
    out_r: int,
    err_r: int,
    st_r: int,
    language: Language,
    limits: Limits,
    setup: RunSetup,
    cgroup: tuple[CgroupRoot, str] | None,
) -> ExecResult:
    pidfd = os.pidfd_open(pid)
    out, err = _Capture(cap=limits.stdout_bytes), _Capture(cap=limits.stderr_bytes)
    status_msg = bytearray()
    poller = select.poll()
    for fd in (out_r, err_r, st_r, pidfd):
        poller.register(fd, select.POLLIN)
    started = None
    deadline = time.monotonic() + SETUP_ALLOWANCE_S + language.compile_wall_s
    timed_out, overflow, exited = False, "", False
    while not exited:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = started is not None
            break
        for fd, _ in poller.poll(remaining * 1000):
            if fd == pidfd:
                exited = True
            elif fd == st_r:
                chunk = os.read(st_r, _CHUNK)
                status_msg += chunk
                if not chunk:
                    poller.unregister(st_r)
                    if not status_msg:
                        started = time.monotonic()
                        deadline = started + limits.wall_s
            else:
                capture = out if fd == out_r else err
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    poller.unregister(fd)
                    capture.open = False
                capture.feed(chunk)
                if capture.overflow:
                    overflow = "stdout" if capture is out else "stderr"
        if overflow:
            break
    ended = time.monotonic()
    if not exited:
        os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: the kernel kills the rest
    _, wait_status, usage = os.wait4(pid, 0)
    if not setup.pid_namespace:
        _kill_descendants()
    _drain(out_r, out)
    _drain(err_r, err)
    for fd in (out_r, err_r, st_r, pidfd):
        os.close(fd)
    memory = _Memory(peak_bytes=usage.ru_maxrss * 1024, oom_killed=False)
    if cgroup is not None:
        memory = _Memory(
            peak_bytes=_cgroup.peak_bytes(*cgroup), oom_killed=_cgroup.oom_kills(*cgroup) > 0
        )
    return _result(
        started,
        ended,
        wait_status,
        usage,
        memory,
        bytes(status_msg),
        out,
        err,
        timed_out,
        overflow,
        language,
        limits,
    )


@dataclass(frozen=True)
class _Memory:
    peak_bytes: int
    oom_killed: bool


def _result(
    started: float | None,
    ended: float,
    wait_status: int,
    usage: Any,
    memory: _Memory,
    status_msg: bytes,
    out: _Capture,
    err: _Capture,
    timed_out: bool,
    overflow: str,
    language: Language,
    limits: Limits,
) -> ExecResult:
    common = dict(
        stdout=bytes(out.data),
        stderr=bytes(err.data),
        stdout_truncated=out.overflow,
        stderr_truncated=err.overflow,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_memory_bytes=memory.peak_bytes,
    )
    message = status_msg.decode("utf-8", errors="replace")
    if message.startswith("compile:"):
        return ExecResult(
            status=ExecStatus.COMPILE_ERROR,
            exit_code=int(message[8:] or 1),
            detail="compile step failed",
            **common,
        )
    if started is None:
        detail = (
            message.removeprefix("setup:") or "program did not start within the set-up allowance"
        )
        return ExecResult(
            status=ExecStatus.SANDBOX_ERROR, detail=f"sandbox set-up: {detail}", **common
        )
    ending = Ending(
        wait_status=wait_status,
        cpu_s=common["cpu_s"],
        peak_memory_bytes=common["peak_memory_bytes"],
        timed_out=timed_out,
        output_overflow=overflow,
        oom_killed=memory.oom_killed,
    )
    tail = bytes(err.data[-4096:]).decode("utf-8", errors="replace")
    status, code, sig, detail = classify(ending, limits, language, tail)
    return ExecResult(
        status=status, exit_code=code, signal=sig, wall_s=ended - started, detail=detail, **common
    )


def _drain(fd: int, capture: _Capture, budget_s: float = 1.0) -> None:
    """Read what is left after the program ended (every writer is dead by now)."""
    os.set_blocking(fd, False)
    stop = time.monotonic() + budget_s
    while capture.open and time.monotonic() < stop:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            select.select([fd], [], [], max(stop - time.monotonic(), 0))
            continue
        if not chunk:
            break
        capture.feed(chunk)


def _kill_descendants(budget_s: float = 10.0) -> None:
    """Subreaper sweep: SIGKILL every descendant, reap what re-parents to us, repeat until
    none is left (each round kills the children forked during the previous one; the
    process limit bounds how many there can be)."""
    stop = time.monotonic() + budget_s
    while time.monotonic() < stop:
        victims = _descendants(os.getpid())
        if not victims:
            return
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            try:
                reaped, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if reaped == 0:
                break
        time.sleep(0.001)


def _descendants(root: int) -> list[int]:
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found.extend(kids)
            frontier.extend(kids)
    return found
