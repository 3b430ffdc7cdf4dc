"""What a run produced (`ExecResult`), how it ended (`ExecStatus`), and what isolation the
launcher achieved (`IsolationReport`).

`classify` turns the raw facts of a finished process (wait status, who killed it, stderr)
into a status; it is pure so it can be tested without running anything. Classification
from stderr markers (MemoryError, "File too large") can be spoofed by the program, but
only among failure statuses: nothing a program prints can turn a failure into `ok`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from areal.sandbox.spec import Language, Limits


class ExecStatus(str, enum.Enum):
    """How one execution ended."""

    OK = "ok"
    """Exited with status 0 within all limits."""
    WRONG_ANSWER = "wrong_answer"
    """Ran fine but its output did not match (set by checkers, never by the sandbox)."""
    RUNTIME_ERROR = "runtime_error"
    """Non-zero exit or a fault signal (SIGSEGV, SIGABRT, ...)."""
    COMPILE_ERROR = "compile_error"
    """The language's compile step failed."""
    TIMEOUT = "timeout"
    """Wall-clock or CPU-time limit exceeded."""
    MEMORY_LIMIT = "memory_limit"
    """An allocation failed under the address-space limit."""
    OUTPUT_LIMIT = "output_limit"
    """Too much stdout/stderr, or a file/disk limit was hit."""
    KILLED = "killed"
    """Ended by a non-fault signal it did not get from the sandbox (e.g. killed itself)."""
    SANDBOX_ERROR = "sandbox_error"
    """The sandbox itself failed; says nothing about the program."""

    def is_error(self) -> bool:
        """True when the sandbox, not the program, failed (the run says nothing)."""
        return self is ExecStatus.SANDBOX_ERROR


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    status: ExecStatus
    exit_code: int | None = None
    """Exit status if the program exited normally, else None."""
    signal: int | None = None
    """Number of the signal that ended the program, else None."""
    stdout: bytes = b""
    """Captured standard output, at most `Limits.stdout_bytes`."""
    stderr: bytes = b""
    """Captured standard error, at most `Limits.stderr_bytes`."""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    """Seconds from program start (after sandbox set-up) to its end."""
    cpu_s: float = 0.0
    """User + system CPU seconds of the program and the children it waited for."""
    peak_memory_bytes: int = 0
    """Peak memory of the whole run where a memory cgroup is in force (IsolationReport.
    memory_cgroup), else peak resident set of the main process (which then includes the
    launcher's ~20 MB baseline for in-process Python)."""
    detail: str = ""
    """Why, in words: the limit hit, the signal name, or the sandbox failure."""

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    def header(self) -> dict[str, Any]:
        """All fields except the two byte strings (for the wire header)."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("stdout", "stderr")
        }
        data["status"] = self.status.value
        return data

    @classmethod
    def from_header(cls, header: dict[str, Any], stdout: bytes, stderr: bytes) -> ExecResult:
        return cls(
            **{**header, "status": ExecStatus(header["status"])}, stdout=stdout, stderr=stderr
        )


@dataclass(frozen=True, kw_only=True)
class IsolationReport:
    """Isolation in force for every run of one launcher, verified by a probe run at start-up."""

    mode: str
    """root, userns or none (see `SandboxConfig.mode`)."""
    pid_namespace: bool = False
    """Each run is PID 1 of a fresh PID namespace: when it ends, the kernel kills every
    process it left behind, daemonised or not (probe saw getpid() == 1)."""
    net_namespace: bool = False
    """Runs have no network: the probe's connect to 127.0.0.1 failed with ENETUNREACH."""
    mount_namespace: bool = False
    """Private mounts per run: tmpfs working directory and /tmp, fresh /proc."""
    read_only_root: bool = False
    """Every other mount is read-only (and nosuid) inside the run."""
    minimal_root: bool = False
    """Programs see only `visible` of the host's files (sandbox/_root.py); False: the host's
    whole tree (read-only when `read_only_root`)."""
    root_switch: str = ""
    """How the launcher left the host's tree: 'pivot_root' (the host's root is detached) or
    'chroot' (where pivot_root is refused; programs have no capability to leave it)."""
    visible: tuple[str, ...] = ()
    """What programs see of the file system: bound paths, symlinks, their own mounts."""
    interpreter: str = ""
    """The interpreter programs run with, verified to start and import inside the sandbox."""
    unprivileged: str = "none"
    """How programs are deprived of privilege: 'uid 61000+slot', 'user namespace, no
    capabilities' or 'none'."""
    process_cleanup: str = "process group"
    """How leftover processes are found and killed."""
    rlimits: tuple[str, ...] = ()
    """Resource limits applied to every run."""
    run_uids: tuple[int, ...] = ()
    """(first, last) uid programs of this launcher run as (root mode), else empty."""
    memory_cgroup: bool = False
    """Each run has its own memory cgroup: `Limits.run_memory_bytes` bounds all its
    processes together and `peak_memory_bytes` is the run's peak (else: the main process's
    ru_maxrss, which includes the launcher's ~20 MB baseline)."""
    kernel: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Why a mechanism is missing (the failing call and errno)."""

    @property
    def level(self) -> str:
        """full: pid+net+mount namespaces and no privilege; none: neither pid nor net ns."""
        if not (self.pid_namespace or self.net_namespace):
            return "none"
        if (
            self.pid_namespace
            and self.net_namespace
            and self.mount_namespace
            and self.unprivileged != "none"
        ):
            return "full"
        return "partial"

    def describe(self) -> str:
        lines = [f"sandbox isolation: {self.level} (mode {self.mode}, kernel {self.kernel})"]
        for name in (
            "pid_namespace",
            "net_namespace",
            "mount_namespace",
            "read_only_root",
            "minimal_root",
            "memory_cgroup",
        ):
            lines.append(f"  {name:16s} {'yes' if getattr(self, name) else 'NO'}")
        if self.root_switch:
            lines.append(f"  {'root switch':16s} {self.root_switch}")
        lines.append(f"  {'interpreter':16s} {self.interpreter}")
        lines.append(f"  {'visible':16s} {self.visible[0] if self.visible else '?'}")
        lines.extend(f"  {'':16s} {path}" for path in self.visible[1:])
        lines.append(f"  {'unprivileged':16s} {self.unprivileged}")
        lines.append(f"  {'cleanup':16s} {self.process_cleanup}")
        lines.append(f"  {'rlimits':16s} {', '.join(self.rlimits)}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IsolationReport:
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)


_FAULT_SIGNALS = {
    signal.SIGSEGV,
    signal.SIGBUS,
    signal.SIGFPE,
    signal.SIGILL,
    signal.SIGABRT,
    signal.SIGSYS,
    signal.SIGTRAP,
}
_DISK_MARKERS = ("[Errno 27]", "File too large", "[Errno 28]", "No space left on device")


@dataclass(frozen=True, kw_only=True)
class Ending:
    """Raw facts about how a run ended, gathered by the supervisor."""

    wait_status: int | None
    """os.wait4 status, or None if the program never started."""
    cpu_s: float
    peak_memory_bytes: int
    timed_out: bool = False
    """The supervisor killed the run at its wall-clock deadline."""
    output_overflow: str = ""
    """'stdout' or 'stderr' when the supervisor killed the run for writing too much."""
    oom_killed: bool = False
    """The kernel killed a process of the run for exceeding the run's memory cgroup."""


