"""`Sandbox`: the caller's handle on one warm launcher. Thread-safe and asyncio-friendly.

    sb = Sandbox(SandboxConfig())         # nothing started yet
    report = sb.start()                   # spawns the launcher, returns its IsolationReport
    result = sb.run("print(input())", stdin=b"hi\\n")          # blocking, any thread
    result = await sb.run_async(source, stdin=..., limits=...)  # on an event loop
    sb.close()

Each run is one unix-socket connection to the launcher, so concurrent calls need no lock
and never share state. If the launcher has died, the next call starts a new one (and the
call that was in flight when it died returns status sandbox_error). `start()` raises
`IsolationError` when no namespace isolation is in force and the config does not allow it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import selectors
import socket
import subprocess
import sys
import threading

from areal.sandbox import _wire
from areal.sandbox._supervisor import SETUP_ALLOWANCE_S, request_message
from areal.sandbox.result import ExecResult, ExecStatus, IsolationReport
from areal.sandbox.spec import PYTHON, Language, Limits, SandboxConfig

_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[2]); "
    "from areal.sandbox.zygote import main; main()"
)


class IsolationError(RuntimeError):
    """The launcher could not isolate runs and the config does not allow running without."""


class SandboxStartError(RuntimeError):
    """The launcher process failed to start or to report its isolation."""


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._socket_path = ""
        self._isolation: IsolationReport | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> IsolationReport:
        """Start the launcher if it is not running; return the isolation in force."""
        with self._lock:
            if self._closed:
                raise SandboxStartError("this Sandbox was closed; create a new one")
            if self._proc is None or self._proc.poll() is not None:
                self._spawn()
            assert self._isolation is not None
            return self._isolation

    @property
    def isolation(self) -> IsolationReport:
        return self.start()

    @property
    def launcher_pid(self) -> int | None:
        """Process id of the launcher (for monitoring), or None before `start()`."""
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Stop the launcher for good; in-flight and later runs answer sandbox_error."""
        with self._lock:
            proc, self._proc = self._proc, None
            self._closed = True
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()  # EOF tells the launcher to terminate its runs and exit
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _spawn(self) -> None:
        cfg = self.config
        if self._socket_path:  # a launcher that was killed could not remove its socket folder
            shutil.rmtree(os.path.dirname(self._socket_path), ignore_errors=True)
        payload = json.dumps(dataclasses.asdict(cfg))
        self._proc = subprocess.Popen(
            [cfg.python, "-c", _BOOT, payload, json.dumps(sys.path), os.getcwd()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            cwd="/",
            env=dict(cfg.env),
            close_fds=True,
            start_new_session=True,
        )
        line = self._read_handshake(cfg.startup_timeout_s)
        if "error" in line:
            self._abandon()
            raise SandboxStartError(f"sandbox launcher failed to start: {line['error']}")
        report = IsolationReport.from_json(line["isolation"])
        try:
            check_isolation_policy(
                report, allow_unisolated=cfg.allow_unisolated, minimal_root=cfg.minimal_root
            )
        except IsolationError:
            self._abandon()
            raise
        self._socket_path = line["socket"]
        self._isolation = report

    def _read_handshake(self, timeout_s: float) -> dict:
        assert self._proc is not None and self._proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                self._abandon()
                raise SandboxStartError(
                    f"sandbox launcher did not report within {timeout_s} s "
                    "(sandbox.startup_timeout_s)"
                )
        raw = self._proc.stdout.readline()
        self._proc.stdout.close()
        if not raw:
            code = self._proc.wait()
            raise SandboxStartError(
                f"sandbox launcher exited with status {code} before reporting "
                "(its traceback is on stderr)"
            )
        return json.loads(raw)

    def _abandon(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    # -- runs --------------------------------------------------------------------------

    def run(
        self,
        source: str | bytes,
        *,
        stdin: bytes | str = b"",
        language: Language = PYTHON,
        limits: Limits | None = None,
        files: dict[str, bytes] | None = None,
        argv: tuple[str, ...] = (),
    ) -> ExecResult:
        """Run `source` once; blocks until it ends. Never raises for anything the program
        does; a failure of the sandbox itself is status sandbox_error."""
        limits = limits or self.config.limits
        message = self._message(source, stdin, language, limits, files, argv)
        try:
            with self._connect() as conn:
                conn.settimeout(self._budget(language, limits))
                conn.sendall(message)
                header, blobs = _wire.recv(conn)
        except (OSError, _wire.WireError, SandboxStartError) as exc:
            return _lost(exc)
        return ExecResult.from_header(header, blobs[0], blobs[1])

    async def run_async(
        self,
        source: str | bytes,
        *,
        stdin: bytes | str = b"",
        language: Language = PYTHON,
        limits: Limits | None = None,
        files: dict[str, bytes] | None = None,
        argv: tuple[str, ...] = (),
    ) -> ExecResult:
        """`run` on the event loop: one connection, no thread."""
        limits = limits or self.config.limits
        message = self._message(source, stdin, language, limits, files, argv)
        writer = None
        if self._proc is None or self._proc.poll() is not None:
            try:
                await asyncio.to_thread(self.start)
            except SandboxStartError as exc:
                return _lost(exc)
        try:
            async with asyncio.timeout(self._budget(language, limits)):
                try:
                    reader, writer = await asyncio.open_unix_connection(self._socket_path)
                except OSError:
                    await asyncio.to_thread(self._respawn_if_dead)
                    reader, writer = await asyncio.open_unix_connection(self._socket_path)
                writer.write(message)
                await writer.drain()
                header, blobs = await _wire.recv_async(reader)
        except (OSError, _wire.WireError, TimeoutError, SandboxStartError) as exc:
            return _lost(exc)
        finally:
            if writer is not None:
                writer.close()
        return ExecResult.from_header(header, blobs[0], blobs[1])

    def _message(
        self,
        source: str | bytes,
        stdin: bytes | str,
        language: Language,
        limits: Limits,
        files: dict[str, bytes] | None,
        argv: tuple[str, ...],
    ) -> bytes:
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else stdin
        return request_message(
            source, stdin_bytes, language, limits, dict(files or {}), tuple(argv)
        )

    def _budget(self, language: Language, limits: Limits) -> float:
        return (
            SETUP_ALLOWANCE_S + language.compile_wall_s + limits.wall_s + self.config.result_grace_s
        )

    def _connect(self) -> socket.socket:
        self.start()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._socket_path)
        except OSError:
            conn.close()
            self._respawn_if_dead()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self._socket_path)
        return conn

    def _respawn_if_dead(self) -> None:
        """The launcher died between start() and connect: start a new one (once per call)."""
        with self._lock:
            if self._closed:
                raise SandboxStartError("this Sandbox was closed; create a new one")
            if self._proc is not None and self._proc.poll() is None:
                raise ConnectionError(
                    f"sandbox launcher {self._proc.pid} is alive but refuses connections"
                )
            self._spawn()


