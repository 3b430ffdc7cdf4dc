"""The warm launcher ("zygote"): one long-lived, single-threaded process per `Sandbox` that
forks a supervisor per run, so no run pays for interpreter start-up.

    caller (Sandbox) --Popen(scrubbed env)--> zygote: unshare net/ipc/uts [+user] once,
        |                                       preload modules, listen, build the minimal
        |                                       root and move into it, probe isolation
        |<-- one JSON line: socket path + IsolationReport
        |--- unix connection per run -------> a pre-forked supervisor accepts it (one run;
        |                                       see _prefork.py for the pool)
        '--- stdin pipe: EOF = caller gone --> SIGTERM every supervisor, exit

Start-up namespaces are shared by all runs: one empty network namespace (no interfaces up,
so any connect fails with ENETUNREACH), private IPC and hostname, and a mount namespace
whose root is the minimal root of _root.py (the host's tree stays behind: the launcher
reaches its socket folder and cgroups through descriptors opened before); in root mode
also the folder for per-run memory cgroups. Per-run namespaces (PID, and in userns mode a
user namespace) are created by each supervisor, the run's own mounts (/tmp, /proc) by the
program itself. The probes (_probe.py) run real programs through the full path and record
what they observed, degrading from the strongest set-up to weaker ones; the caller decides
whether what is left is acceptable.

Root mode runs each program as uid `base + slot`; a slot is held from fork to reap of its
supervisor, so concurrent runs never share a uid (RLIMIT_NPROC is per uid). Launchers on
one machine (several reward workers) each claim their own block of `max_concurrency` uids
from `uid_base` up, with an flock held for the launcher's life (`claim_uid_block`).
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import json
import os
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from areal.sandbox import _cgroup, _linux, _probe, _root
from areal.sandbox._cgroup import CgroupRoot
from areal.sandbox._child import reset_all_signals
from areal.sandbox._prefork import SupervisorPool
from areal.sandbox._supervisor import RunSetup
from areal.sandbox.result import IsolationReport
from areal.sandbox.spec import SandboxConfig, limits_from_json


def main() -> None:
    config = _config_from_json(json.loads(sys.argv[1]))
    caller_path = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
    caller_own = (sys.argv[3] if len(sys.argv) > 3 else "", *caller_path[:1])
    handshake = sys.stdout
    reset_all_signals()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    try:
        launcher = Launcher()
        setup, report = establish(config, launcher, caller_own)
    except BaseException as exc:  # start-up failure is reported to the caller, not raised
        handshake.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        handshake.flush()
        raise SystemExit(1) from exc
    handshake.write(
        json.dumps({"socket": launcher.socket_path, "isolation": report.to_json()}) + "\n"
    )
    handshake.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    gc.freeze()  # keep the preloaded heap shared copy-on-write with every fork
    try:
        SupervisorPool(
            launcher.listener,
            setup,
            max_concurrency=config.max_concurrency,
            spares=config.spare_supervisors,
        ).serve()
    finally:
        launcher.remove_socket()
        if setup.memory_cgroup_root is not None:
            _cgroup.remove_root(setup.memory_cgroup_root)


class Launcher:
    """The listening socket, made on the host's /tmp before the launcher leaves the host's
    tree; its folder stays reachable through descriptors for the final clean-up."""

    def __init__(self) -> None:
        sock_dir = tempfile.mkdtemp(prefix="areal-zygote-")  # 0700
        self.socket_path = os.path.join(sock_dir, "launcher.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.socket_path)
        self.listener.listen(256)
        self._dir_fd = os.open(sock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._parent_fd = os.open(
            os.path.dirname(sock_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        )

    def remove_socket(self) -> None:
        try:
            os.unlink("launcher.sock", dir_fd=self._dir_fd)
            os.rmdir(os.path.basename(os.path.dirname(self.socket_path)), dir_fd=self._parent_fd)
        except OSError:
            pass  # the caller removes what is left when it starts the next launcher


def _config_from_json(data: dict) -> SandboxConfig:
    data["limits"] = limits_from_json(data["limits"])
    for name in ("preload", "expose", "system_paths"):
        data[name] = tuple(data[name])
    data["env"] = tuple(tuple(pair) for pair in data["env"])
    return SandboxConfig(**data)


@dataclass(kw_only=True)
class _Namespaces:
    mode: str
    uid_base: int
    cgroup_root: CgroupRoot | None


def establish(
    config: SandboxConfig, launcher: Launcher, caller_own: tuple[str, ...]
) -> tuple[RunSetup, IsolationReport]:
    """Enter the shared namespaces and the minimal root, then probe per-run set-ups from
    strongest to weakest; the first that runs a program is kept. `caller_own`: the caller's
    working directory and script folder, left out of the programs' import path."""
    notes: list[str] = []
    outer_uid = os.geteuid()
    spaces = _enter_shared_namespaces(config, notes)
    for name in config.preload:  # before leaving the host's tree: lazy imports fail after
        importlib.import_module(name)
    plan = _root.plan_root(
        python=config.python,
        import_paths=sys.path,
        expose=config.expose,
        system_paths=config.system_paths,
        excluded=caller_own,
    )
    notes.extend(plan.skipped)
    root_switch = ""
    if config.minimal_root and spaces.mode != "none":
        root_switch = _enter_minimal_root(plan, notes)
    candidates = [
        dict(pid_namespace=True, mount_jail=True, read_only_root=True),
        dict(pid_namespace=True, mount_jail=True, read_only_root=False),
        dict(pid_namespace=True, mount_jail=False, read_only_root=False),
        dict(pid_namespace=False, mount_jail=False, read_only_root=False),
    ]
    if root_switch:  # the host's tree is gone: only set-ups with the run's own /tmp can work
        candidates = candidates[:1]
    elif spaces.mode == "none":
        candidates = candidates[-1:]
    checked = tuple(path for path in plan.binds if not path.startswith(("/dev/", "/etc/")))
    for candidate in candidates:
        setup = RunSetup(
            mode=spaces.mode,
            private_network=config.private_network_per_run and spaces.mode != "none",
            uid_base=spaces.uid_base,
            env=config.env,
            python=config.python,
            exposures=() if root_switch else plan_exposures(config.python, config.expose),
            minimal_root=bool(root_switch),
            tmp_binds=plan.tmp_binds(),
            memory_cgroup_root=spaces.cgroup_root,
            **candidate,
        )
        seen = _probe.probe(setup, notes, checked if candidate["mount_jail"] else ())
        if seen is not None:
            _probe.check_interpreter(setup, seen, config.python, notes)
            return setup, _probe.build_report(
                setup,
                seen,
                config,
                notes,
                outer_uid,
                root_switch=root_switch,
                visible=plan.visible(),
            )
    raise RuntimeError("no sandbox set-up could run a program: " + "; ".join(notes))


