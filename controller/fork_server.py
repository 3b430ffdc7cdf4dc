"""`python -m areal.controller.fork_server MODULE...`: the server side of worker_start=preload.

It imports MODULE... (the controller passes controller/preload.py's PRELOAD: the workers'
modules, torch and transformers with them), then forks a worker per request read from its
stdin until that closes. The protocol is one JSON object per line: a request (module, args,
env, cwd, log), the child's pid on stdout, and later `{"exit": pid, "code": c}` when the
child ends (`c` as `Popen.returncode`: negative for a signal); `{"kill": pid}` SIGKILLs that
child if it has not been reaped yet, and `{"import": [module, ...]}` imports those modules
before the next fork (a module that fails to import is reported on stderr and left to the
workers that need it); neither is answered. Nothing else reaches that stdout: what the
imports print goes to stderr. The server dies with the
controller (areal.workers.parent), and each child with the server.

In the child, `become_worker` makes it the process a fresh `python -m module args` would
have been: the worker's environment, working directory and module path, its output
(unbuffered, as under PYTHONUNBUFFERED) in its log file, its command line as ps shows it,
then the module run as `__main__`. Variables that a preloaded library reads only when it is
imported keep the server's values; the thread settings the pool passes are applied again by
the workers (torch.set_num_threads).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import sys
import traceback
from typing import IO, Any, NoReturn

import setproctitle

from areal.workers.parent import PARENT_ENV, die_with_parent

REAP_EVERY_S = 0.1
"""How often the server looks for ended children between requests."""


def serve(requests: int, replies: IO[str]) -> None:
    """Fork a child per request line read from fd `requests` until it closes; report each
    child's pid when forked and its exit code when it ends."""
    children: set[int] = set()
    server = os.getpid()  # what each child names as its parent (see become_worker)
    pending = b""
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    while True:
        if selector.select(REAP_EVERY_S):
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                if "kill" in request:  # only a child not yet reaped: its pid is still its own
                    if request["kill"] in children:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(request["kill"], signal.SIGKILL)
                    continue
                if "import" in request:
                    _import_more(request["import"])
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    os.close(replies.fileno())  # the controller's pipe: not the worker's
                    _run_child(request, server)
                children.add(pid)
                _reply(replies, {"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _reply(replies, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _import_more(names: list[str]) -> None:
    """Import `names` for the children forked from now on. A failure must not end the
    server, whose children die with it: the worker that needs the module imports it
    itself, and reports the failure there."""
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as err:  # whatever user code does at import
            print(
                f"fork server: {name} not preloaded ({type(err).__name__}: {err})", file=sys.stderr
            )


def _reply(replies: IO[str], message: dict[str, Any]) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


def _run_child(request: dict[str, Any], server: int) -> NoReturn:
    """The forked child's whole life: the worker, then its exit code as Python's own."""
    code = 0
    try:
        become_worker(request, server)
    except SystemExit as stop:
        if isinstance(stop.code, int):
            code = stop.code
        elif stop.code is not None:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def become_worker(request: dict[str, Any], server: int) -> None:
    """In the forked child: run `python -m module *args` as the pool would have run it.
    `server` is the pid of the process that forked it, read before the fork: if that
    process has died since, `os.getppid()` names whoever adopted the child instead, and
    the child would outlive the server and the controller (die_with_parent kills it)."""
    env, cwd = request["env"], request["cwd"]
    os.environ.clear()
    os.environ.update(env)
    os.environ[PARENT_ENV] = str(server)  # it exits with the controller
    die_with_parent()  # at once: a fork does not inherit the server's death signal
    os.chdir(cwd)
    # `python -m` puts the working directory first, then PYTHONPATH; files written since the
    # server started (a user's module in a fresh directory) must be found.
    extra = [cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    importlib.invalidate_caches()
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (out, 2)):
        os.dup2(fd, target)
    os.close(out)
    os.close(null)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115  # open until exit
    sys.stdout, sys.stderr = _unbuffered(1), _unbuffered(2)
    sys.argv = [request["module"], *request["args"]]
    # what ps, psutil and a launcher's tools show: the command a fresh worker would have run
    setproctitle.setproctitle(" ".join([sys.executable, "-m", *sys.argv]))
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _unbuffered(fd: int) -> IO[str]:
    """A text stream on `fd` that writes through at once, as under PYTHONUNBUFFERED."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)


def main() -> None:
    die_with_parent()
    setproctitle.getproctitle()  # find the command line's memory now, before a child needs it
    # The replies go on a copy of stdout, and stdout itself to stderr: whatever an import
    # prints (Python or C) cannot corrupt the protocol.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    for name in sys.argv[1:]:
        importlib.import_module(name)
    serve(sys.stdin.fileno(), replies)
    os._exit(0)  # nothing to clean up; its workers end by their death signal


if __name__ == "__main__":
    main()
