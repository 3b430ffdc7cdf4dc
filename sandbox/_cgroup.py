"""A memory cgroup (v1) per concurrent run, nested under the launcher's own memory cgroup.

RLIMIT_AS bounds each process, not the run: 32 processes of 1 GB each are 32 GB. A memory
cgroup bounds the whole run (every process, and the tmpfs it writes), measures its peak
(`memory.max_usage_in_bytes`) and counts OOM kills (`memory.oom_control`). The cgroups
live below the caller's own cgroup, so the runs stay inside whatever accounting and limits
the machine already applies to the caller; nothing above is modified.

    <own memory cgroup>/areal-sandbox-<launcher pid>/run-<supervisor pid>/   (one per run)

A fresh cgroup per run (about 1 ms) rather than one per slot: page cache a run read stays
charged to its cgroup after it ends and would inflate the next run's usage and peak.

Only cgroup v1 with the memory controller, and only with write access (root mode). Where it
is missing, runs are bounded per process only and the isolation report says so.

The launcher may leave the host's file tree (see _root.py): it holds the folder open and
reaches every file through that descriptor (`*at` calls), never by path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_PREFIX = "areal-sandbox-"


@dataclass(frozen=True)
class CgroupRoot:
    """This launcher's folder of run cgroups, held open."""

    path: str
    """Where it is on the host (for reports and tests)."""
    fd: int
    parent_fd: int


def create_root() -> tuple[CgroupRoot | None, str]:
    """(folder for this launcher's run cgroups, or None; a note saying why not)."""
    mount = _memory_mount()
    if mount is None:
        return None, "no cgroup v1 memory controller mounted: per-run memory is not bounded"
    own = _own_path()
    parent = os.path.join(mount, own.lstrip("/"))
    _remove_stale(parent)
    name = f"{_PREFIX}{os.getpid()}"
    try:
        os.mkdir(os.path.join(parent, name))
    except OSError as exc:
        return None, f"cannot create memory cgroup {parent}/{name}: {exc.strerror}"
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd)
    return CgroupRoot(os.path.join(parent, name), fd, parent_fd), ""


def create_run(root: CgroupRoot, limit_bytes: int) -> str:
    """A fresh cgroup for the calling supervisor's run, limited to `limit_bytes`; its name."""
    name = f"run-{os.getpid()}"
    os.mkdir(name, dir_fd=root.fd)
    _write(root, f"{name}/memory.limit_in_bytes", str(limit_bytes))
    return name


def remove_run(root: CgroupRoot, name: str) -> None:
    """Remove a run's cgroup once its processes are gone (charged pages move to the parent)."""
    try:
        _rmdir(name, root.fd)
    except OSError:
        pass  # still busy: the launcher's final clean-up removes it


def join(root: CgroupRoot, name: str) -> None:
    """Move the calling process into the cgroup (its future children follow)."""
    _write(root, f"{name}/cgroup.procs", str(os.getpid()))


def peak_bytes(root: CgroupRoot, name: str) -> int:
    return int(_read(root, f"{name}/memory.max_usage_in_bytes"))


def oom_kills(root: CgroupRoot, name: str) -> int:
    for line in _read(root, f"{name}/memory.oom_control").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def remove_root(root: CgroupRoot) -> None:
    """Remove the run cgroups and the folder (each must be empty of processes)."""
    for name in os.listdir(root.fd):
        if name.startswith("run-"):
            _rmdir(name, root.fd)
    _rmdir(os.path.basename(root.path), root.parent_fd)


def _remove_stale_root(parent: str, name: str) -> None:
    folder = os.path.join(parent, name)
    for entry in os.listdir(folder):
        if entry.startswith("run-"):
            os.rmdir(os.path.join(folder, entry))
    os.rmdir(folder)


def _memory_mount() -> str | None:
    with open("/proc/self/mounts") as f:
        for line in f:
            _, target, fstype, options = line.split()[:4]
            if fstype == "cgroup" and "memory" in options.split(","):
                return target
    return None


def _own_path() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return path
    return "/"


def _remove_stale(parent: str) -> None:
    """Folders left by launchers that were killed (their pid is gone)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name.removeprefix(_PREFIX)
        if name.startswith(_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                _remove_stale_root(parent, name)
            except OSError:
                pass


def _write(root: CgroupRoot, name: str, value: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=root.fd)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(root: CgroupRoot, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=root.fd)
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def _rmdir(name: str, dir_fd: int) -> None:
    try:
        os.rmdir(name, dir_fd=dir_fd)  # cgroup folders hold only virtual files: rmdir, never rmtree
    except FileNotFoundError:
        pass
