"""What the launcher verifies before it serves: a real program run through the full path of
a candidate set-up, and the `IsolationReport` built from what that program observed.

Two probes: PROBE_PROGRAM in the warm interpreter (namespaces, read-only root, uid, the
interpreter's files and import path visible), then a fresh `{python}` exec'd the way
PYTHON_EXEC runs programs. A set-up whose first probe fails is skipped for a weaker one; an
interpreter that cannot run or import in the chosen one is a start-up error, so a
misconfigured sandbox fails at `Sandbox.start()`, not in every run. Nothing here forks
except through `serve_connection`, the code every run goes through.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import sys

from areal.sandbox import _wire
from areal.sandbox._supervisor import RunSetup, request_message, serve_connection
from areal.sandbox.result import ExecStatus, IsolationReport
from areal.sandbox.spec import PYTHON, PYTHON_EXEC, Limits, SandboxConfig

RLIMITS = (
    "RLIMIT_CPU",
    "RLIMIT_AS",
    "RLIMIT_FSIZE",
    "RLIMIT_NPROC",
    "RLIMIT_NOFILE",
    "RLIMIT_CORE",
)

PROBE_PROGRAM = r"""
import errno, json, os, socket, sys
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
report["missing"] = [p for p in sys.argv[1:] if not os.path.exists(p)]
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

INTERPRETER_PROBE = "import encodings.idna, sys\nprint(sys.prefix)"
"""Run by a fresh interpreter: it starts, finds its prefix and imports from its stdlib."""
_EXEC_PROBE = dataclasses.replace(
    PYTHON_EXEC, name="python-probe", run=("{python}", "-S", "{source}")
)
"""PYTHON_EXEC without the site module (start-up several times cheaper, docs/design.md
section 7): the in-process probe already found the import path; this one checks the executable, its
libraries and its standard library."""


def probe(setup: RunSetup, notes: list[str], paths: tuple[str, ...]) -> dict | None:
    """What PROBE_PROGRAM saw under `setup` (checking that `paths` exist), or None."""
    header, blobs = _run(setup, PROBE_PROGRAM, PYTHON, paths)
    if header["status"] != ExecStatus.OK.value:
        notes.append(
            f"probe {setup_name(setup)}: {header['status']} {header['detail'][:300]} "
            f"{blobs[1][-300:].decode(errors='replace')}"
        )
        return None
    return json.loads(blobs[0])


def check_interpreter(setup: RunSetup, seen: dict, python: str, notes: list[str]) -> None:
    """Raise, naming what is missing, when programs cannot use the interpreter. Without a
    mount namespace nothing can be exposed: there it is only noted (the caller accepted
    running unisolated)."""
    problems = []
    if seen["missing"]:
        problems.append(
            f"sandboxed programs cannot see the interpreter's files or import "
            f"path: {seen['missing']} (SandboxConfig.python={python!r})"
        )
    header, blobs = _run(setup, INTERPRETER_PROBE, _EXEC_PROBE, ())
    if header["status"] != ExecStatus.OK.value:
        problems.append(
            f"the interpreter {python!r} does not run inside the sandbox: "
            f"{header['detail'][:300]} {blobs[1][-500:].decode(errors='replace')}"
        )
    if problems and setup.mount_jail:
        raise RuntimeError("; ".join(problems))
    notes.extend(problems)


def _run(setup: RunSetup, source: str, language, argv: tuple[str, ...]) -> tuple[dict, list[bytes]]:
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        serve_connection(child, setup, slot=0)
    child.close()
    try:
        parent.sendall(
            request_message(source, b"", language, Limits(wall_s=10, cpu_s=10), {}, argv)
        )
        parent.settimeout(60)
        return _wire.recv(parent)
    finally:
        parent.close()
        os.waitpid(pid, 0)


def setup_name(setup: RunSetup) -> str:
    parts = [
        name
        for name in ("pid_namespace", "mount_jail", "read_only_root", "minimal_root")
        if getattr(setup, name)
    ]
    return "+".join(parts) or "no namespaces"


def build_report(
    setup: RunSetup,
    seen: dict,
    config: SandboxConfig,
    notes: list[str],
    outer_uid: int,
    *,
    root_switch: str,
    visible: tuple[str, ...],
) -> IsolationReport:
    run_uids: tuple[int, ...] = ()
    if seen["uid"] == setup.uid_base:  # the probe runs in slot 0
        run_uids = (setup.uid_base, setup.uid_base + config.max_concurrency - 1)
        unprivileged = (
            f"uids {run_uids[0]}..{run_uids[1]} (one per concurrent run), no capabilities"
        )
    elif setup.mode == "userns" and int(seen["cap_eff"], 16) == 0:
        unprivileged = "user namespace, no capabilities"
        if outer_uid == 0:
            notes.append(
                "userns mode as root: programs are uid 0 outside their namespace, so "
                "root-only files stay readable (read-only); prefer mode=root"
            )
    else:
        unprivileged = "none"
    if not seen["stdlib"]:
        notes.append(
            f"programs cannot read the interpreter's files ({sys.prefix}): only modules "
            "in sandbox.preload import; install Python world-readable or allow a "
            "mount namespace"
        )
    pid_ns = seen["pid"] == 1 and seen["procs"] == [1]
    own_tmp = sorted({"work", *(path.split("/")[2] for path in setup.tmp_binds)})
    return IsolationReport(
        mode=setup.mode,
        pid_namespace=pid_ns,
        net_namespace=seen["net"] == errno.ENETUNREACH,
        mount_namespace=setup.mount_jail and seen["tmp"] == own_tmp,
        memory_cgroup=setup.memory_cgroup_root is not None and "/run-" in seen["cgroup"],
        read_only_root=bool(seen["ro"]),
        minimal_root=setup.minimal_root,
        root_switch=root_switch,
        visible=visible if setup.minimal_root else ("/ (the host's whole tree, read-only)",),
        interpreter=config.python,
        unprivileged=unprivileged,
        process_cleanup="PID namespace: the kernel kills every process when the program exits"
        if pid_ns
        else "subreaper sweep: orphans re-parent to the supervisor, which kills them",
        rlimits=RLIMITS,
        run_uids=run_uids,
        kernel=os.uname().release,
        notes=tuple(notes),
    )
