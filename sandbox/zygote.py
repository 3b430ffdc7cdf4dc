"""The warm launcher ("zygote"): one long-lived, single-threaded process per `Sandbox` that
forks a supervisor per run, so no run pays for interpreter start-up.

    caller (Sandbox) --Popen(scrubbed env)--> zygote: unshare net/ipc/uts [+user] once,
        |                                       preload modules, probe isolation, listen
        |<-- one JSON line: socket path + IsolationReport
        |--- unix connection per run -------> a pre-forked supervisor accepts it (one run;
        |                                       see _prefork.py for the pool)
        '--- stdin pipe: EOF = caller gone --> SIGTERM every supervisor, exit

Start-up namespaces are shared by all runs: one empty network namespace (no interfaces up,
so any connect fails with ENETUNREACH), private IPC and hostname; in root mode also the
folder for per-run memory cgroups. Per-run namespaces (PID, and in userns mode a user
namespace) are created by each supervisor, the mount namespace by the program itself. The probe runs
a real program through the full path and records what it observed, degrading from the
strongest set-up to weaker ones; the caller decides whether what is left is acceptable.

Root mode runs each program as uid `base + slot`; a slot is held from fork to reap of its
supervisor, so concurrent runs never share a uid (RLIMIT_NPROC is per uid). Launchers on
one machine (several reward workers) each claim their own block of `max_concurrency` uids
from `uid_base` up, with an flock held for the launcher's life (`claim_uid_block`).
"""

from __future__ import annotations

import errno
import fcntl
import gc
import importlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile

from areal.sandbox import _cgroup, _linux, _wire
from areal.sandbox._child import reset_all_signals
from areal.sandbox._prefork import SupervisorPool
from areal.sandbox._supervisor import RunSetup, request_message, serve_connection
from areal.sandbox.result import ExecStatus, IsolationReport
from areal.sandbox.spec import PYTHON, Limits, SandboxConfig, limits_from_json

RLIMITS = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CORE")

PROBE_PROGRAM = r"""
import errno, json, os, socket
report = {"pid": os.getpid(), "uid": os.getuid()}
sock = socket.socket()
sock.settimeout(2)
try:
    sock.connect(("127.0.0.1", 9))
    report["net"] = "connected"
except OSError as exc:
    report["net"] = exc.errno
try:
    open("/usr/.areal_sandbox_probe", "w").close()
    os.remove("/usr/.areal_sandbox_probe")
    report["ro"] = False
except OSError as exc:
    report["ro"] = exc.errno == errno.EROFS
report["tmp"] = sorted(os.listdir("/tmp"))
report["procs"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
try:
    import encodings.idna  # noqa: F401  (not preloaded: needs the stdlib on disk)
    report["stdlib"] = True
except ImportError:
    report["stdlib"] = False
with open("/proc/self/cgroup") as f:
    report["cgroup"] = [l.split(":", 2)[2].strip() for l in f if ":memory:" in l or l.startswith("0::")][0]
with open("/proc/self/status") as f:
    report["cap_eff"] = [l.split()[1] for l in f if l.startswith("CapEff")][0]
print(json.dumps(report))
"""


