"""Local workers forked from a process that has imported their code once (`worker_start`).

A fresh `python -m areal.workers.<kind>` spends seconds of CPU importing torch and
transformers before it does any work; a run starts several such workers, and more after
faults. With `worker_start=preload` the pool asks a fork server instead
(controller/fork_server.py): a process started once per controller process, which imports
PRELOAD and forks a worker per request, so each starts with those modules in memory and is
otherwise the process a fresh interpreter would have been.

Why not multiprocessing's forkserver: its children re-import the parent's `__main__`
(the controller's, pytest's or a bench script's) before running, and the parent's
interpreter waits for every child at exit, while a worker ignores SIGTERM.

A worker's parent is the server, not the controller: `AREAL_PARENT_PID` names the server,
which dies with the controller, and the workers die with it (areal.workers.parent). CUDA
must not be touched before a fork, which is why `auto` execs workers placed on CUDA devices.
`PreloadedProcess` presents a forked worker through the `subprocess.Popen` methods the pool
and controller use (pid, poll, wait, kill); the server is closed and reaped when the
controller's interpreter exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.messages import WorkerKind
from areal.workers.parent import PARENT_ENV, spawning

if TYPE_CHECKING:
    from areal.config import RunConfig

log = logging.getLogger(__name__)

PRELOAD = [
    "areal.workers.rollout.worker",
    "areal.workers.rollout.torch_engine",
    "areal.workers.trainer.worker",
    "areal.workers.reward.worker",
]
"""Modules the server imports before its first fork (torch and transformers with them)."""
AGENT_PRELOAD = ["areal.workers.rollout.agent.runner"]
"""Imported besides, when the server is warmed for a run with `agent.function` set (`warm`):
the rollout worker imports its agent runner (the OpenAI client, the endpoint's server) only
for such runs."""


class PreloadedProcess:
    """A worker forked by the server, seen through `subprocess.Popen`'s methods."""

    def __init__(self, pid: int, kill: Callable[[int], None]) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._kill = kill

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL, sent by the server: it is the parent, and until it has reaped the
        worker the pid cannot belong to another process (a kill from here could reach a
        process that reused the pid after the worker ended, before its exit notice came)."""
        if self.returncode is None:
            self._kill(self.pid)


class ServerEnded(RuntimeError):
    """The fork server exited before it answered a request."""


class _Connection:
    """One running server: its process, the children it forked, replies not yet taken."""

    def __init__(self, modules: list[str]) -> None:
        self.process = spawning(  # in a thread that lasts: the server dies with its starter
            lambda: subprocess.Popen(
                [sys.executable, "-m", "areal.controller.fork_server", *modules],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, PARENT_ENV: str(os.getpid())},
            )
        )
        self.children: dict[int, PreloadedProcess] = {}
        self.started: list[PreloadedProcess | None] = []
        self.replied = threading.Condition()
        self._writing = threading.Lock()  # one line at a time on the server's stdin
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()
        log.info("started the worker fork server (pid %d)", self.process.pid)

    def _write(self, line: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        with self._writing:
            self.process.stdin.write(json.dumps(line) + "\n")
            self.process.stdin.flush()

    def preload(self, modules: list[str]) -> None:
        """Ask the server to import `modules` before its next fork (not answered)."""
        try:
            self._write({"import": modules})
        except (BrokenPipeError, ValueError):  # the server is gone: its successor imports them
            pass

    def kill(self, pid: int) -> None:
        """Ask the server to SIGKILL its child `pid` if it has not reaped it yet."""
        try:
            self._write({"kill": pid})
        except (BrokenPipeError, ValueError):  # the server is gone, its children with it
            pass

    def request(self, request: dict[str, Any]) -> PreloadedProcess:
        self._write(request)
        with self.replied:
            while not self.started:
                self.replied.wait()
            child = self.started.pop(0)
        if child is None:
            raise ServerEnded(f"the worker fork server (pid {self.process.pid}) ended")
        return child

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = _parsed_reply(line)
            if message is None:  # the protocol has no other lines: nothing to wait for here
                log.warning(
                    "the worker fork server (pid %d) wrote a line that is not a reply; skipped: %r",
                    self.process.pid,
                    line[:200],
                )
                continue
            with self.replied:
                if "pid" in message:  # registered here, before its exit notice can arrive
                    child = PreloadedProcess(message["pid"], self.kill)
                    self.children[message["pid"]] = child
                    self.started.append(child)
                    self.replied.notify_all()
                elif (ended := self.children.pop(message["exit"], None)) is not None:
                    ended._end(message["code"])
        self.process.wait()
        with self.replied:  # its children die with it (their death signal)
            for child in self.children.values():
                child._end(-signal.SIGKILL)
            self.children.clear()
            self.started.append(None)  # a request still waiting for its pid fails
            self.replied.notify_all()


def _parsed_reply(line: str) -> dict[str, int] | None:
    """A server's reply line (`{"pid": p}` or `{"exit": p, "code": c}`); None for anything
    else, which must not end the reader: a request would wait for its pid forever."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    if not isinstance(message, dict):
        return None
    keys = ("pid",) if "pid" in message else ("exit", "code")
    if not all(type(message.get(key)) is int for key in keys):
        return None
    return message


class ForkServer:
    """The controller's side: a server started on first use, and again if it ended."""

    def __init__(self, modules: list[str] | None = None) -> None:
        self.modules = list(PRELOAD if modules is None else modules)
        """What the server imports before its first fork; `warm` may add to it, and a
        server started again (after it died) imports all of it."""
        self._lock = threading.Lock()  # one request and its reply at a time
        self._connection: _Connection | None = None

    def start(
        self, module: str, args: list[str], env: dict[str, str], log_path: Path
    ) -> PreloadedProcess:
        """Fork `python -m module *args` with `env`, this process's working directory and
        its output appended to `log_path`."""
        request = {
            "module": module,
            "args": args,
            "env": env,
            "cwd": os.getcwd(),
            "log": str(log_path),
        }
        with self._lock:
            self._ensure_running()
            assert self._connection is not None
            try:
                return self._connection.request(request)
            except (BrokenPipeError, ServerEnded):  # it died since the check: once more
                self._connection = _Connection(self.modules)
                return self._connection.request(request)

    def warm(self, extra: Sequence[str] = ()) -> None:
        """Start the server now if it is not running, without waiting for its imports.
        `extra`: modules its workers will import besides `modules`, imported from now on: by
        a server started here or again later, and by one already running before its next
        fork (an application that runs an agent run after another run)."""
        with self._lock:
            missing = [name for name in extra if name not in self.modules]
            self.modules.extend(missing)
            if missing and self._connection is not None:  # a dead one's successor imports them
                self._connection.preload(missing)
            self._ensure_running()

    def _ensure_running(self) -> None:
        if self._connection is None or self._connection.process.poll() is not None:
            self._connection = _Connection(self.modules)

    def close(self) -> None:
        """End the server (its stdin closes) and reap it; its workers end with it."""
        with self._lock:
            if self._connection is not None:
                process, self._connection = self._connection.process, None
                assert process.stdin is not None
                with contextlib.suppress(BrokenPipeError):  # it may have died already
                    process.stdin.close()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


_server = ForkServer()
atexit.register(_server.close)  # reaped here, not left to init as a zombie


def start(module: str, args: list[str], env: dict[str, str], log_path: Path) -> PreloadedProcess:
    """A worker forked by this process's fork server (started on first use)."""
    return _server.start(module, args, env, log_path)


def close() -> None:
    """End this process's fork server, if one runs (the next worker started starts another):
    what a new process would find. Its workers end with it."""
    _server.close()


def forks_workers(cfg: RunConfig) -> bool:
    """Whether launcher=local forks `cfg`'s local workers from the fork server."""
    if cfg.worker_start == "auto":  # CUDA must not be touched before a fork
        devices = [*cfg.rollout.devices, *cfg.trainer.devices]
        return not any(d.startswith("cuda") for d in devices)
    return cfg.worker_start == "preload"


def warm(cfg: RunConfig) -> None:
    """Start the fork server now when `cfg`'s run will fork local workers from it, so that
    its imports (torch and transformers: seconds of CPU) run while the controller imports
    its own code and sets the run up, not after. A no-op for other launchers, for
    `worker_start=exec`, when every kind of worker joins from elsewhere, or when the server
    is already running. For an agent run it imports AGENT_PRELOAD too."""
    remote = set(cfg.controller.remote_kinds)
    if (
        cfg.launcher == "local"
        and forks_workers(cfg)
        and not remote >= {k.value for k in WorkerKind}
    ):
        _server.warm(AGENT_PRELOAD if cfg.agent.function is not None else ())
