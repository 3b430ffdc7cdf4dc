"""Thin ctypes wrappers over the Linux calls Python 3.11 does not expose: unshare, mount,
umount2, pivot_root, mount_setattr, capset, prctl. Each raises OSError with the call's name
on failure.

Only the launcher and its children call these; nothing here is safe to call in a process
you want to keep (unshare changes the caller's namespaces for good).
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

MNT_DETACH = 0x2

_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new-style syscall)
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
"""pivot_root has no libc wrapper; its number differs by architecture (asm/unistd*.h)."""

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_LAST_CAP_FILE = "/proc/sys/kernel/cap_last_cap"
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)  # the symbols already loaded: libc is among them


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare(0x{flags:x})")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {fstype or source} on {target}",
    )


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    """Make `new_root` the root of this mount namespace (pivot_root(2)); `put_old` may equal
    `new_root`, then the old root is stacked on top of it, to be detached with umount."""
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(0, f"pivot_root: syscall number unknown on {os.uname().machine}")
    _check(_libc.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")


def make_mounts_private() -> None:
    """Stop mount events propagating back to the host (what `unshare -m` does)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def make_tree_read_only(path: str = "/") -> None:
    """Read-only and nosuid for `path` and every mount below it, in one call (Linux >= 5.12)."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
    result = _libc.syscall(
        _SYS_MOUNT_SETATTR,
        _AT_FDCWD,
        path.encode(),
        _AT_RECURSIVE,
        ctypes.byref(attr),
        ctypes.sizeof(attr),
    )
    _check(result, f"mount_setattr({path}, recursive read-only)")


def set_no_new_privs() -> None:
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def set_child_subreaper() -> None:
    """Orphaned descendants are re-parented to the caller instead of to init."""
    _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def drop_all_capabilities() -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets."""
    try:
        with open(_CAP_LAST_CAP_FILE) as f:
            last_cap = int(f.read())
    except OSError:
        last_cap = 40
    for cap in range(last_cap + 1):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM once CAP_SETPCAP is gone: fine
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset(empty)")


def write_id_maps(pid: str, uid_map: str, gid_map: str) -> None:
    """Map ids of a fresh user namespace (setgroups denied, as an unprivileged writer must)."""
    with open(f"/proc/{pid}/setgroups", "w") as f:
        f.write("deny")
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(uid_map)
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(gid_map)