def classify(
    ending: Ending, limits: Limits, language: Language, stderr_tail: str
) -> tuple[ExecStatus, int | None, int | None, str]:
    """(status, exit_code, signal, detail) of a finished run."""
    code = sig = None
    if ending.wait_status is not None:
        if os.WIFSIGNALED(ending.wait_status):
            sig = os.WTERMSIG(ending.wait_status)
        else:
            code = os.WEXITSTATUS(ending.wait_status)
    if ending.output_overflow:
        cap = limits.stdout_bytes if ending.output_overflow == "stdout" else limits.stderr_bytes
        return ExecStatus.OUTPUT_LIMIT, code, sig, f"{ending.output_overflow} exceeded {cap} bytes"
    if ending.timed_out:
        return ExecStatus.TIMEOUT, code, sig, f"wall-clock limit {limits.wall_s:g} s exceeded"
    if ending.oom_killed and (sig == signal.SIGKILL or code):
        detail = f"run memory limit {limits.run_memory_bytes} bytes exceeded"
        return ExecStatus.MEMORY_LIMIT, code, sig, detail
    cpu_limit = cpu_rlimit_seconds(limits)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and ending.cpu_s >= cpu_limit - 0.05):
        return ExecStatus.TIMEOUT, code, sig, f"CPU-time limit {cpu_limit} s exceeded"
    if sig == signal.SIGXFSZ:
        return (
            ExecStatus.OUTPUT_LIMIT,
            code,
            sig,
            f"file size limit {limits.file_size_bytes} bytes exceeded",
        )
    if code == 0:
        return ExecStatus.OK, code, sig, ""
    if any(marker in stderr_tail for marker in language.memory_error_markers):
        return (
            ExecStatus.MEMORY_LIMIT,
            code,
            sig,
            f"allocation failed under {limits.memory_bytes} bytes",
        )
    if code is not None and any(marker in stderr_tail for marker in _DISK_MARKERS):
        return ExecStatus.OUTPUT_LIMIT, code, sig, "file size or disk limit hit"
    if sig is not None:
        name = _signal_name(sig)
        if sig in _FAULT_SIGNALS:
            return ExecStatus.RUNTIME_ERROR, code, sig, f"killed by {name}"
        return ExecStatus.KILLED, code, sig, f"killed by {name}"
    return ExecStatus.RUNTIME_ERROR, code, sig, f"exit status {code}"


def cpu_rlimit_seconds(limits: Limits) -> int:
    """RLIMIT_CPU in whole seconds (rounded up)."""
    return max(1, int(-(-limits.cpu_s // 1)))


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
