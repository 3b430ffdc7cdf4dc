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
"""

from __future__ import annotations

import os

_PREFIX = "areal-sandbox-"


def create_root() -> tuple[str | None, str]:
    """(folder for this launcher's run cgroups, or None; a note saying why not)."""
    mount = _memory_mount()
    if mount is None:
        return None, "no cgroup v1 memory controller mounted: per-run memory is not bounded"
    own = _own_path()
    parent = os.path.join(mount, own.lstrip("/"))
    _remove_stale(parent)
    root = os.path.join(parent, f"{_PREFIX}{os.getpid()}")
    try:
        os.mkdir(root)
    except OSError as exc:
        return None, f"cannot create memory cgroup {root}: {exc.strerror}"
    return root, ""


def create_run(root: str, limit_bytes: int) -> str:
    """A fresh cgroup for the calling supervisor's run, limited to `limit_bytes`."""
    path = os.path.join(root, f"run-{os.getpid()}")
    os.mkdir(path)
    _write(path, "memory.limit_in_bytes", str(limit_bytes))
    return path


def remove_run(path: str) -> None:
    """Remove a run's cgroup once its processes are gone (charged pages move to the parent)."""
    try:
        _rmdir(path)
    except OSError:
        pass  # still busy: the launcher's final clean-up removes it


def join(path: str) -> None:
    """Move the calling process into the cgroup (its future children follow)."""
    _write(path, "cgroup.procs", str(os.getpid()))


def peak_bytes(path: str) -> int:
    with open(os.path.join(path, "memory.max_usage_in_bytes")) as f:
        return int(f.read())


def oom_kills(path: str) -> int:
    with open(os.path.join(path, "memory.oom_control")) as f:
        for line in f:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0


def remove_root(root: str) -> None:
    """Remove the run cgroups and the folder (each must be empty of processes)."""
    for name in os.listdir(root):
        if name.startswith("run-"):
            _rmdir(os.path.join(root, name))
    _rmdir(root)


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
                remove_root(os.path.join(parent, name))
            except OSError:
                pass


def _write(path: str, name: str, value: str) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(value)


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)  # cgroup folders hold only virtual files: rmdir, never rmtree
    except FileNotFoundError:
        pass