def main() -> None:
    config = _config_from_json(json.loads(sys.argv[1]))
    handshake = sys.stdout
    reset_all_signals()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    try:
        setup, report = establish(config)
        for name in config.preload:
            importlib.import_module(name)
        sock_dir = tempfile.mkdtemp(prefix="areal-zygote-")
        path = os.path.join(sock_dir, "launcher.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(256)
    except BaseException as exc:  # start-up failure is reported to the caller, not raised
        handshake.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        handshake.flush()
        raise SystemExit(1) from exc
    handshake.write(json.dumps({"socket": path, "isolation": report.to_json()}) + "\n")
    handshake.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    gc.freeze()  # keep the preloaded heap shared copy-on-write with every fork
    try:
        SupervisorPool(listener, setup, max_concurrency=config.max_concurrency,
                       spares=config.spare_supervisors).serve()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
        if setup.memory_cgroup_root is not None:
            _cgroup.remove_root(setup.memory_cgroup_root)


def _config_from_json(data: dict) -> SandboxConfig:
    data["limits"] = limits_from_json(data["limits"])
    data["preload"] = tuple(data["preload"])
    data["env"] = tuple(tuple(pair) for pair in data["env"])
    return SandboxConfig(**data)


def establish(config: SandboxConfig) -> tuple[RunSetup, IsolationReport]:
    """Enter the shared namespaces, then probe per-run set-ups from strongest to weakest."""
    notes: list[str] = []
    outer_uid = os.geteuid()
    mode = config.mode
    if mode == "auto":
        mode = "root" if os.geteuid() == 0 else "userns"
    uid_base = claim_uid_block(config) if outer_uid == 0 and mode in ("root", "none") else config.uid_base
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
    candidates = [dict(pid_namespace=True, mount_jail=True, read_only_root=True),
                  dict(pid_namespace=True, mount_jail=True, read_only_root=False),
                  dict(pid_namespace=True, mount_jail=False, read_only_root=False),
                  dict(pid_namespace=False, mount_jail=False, read_only_root=False)]
    if mode == "none":
        candidates = candidates[-1:]
    for candidate in candidates:
        setup = RunSetup(mode=mode, private_network=config.private_network_per_run and mode != "none",
                         uid_base=uid_base, env=config.env, python=config.python,
                         exposures=plan_exposures(config.python, config.expose),
                         memory_cgroup_root=cgroup_root, **candidate)
        seen = _probe(setup, notes)
        if seen is not None:
            return setup, _report(setup, seen, config, notes, outer_uid)
    raise RuntimeError("no sandbox set-up could run a program: " + "; ".join(notes))


def plan_exposures(python: str, extra: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Folders the run uid must read (interpreter, import path, `extra`) that sit below a
    folder it cannot traverse, grouped by that folder (see `ChildPlan.exposures`)."""
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(python)),
              *sys.path, *extra}
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
    raise RuntimeError(f"no free block of {config.max_concurrency} sandbox uids from {config.uid_base}")


def _try(action, notes: list[str]) -> bool:
    try:
        action()
        return True
    except OSError as exc:
        notes.append(str(exc))
        return False


def _probe(setup: RunSetup, notes: list[str]) -> dict | None:
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        serve_connection(child, setup, slot=0)
    child.close()
    try:
        parent.sendall(request_message(PROBE_PROGRAM, b"", PYTHON, Limits(wall_s=10, cpu_s=10), {}, ()))
        parent.settimeout(60)
        header, blobs = _wire.recv(parent)
    finally:
        parent.close()
        os.waitpid(pid, 0)
    if header["status"] != ExecStatus.OK.value:
        notes.append(f"probe {_setup_name(setup)}: {header['status']} {header['detail'][:300]}")
        return None
    return json.loads(blobs[0])


def _setup_name(setup: RunSetup) -> str:
    parts = [name for name in ("pid_namespace", "mount_jail", "read_only_root") if getattr(setup, name)]
    return "+".join(parts) or "no namespaces"


def _report(setup: RunSetup, seen: dict, config: SandboxConfig, notes: list[str],
            outer_uid: int) -> IsolationReport:
    run_uids: tuple[int, ...] = ()
    if seen["uid"] == setup.uid_base:  # the probe runs in slot 0
        run_uids = (setup.uid_base, setup.uid_base + config.max_concurrency - 1)
        unprivileged = f"uids {run_uids[0]}..{run_uids[1]} (one per concurrent run), no capabilities"
    elif setup.mode == "userns" and int(seen["cap_eff"], 16) == 0:
        unprivileged = "user namespace, no capabilities"
        if outer_uid == 0:
            notes.append("userns mode as root: programs are uid 0 outside their namespace, so "
                         "root-only files stay readable (read-only); prefer mode=root")
    else:
        unprivileged = "none"
    if not seen["stdlib"]:
        notes.append(f"programs cannot read the interpreter's files ({sys.prefix}): only modules "
                     "in sandbox.preload import; install Python world-readable or allow a "
                     "mount namespace")
    pid_ns = seen["pid"] == 1 and seen["procs"] == [1]
    return IsolationReport(
        mode=setup.mode,
        pid_namespace=pid_ns,
        net_namespace=seen["net"] == errno.ENETUNREACH,
        mount_namespace=setup.mount_jail and seen["tmp"] == ["work"],
        memory_cgroup=setup.memory_cgroup_root is not None and "/run-" in seen["cgroup"],
        read_only_root=bool(seen["ro"]),
        unprivileged=unprivileged,
        process_cleanup="PID namespace: the kernel kills every process when the program exits"
        if pid_ns else "subreaper sweep: orphans re-parent to the supervisor, which kills them",
        rlimits=RLIMITS,
        run_uids=run_uids,
        kernel=os.uname().release,
        notes=tuple(notes),
    )


if __name__ == "__main__":
    main()