def check_isolation_policy(
    report: IsolationReport, *, allow_unisolated: bool, minimal_root: bool = False
) -> None:
    """Refuse a launcher with neither a PID nor a network namespace unless allowed, and one
    without the minimal root the config asks for."""
    if report.level == "none" and not allow_unisolated:
        raise IsolationError(
            "sandbox: no PID or network namespace could be created, so untrusted code would "
            "see the host's processes and network.\n"
            f"{report.describe()}\nFix: allow user namespaces (sysctl user.max_user_namespaces>0; "
            "on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0; in Docker run with "
            "--security-opt seccomp=unconfined or as a privileged container), or set "
            "sandbox.allow_unisolated=true to accept running without them."
        )
    if minimal_root and not report.minimal_root and report.level != "none":
        raise IsolationError(
            "sandbox: no minimal root could be built, so untrusted code would see the host's "
            f"whole file tree (read-only).\n{report.describe()}\nFix: allow mount namespaces "
            "(run as root, or allow user namespaces as above), or set "
            "SandboxConfig(minimal_root=False) to accept the host's read-only tree."
        )


def _lost(exc: BaseException) -> ExecResult:
    return ExecResult(
        status=ExecStatus.SANDBOX_ERROR,
        detail=f"no answer from the sandbox launcher: {type(exc).__name__}: {exc}",
    )
