"""The minimal root of sandboxed programs: the host's files they need, and nothing else.

A launcher plans it (`plan_root`), builds it once in its own mount namespace on an empty
tmpfs and moves into it (`enter_root`, pivot_root), so every run it forks starts there; a
run then only adds its private mounts (`mount_run_tmp` and /proc, see _child.py):

    /usr /bin /lib ...   SandboxConfig.system_paths: the host's folders bound read-only, or
                         the same symlinks (/bin -> usr/bin on merged-/usr systems)
    /etc/<ETC_ENTRIES>   what the dynamic linker, the time zone and compilers read
    /dev/<DEV_NODES>     bound from the host; fd, stdin, stdout, stderr as symlinks into
                         /proc/self; shm: the run's own tmpfs
    interpreter          sys.prefix, sys.base_prefix, sys.exec_prefix, the executable's folder
    import path          every folder on the launcher's sys.path except the caller's own:
                         its working directory (where run directories and keys usually
                         live) and its script's folder (sys.path[0])
    expose               the folders named in SandboxConfig.expose
    /proc                the run's own procfs (the launcher keeps the host's there: its
                         supervisors write /proc/self/uid_map)
    /tmp                 the run's own tmpfs, working directory /tmp/work; exposed paths
                         below /tmp (a virtualenv there) are bound into it again

Parent folders of exposed paths are empty folders of the new root: /root holds only the way
to an interpreter installed below it. Everything is read-only and nosuid except /tmp and
/dev/shm. Nothing here decides policy; the launcher reports what it built (`visible`).
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass

from areal.sandbox import _linux

ETC_ENTRIES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")
"""/etc entries a program needs: the dynamic linker's cache and configuration, the time
zone, and the alternatives links compilers are reached through (Debian: g++, cc). No
passwd, group, hosts or resolv.conf: they describe the host, and runs have no network."""
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = (
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
)
PRIVATE_MOUNTS = ("/proc", "/tmp", "/dev/shm")
"""Mount points each run covers with its own mount (procfs, tmpfs)."""


@dataclass(frozen=True, kw_only=True)
class RootPlan:
    binds: tuple[str, ...]
    """Host paths bound read-only at the same path; none lies below another."""
    symlinks: tuple[tuple[str, str], ...]
    """(path, target) recreated as they are on the host, or as DEV_LINKS."""
    skipped: tuple[str, ...] = ()
    """Requested paths left out, with the reason (for the isolation report's notes)."""

    def tmp_binds(self) -> tuple[str, ...]:
        """Bound paths below /tmp: each run binds them again over its own /tmp."""
        return tuple(path for path in self.binds if path.startswith("/tmp/"))

    def visible(self) -> tuple[str, ...]:
        """Everything a program can see, as the isolation report lists it."""
        return tuple(
            sorted(
                [
                    *self.binds,
                    *(f"{path} -> {target}" for path, target in self.symlinks),
                    "/proc (the run's own)",
                    "/tmp (the run's own tmpfs)",
                    "/dev/shm (the run's own tmpfs)",
                ]
            )
        )


def plan_root(
    *,
    python: str,
    import_paths: list[str],
    expose: tuple[str, ...],
    system_paths: tuple[str, ...],
    excluded: tuple[str, ...],
) -> RootPlan:
    """What the root holds for an interpreter `python` with `import_paths` (its sys.path),
    except the `excluded` folders (the caller's working directory and script folder)."""
    symlinks: list[tuple[str, str]] = list(DEV_LINKS)
    named: list[str] = []
    for path in [
        *system_paths,
        *(f"/etc/{name}" for name in ETC_ENTRIES),
        *(f"/dev/{name}" for name in DEV_NODES),
    ]:
        if os.path.islink(path):
            symlinks.append((path, os.readlink(path)))  # kept as is: its target may be bound
        elif os.path.exists(path):
            named.append(path)
    interpreter = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(python),
        os.path.dirname(os.path.realpath(python)),
    ]
    left_out = {os.path.abspath(p) for p in excluded if p}
    imports = [p for p in import_paths if p and os.path.abspath(p) not in left_out]
    skipped = []
    wanted = set(named)
    for path in {os.path.realpath(p) for p in [*interpreter, *imports, *expose]}:
        if path in ("/", *PRIVATE_MOUNTS) or path.startswith(("/proc/", "/dev/shm/")):
            skipped.append(f"{path}: not exposed (it would cover the root or a run's own mount)")
        elif os.path.exists(path):
            wanted.add(path)
    return RootPlan(binds=_outermost(wanted), symlinks=tuple(symlinks), skipped=tuple(skipped))


def _outermost(paths: set[str]) -> tuple[str, ...]:
    kept: list[str] = []
    for path in sorted(paths):
        if not any(path.startswith(k + "/") for k in kept):
            kept.append(path)
    return tuple(kept)


def enter_root(plan: RootPlan, staging: str = "/tmp") -> str:
    """Build the root on a fresh tmpfs mounted at `staging` and make it this process's root
    (call in a private mount namespace). Returns how: 'pivot_root', or 'chroot' where the
    host root cannot be pivoted away (an initramfs root)."""
    held = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in plan.binds]
    proc = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    old_umask = os.umask(0o022)
    try:
        _linux.mount(
            "tmpfs", staging, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV, "size=1m,mode=755"
        )
        for path, fd in held:
            bind(fd, staging + path)
        for path, target in plan.symlinks:
            os.makedirs(os.path.dirname(staging + path), exist_ok=True)
            os.symlink(target, staging + path)
        for folder in PRIVATE_MOUNTS:
            os.makedirs(staging + folder, exist_ok=True)
        _linux.make_tree_read_only(staging)
        bind(proc, staging + "/proc")  # after the read-only pass: uid_map must stay writable
    finally:
        os.umask(old_umask)
        for _, fd in held:
            os.close(fd)
        os.close(proc)
    os.chdir(staging)
    try:
        _linux.pivot_root(".", ".")
        _linux.umount(".", _linux.MNT_DETACH)  # the old root, now stacked on top of the new
        how = "pivot_root"
    except OSError:
        os.chroot(".")
        how = "chroot"
    os.chdir("/")
    return how


def bind(fd: int, target: str) -> None:
    """Bind what `fd` (O_PATH) refers to at `target`, creating the mount point."""
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.makedirs(target, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    _linux.mount(f"/proc/self/fd/{fd}", target, None, _linux.MS_BIND | _linux.MS_REC)


def mount_run_tmp(tmp_binds: tuple[str, ...], options: str) -> None:
    """Cover /tmp with the run's own tmpfs and bind `tmp_binds` (read-only) into it again."""
    held = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in tmp_binds]
    try:
        _linux.mount("tmpfs", "/tmp", "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV, options)
        for path, fd in held:
            bind(fd, path)
            _linux.make_tree_read_only(path)
    finally:
        for _, fd in held:
            os.close(fd)
