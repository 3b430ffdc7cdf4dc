"""What to run and under which limits: `Language`, `Limits`, `SandboxConfig`.

Plain frozen dataclasses that travel (as JSON) from the caller to the launcher process, so
they hold only numbers, strings and tuples. Validation lives here and names the field, the
value and the fix. This module does not start or run anything.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Literal


class SandboxConfigError(ValueError):
    """A sandbox setting is out of range or inconsistent."""


@dataclass(frozen=True, kw_only=True)
class Language:
    """How to turn a source file into a running program.

    Command templates are argument lists; `{source}` is replaced by `source_file` and
    `{python}` by the launcher's interpreter. They run in the empty working directory.
    """

    name: str
    """Short id used in logs and results, e.g. `python`, `cpp`."""
    source_file: str
    """File name the program text is written to inside the working directory."""
    run: tuple[str, ...]
    """Command that runs the program (argv template)."""
    compile: tuple[str, ...] = ()
    """Command run first, in the same sandbox, if non-empty; a non-zero exit is a
    compile error. Its time counts towards the run's wall limit (see `compile_wall_s`)."""
    compile_wall_s: float = 0.0
    """Extra wall-clock seconds granted for the compile step."""
    in_process: bool = False
    """Python only: execute the source inside the warm, pre-forked launcher interpreter
    instead of exec'ing `run` (saves the interpreter's start-up, tens of milliseconds)."""
    memory_error_markers: tuple[str, ...] = ()
    """Substrings of stderr that mean the program ran out of memory (allocation failed
    under the address-space limit)."""

    def __post_init__(self) -> None:
        if not self.run:
            raise SandboxConfigError(
                f"Language {self.name!r}: run=() is empty; give an argv template"
            )
        if "/" in self.source_file or not self.source_file:
            raise SandboxConfigError(
                f"Language {self.name!r}: source_file={self.source_file!r} must be a plain file name"
            )


PYTHON = Language(
    name="python",
    source_file="main.py",
    run=("{python}", "{source}"),
    in_process=True,
    memory_error_markers=("MemoryError",),
)
"""Python 3 in the warm launcher (fork, no exec): the fast default."""

PYTHON_EXEC = dataclasses.replace(PYTHON, name="python-exec", in_process=False)
"""Python 3 as a fresh interpreter per run (`python main.py`): slower, fully fresh state."""

