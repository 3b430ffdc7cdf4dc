"""The program's side of a run: set up the jail, then become the program. Never returns.

Runs in the process the supervisor forked (PID 1 of a fresh PID namespace when one is in
force). Order matters: joining the run's memory cgroup, a private mount namespace (tmpfs
/tmp and /dev/shm, fresh /proc, everything else read-only: the launcher's minimal root,
see _root.py, or the host's) and file ownership need privilege, so they come first; then
standard streams, rlimits, dropping privilege (setuid to the run's uid, or emptying the
capability sets inside a user namespace), no_new_privs, the parent-death signal (cleared by
any uid change, so set last), the scrubbed environment, and finally either exec of the
language's command or, for in-process Python, the user's code in this very interpreter.

Set-up failures are written to the status pipe and end the process with `SETUP_FAILED`; the
supervisor reports them as sandbox errors. The status pipe is close-on-exec, so the
supervisor sees EOF exactly when the program starts.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

from areal.sandbox import _cgroup, _linux, _root
from areal.sandbox._cgroup import CgroupRoot
from areal.sandbox._pyrun import run_main
from areal.sandbox.result import cpu_rlimit_seconds
from areal.sandbox.spec import Language, Limits

SETUP_FAILED = 125
NS_WORKDIR = "/tmp/work"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, kw_only=True)
class ChildPlan:
    language: Language
    limits: Limits
    files: dict[str, bytes]
    argv: tuple[str, ...]
    env: dict[str, str]
    python: str
    workdir: str
    run_uid: int | None
    """Root mode: setuid/setgid to this uid. None: keep the uid (user namespace or non-root)."""
    drop_capabilities: bool
    mount_jail: bool
    """Private tmpfs /tmp and /dev/shm, fresh /proc, read-only everything else."""
    read_only_root: bool
    """Make the inherited tree read-only (not needed in a minimal root, which already is)."""
    exposures: tuple[tuple[str, tuple[str, ...]], ...]
    """(blocker, paths): `blocker` is a folder the run's uid cannot traverse (e.g. /root,
    0700) above `paths` it must read (the interpreter); it is covered by an empty read-only
    tmpfs holding read-only bind mounts of just those paths."""
    tmp_binds: tuple[str, ...]
    """Paths below /tmp programs must read (a virtualenv there): bound again, read-only, over
    the run's own /tmp."""
    cgroup: tuple[CgroupRoot, str] | None
    """Memory cgroup to join before anything else (see _cgroup.py)."""
    stdin_fd: int
    stdout_fd: int
    stderr_fd: int
    status_fd: int


def child_main(plan: ChildPlan) -> NoReturn:
    try:
        _prepare(plan)
    except BaseException as exc:  # fault boundary: any set-up failure becomes a report
        try:
            os.write(plan.status_fd, f"setup:{type(exc).__name__}: {exc}".encode()[:4000])
        finally:
            os._exit(SETUP_FAILED)
    _start_program(plan)


def _prepare(plan: ChildPlan) -> None:
    if plan.cgroup is not None:
        _cgroup.join(*plan.cgroup)
    os.setsid()
    if plan.mount_jail:
        _mount_jail(plan)
    _write_files(plan)
    for fd, target in ((plan.stdin_fd, 0), (plan.stdout_fd, 1), (plan.stderr_fd, 2)):
        os.dup2(fd, target)
    _close_fds_except(plan.status_fd)
    _set_rlimits(plan.limits)
    if plan.run_uid is not None:
        os.setgroups([])
        os.setgid(plan.run_uid)
        os.setuid(plan.run_uid)
    if plan.drop_capabilities:
        _linux.drop_all_capabilities()
    _linux.set_no_new_privs()
    if _libc_prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError("prctl(PR_SET_PDEATHSIG) failed")
    os.chdir(plan.workdir)
    os.environ.clear()
    os.environ.update(plan.env)
    _reset_signals(python=plan.language.in_process)