def _enter_shared_namespaces(config: SandboxConfig, notes: list[str]) -> _Namespaces:
    mode = config.mode
    if mode == "auto":
        mode = "root" if os.geteuid() == 0 else "userns"
    uid_base = (
        claim_uid_block(config)
        if os.geteuid() == 0 and mode in ("root", "none")
        else config.uid_base
    )
    shared = _linux.CLONE_NEWNET | _linux.CLONE_NEWIPC | _linux.CLONE_NEWUTS
    cgroup_root = None
    if mode == "root":
        _try(lambda: _linux.unshare(shared), notes)
        if config.memory_cgroup:
            cgroup_root, why = _cgroup.create_root()
            notes.extend([why] if why else [])
    elif mode == "userns":
        uid, gid = os.geteuid(), os.getegid()
        if not _try(lambda: _linux.unshare(_linux.CLONE_NEWUSER | shared), notes):
            mode = "none"
        else:
            _linux.write_id_maps("self", f"0 {uid} 1", f"0 {gid} 1")
    return _Namespaces(mode=mode, uid_base=uid_base, cgroup_root=cgroup_root)


def _enter_minimal_root(plan: _root.RootPlan, notes: list[str]) -> str:
    """'pivot_root' or 'chroot' once the launcher lives in the minimal root; '' (and a note
    naming the failing call) where the kernel does not allow it."""
    try:
        _linux.unshare(_linux.CLONE_NEWNS)
        _linux.make_mounts_private()
        return _root.enter_root(plan)
    except OSError as exc:
        notes.append(f"no minimal root: {exc}")
        return ""


def plan_exposures(python: str, extra: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Folders the run uid must read (interpreter, import path, `extra`) that sit below a
    folder it cannot traverse, grouped by that folder (see `ChildPlan.exposures`)."""
    wanted = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(python)),
        *sys.path,
        *extra,
    }
    by_blocker: dict[str, list[str]] = {}
    for path in sorted({os.path.realpath(p) for p in wanted if p and os.path.isdir(p)}):
        blocker = _first_closed_ancestor(path)
        if blocker is None:
            continue
        kept = by_blocker.setdefault(blocker, [])
        if not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return tuple((blocker, tuple(paths)) for blocker, paths in by_blocker.items())


def _first_closed_ancestor(path: str) -> str | None:
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


_UID_LOCKS: list[int] = []  # held open for the launcher's life; closing releases the block


def claim_uid_block(config: SandboxConfig) -> int:
    """First uid of a block of `max_concurrency` uids no other launcher on this machine holds."""
    folder = os.path.join(tempfile.gettempdir(), "areal-sandbox-uids")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for block in range(4096):
        base = config.uid_base + block * config.max_concurrency
        fd = os.open(os.path.join(folder, f"{base}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _UID_LOCKS.append(fd)
        return base
    raise RuntimeError(
        f"no free block of {config.max_concurrency} sandbox uids from {config.uid_base}"
    )


def _try(action, notes: list[str]) -> bool:
    try:
        action()
        return True
    except OSError as exc:
        notes.append(str(exc))
        return False


if __name__ == "__main__":
    main()