CPP = Language(
    name="cpp",
    source_file="main.cpp",
    compile=("g++", "-O2", "-std=c++17", "-o", "main", "{source}"),
    compile_wall_s=20.0,
    run=("./main",),
    memory_error_markers=("std::bad_alloc",),
)
"""C++17 compiled with g++ inside the sandbox, then run."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Resource limits of one execution. Soft and hard rlimits are set equal, so the
    program cannot raise them back."""

    wall_s: float = 10.0
    """Wall-clock limit in seconds from program start; then the whole process tree is killed."""
    cpu_s: float = 10.0
    """CPU time of the main process (RLIMIT_CPU, rounded up to whole seconds)."""
    memory_bytes: int = 1 << 30
    """Address space per process (RLIMIT_AS). Includes the launcher's own mappings (~30 MB)."""
    run_memory_bytes: int = 2 << 30
    """Resident memory of the whole run: all its processes and the files it writes to its
    tmpfs (a memory cgroup; root mode where cgroup v1 is available, see IsolationReport)."""
    file_size_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    disk_bytes: int = 64 << 20
    """Size of the private tmpfs holding the working directory and /tmp (namespaced modes)."""
    num_processes: int = 64
    """Processes and threads the program may have at once (RLIMIT_NPROC, per run)."""
    num_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    stdout_bytes: int = 8 << 20
    """Captured stdout cap; a program that writes more is killed (status output_limit)."""
    stderr_bytes: int = 1 << 20
    """Captured stderr cap; a program that writes more is killed (status output_limit)."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s"):
            if not getattr(self, name) > 0:
                raise SandboxConfigError(
                    f"Limits.{name}={getattr(self, name)!r} must be > 0 seconds"
                )
        for name in (
            "memory_bytes",
            "run_memory_bytes",
            "file_size_bytes",
            "disk_bytes",
            "num_processes",
            "num_open_files",
            "stdout_bytes",
            "stderr_bytes",
        ):
            if not getattr(self, name) >= 1:
                raise SandboxConfigError(f"Limits.{name}={getattr(self, name)!r} must be >= 1")
        if self.num_open_files < 8:
            raise SandboxConfigError(
                f"Limits.num_open_files={self.num_open_files} leaves no room for std streams; use >= 8"
            )


Mode = Literal["auto", "root", "userns", "none"]


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Settings of one sandbox launcher (one warm zygote process)."""

    mode: Mode = "auto"
    """Isolation mechanism. `root`: namespaces created as root, programs run under a
    per-run unprivileged uid. `userns`: an unprivileged user namespace (for non-root
    callers; chosen by a root caller, programs keep root's real uid, which the kernel
    exempts from RLIMIT_NPROC, so `Limits.num_processes` does not bind). `none`: process
    group + subreaper only, needs `allow_unisolated`. `auto` picks `root` when running as
    root, else `userns`, else `none`."""
    allow_unisolated: bool = False
    """Run code even when neither a PID nor a network namespace is in force. Without it
    `Sandbox.start()` raises `IsolationError` naming what is missing."""
    limits: Limits = field(default_factory=Limits)
    """Default limits of a run (each call may pass its own)."""
    uid_base: int = 61000
    """Root mode: each launcher claims a block of max_concurrency uids from here up (the
    first block no other launcher on the machine holds) and gives each concurrent run its
    own uid, so RLIMIT_NPROC counts only that run's processes. Pick a range no real account
    uses; IsolationReport.run_uids says which block is in use."""
    max_concurrency: int = 64
    """Runs the launcher executes at once; further requests wait in its queue."""
    memory_cgroup: bool = True
    """Root mode: give each run its own memory cgroup (cgroup v1), bounding all its processes
    together by `Limits.run_memory_bytes`. Without it only per-process limits apply."""
    spare_supervisors: int = 2
    """Supervisor processes kept forked and waiting, so a run costs one fork, not two."""
    private_network_per_run: bool = False
    """Give every run its own network namespace (~5 ms more per run) instead of one
    empty namespace shared by all runs of this launcher (runs could then reach each
    other through abstract unix sockets, never the host)."""
    preload: tuple[str, ...] = (
        "array",
        "bisect",
        "collections",
        "copy",
        "dataclasses",
        "decimal",
        "fractions",
        "functools",
        "heapq",
        "io",
        "itertools",
        "json",
        "math",
        "operator",
        "random",
        "re",
        "statistics",
        "string",
        "threading",
        "typing",
    )
    """Modules imported once in the launcher, so in-process Python runs start with them warm."""
    env: tuple[tuple[str, str], ...] = (
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("LANG", "C.UTF-8"),
        ("PYTHONIOENCODING", "utf-8"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("OPENBLAS_NUM_THREADS", "1"),
        ("OMP_NUM_THREADS", "1"),
    )
    """The complete environment of the launcher and of every program (HOME and TMPDIR are
    added per run). Nothing is inherited from the caller."""
    minimal_root: bool = True
    """Programs see a minimal root (sandbox/_root.py): `system_paths`, a named list from /etc
    and /dev, the interpreter and its import path, `expose`, their own /proc and /tmp;
    nothing else of the host. `start()` raises IsolationError where the kernel does not allow
    it. False: programs see the host's whole file tree, read-only."""
    system_paths: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
    """System folders of the minimal root (those that exist; symlinks are kept as symlinks):
    shared libraries, the shell and compilers programs exec."""
    expose: tuple[str, ...] = ()
    """Extra paths programs must read (a compiler or data set outside `system_paths`, a
    library under a folder like /root that the run uid cannot enter), read-only at the same
    path. The interpreter, its standard library and import path are always exposed, wherever
    they are (below /tmp too), except the caller's working directory."""
    python: str = sys.executable
    """Interpreter of the launcher; `{python}` in command templates."""
    startup_timeout_s: float = 30.0
    """How long `start()` waits for the launcher to report its isolation."""
    result_grace_s: float = 15.0
    """Seconds beyond a run's limits after which the caller stops waiting for an answer
    and reports status sandbox_error (the launcher is then presumed hung)."""

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "root", "userns", "none"):
            raise SandboxConfigError(
                f"sandbox.mode={self.mode!r} is not one of auto, root, userns, none"
            )
        if self.spare_supervisors < 1:
            raise SandboxConfigError(
                f"sandbox.spare_supervisors={self.spare_supervisors} must be >= 1"
            )
        if self.max_concurrency < 1:
            raise SandboxConfigError(f"sandbox.max_concurrency={self.max_concurrency} must be >= 1")
        if self.uid_base < 1000 or self.uid_base + self.max_concurrency > 2**31:
            raise SandboxConfigError(
                f"sandbox.uid_base={self.uid_base} must be >= 1000 and leave room for "
                f"max_concurrency={self.max_concurrency} uids"
            )
        if self.mode == "none" and not self.allow_unisolated:
            raise SandboxConfigError(
                "sandbox.mode='none' runs untrusted code without namespaces; "
                "set sandbox.allow_unisolated=true to accept that"
            )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def limits_from_json(data: dict[str, Any]) -> Limits:
    return Limits(**data)


def language_from_json(data: dict[str, Any]) -> Language:
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return Language(**fields)