def _mount_jail(plan: ChildPlan) -> None:
    _linux.unshare(_linux.CLONE_NEWNS)
    _linux.make_mounts_private()
    if plan.read_only_root:
        _linux.make_tree_read_only("/")
    size = f"size={plan.limits.disk_bytes},mode=1777"
    flags = _linux.MS_NOSUID | _linux.MS_NODEV
    _root.mount_run_tmp(plan.tmp_binds, size)
    for blocker, paths in plan.exposures:
        _expose(blocker, paths)
    if os.path.isdir("/dev/shm"):
        _linux.mount("tmpfs", "/dev/shm", "tmpfs", flags, size)
    _linux.mount("proc", "/proc", "proc", flags | _linux.MS_NOEXEC)
    os.mkdir(plan.workdir, 0o755)


def _expose(blocker: str, paths: tuple[str, ...]) -> None:
    held = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in paths]
    _linux.mount("tmpfs", blocker, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV, "size=1m,mode=755")
    for path, fd in held:
        os.makedirs(path, 0o755, exist_ok=True)
        _linux.mount(f"/proc/self/fd/{fd}", path, None, _linux.MS_BIND | _linux.MS_REC)
        os.close(fd)
    _linux.make_tree_read_only(blocker)


def _write_files(plan: ChildPlan) -> None:
    for name, data in plan.files.items():
        path = os.path.join(plan.workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        if plan.run_uid is not None:
            os.chown(path, plan.run_uid, plan.run_uid)
    if plan.run_uid is not None:
        os.chown(plan.workdir, plan.run_uid, plan.run_uid)


def _close_fds_except(keep: int) -> None:
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)


def _set_rlimits(limits: Limits) -> None:
    cpu = cpu_rlimit_seconds(limits)
    # Soft CPU limit sends SIGXCPU; the hard one a second later is SIGKILL, for programs
    # that ignore SIGXCPU. Every other soft limit equals its hard limit: nothing to raise.
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
        ("RLIMIT_FSIZE", limits.file_size_bytes, limits.file_size_bytes),
        ("RLIMIT_NPROC", limits.num_processes, limits.num_processes),
        ("RLIMIT_NOFILE", limits.num_open_files, limits.num_open_files),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def reset_all_signals() -> None:
    """Every disposition to its default and an empty mask: run once by the launcher at
    start-up, so that nothing the caller ignored or blocked (nohup, a blocked SIGINT)
    reaches the programs."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass  # signals the kernel reserves (32, 33) cannot be changed
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _reset_signals(*, python: bool) -> None:
    """Undo what the launcher and supervisor installed on top of `reset_all_signals`
    (SIGCHLD, SIGTERM, the wakeup fd, Python's own three), then install what a fresh
    interpreter would (Python) or nothing (exec'd programs start from the defaults)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    if python:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _expand(template: tuple[str, ...], plan: ChildPlan) -> list[str]:
    return [
        arg.replace("{source}", plan.language.source_file).replace("{python}", plan.python)
        for arg in template
    ]


def _start_program(plan: ChildPlan) -> NoReturn:
    if plan.language.compile:
        _compile(plan)
    if plan.language.in_process:
        os.close(plan.status_fd)
        run_main(os.path.join(plan.workdir, plan.language.source_file), list(plan.argv))
    argv = _expand(plan.language.run, plan) + list(plan.argv)
    try:
        os.execvpe(argv[0], argv, plan.env)
    except OSError as exc:
        os.write(plan.status_fd, f"setup:cannot exec {argv[0]!r}: {exc}".encode())
        os._exit(SETUP_FAILED)


def _compile(plan: ChildPlan) -> None:
    argv = _expand(plan.language.compile, plan)
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(2, 1)  # compiler chatter goes to stderr; stdout is the program's
            os.execvpe(argv[0], argv, plan.env)
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        os.write(plan.status_fd, f"compile:{os.waitstatus_to_exitcode(status)}".encode())
        os._exit(1)


def _libc_prctl(option: int, arg: int) -> int:
    return _linux._libc.prctl(option, arg, 0, 0, 0)


if sys.platform != "linux":  # pragma: no cover - the sandbox is Linux-only by design
    raise ImportError("areal.sandbox needs Linux (namespaces, rlimits, pidfd)")
