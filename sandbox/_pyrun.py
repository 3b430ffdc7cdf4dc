"""Run a Python script inside an already-running (forked) interpreter as `python main.py` would.

What it reproduces: `__main__` module with `__file__`, `sys.argv`, `sys.path[0]` = the
script's folder, fresh text std streams over fds 0/1/2 (UTF-8, stderr line-buffered with
backslashreplace), uncaught exceptions through `sys.excepthook`, `SystemExit` codes, waiting
for non-daemon threads, atexit handlers, exit status 120 when flushing stdout fails, and a
fresh seed for `random`. What differs from a fresh interpreter: modules the launcher
preloaded are already imported, the hash seed is the launcher's (set/dict order of str keys
is the same in every run), and /proc/self/cmdline names the launcher.
"""

from __future__ import annotations

import builtins
import io
import os
import sys
import types
from typing import NoReturn

_KEEP_ALIVE: list[object] = []
"""The launcher's own std stream objects: never collected, so they never close fds 0-2."""


def run_main(path: str, argv: list[str]) -> NoReturn:
    sys.argv = [path, *argv]
    sys.path[0] = os.path.dirname(path)
    _reopen_std_streams()
    if "random" in sys.modules:
        sys.modules["random"].seed()
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins  # type: ignore[attr-defined]  # as the interpreter sets them
    main.__cached__ = None  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
        exec(code, main.__dict__)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException:  # the program's own uncaught error: report it like python does
        sys.excepthook(*sys.exc_info())
        status = 1
    os._exit(_finalize(status))


def _reopen_std_streams() -> None:
    _KEEP_ALIVE.extend(
        [sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__]
    )
    stdin = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r")), encoding="utf-8", errors="strict", newline="\n"
    )
    stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w")), encoding="utf-8", errors="strict", newline="\n"
    )
    stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w")),
        encoding="utf-8",
        errors="backslashreplace",
        newline="\n",
        line_buffering=True,
    )
    sys.stdin = sys.__stdin__ = stdin  # type: ignore[misc]  # the program's own streams
    sys.stdout = sys.__stdout__ = stdout  # type: ignore[misc]  # the program's own streams
    sys.stderr = sys.__stderr__ = stderr  # type: ignore[misc]  # the program's own streams


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # stderr closed by the program: nothing left to report on
        pass
    return 1


def _finalize(status: int) -> int:
    """The interpreter's shutdown steps that a program can observe."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # join non-daemon threads, as Py_FinalizeEx does
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = status or 1
    # CPython flushes sys.stdout/stderr, and the original stream objects when they are
    # collected at shutdown; os._exit collects nothing, so flush the originals too.
    for stream in dict.fromkeys((sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:  # e.g. EPIPE/EFBIG on the final flush
            if stream is sys.stdout or stream is sys.__stdout__:
                status = 120  # what CPython returns when flushing stdout fails at exit
    return status
