"""Status classification of finished runs, from synthetic endings (no process needed)."""

from __future__ import annotations

import signal

from areal.sandbox import CPP, PYTHON, ExecStatus, Limits
from areal.sandbox.result import Ending, classify

LIMITS = Limits(wall_s=2.0, cpu_s=1.5)


def _exited(code: int) -> int:
    return code << 8


def _status(wait_status, stderr="", language=PYTHON, **kw):
    ending = Ending(wait_status=wait_status, cpu_s=kw.pop("cpu_s", 0.1), peak_memory_bytes=1, **kw)
    return classify(ending, LIMITS, language, stderr)


def test_exit_codes_and_signals():
    assert _status(_exited(0))[:3] == (ExecStatus.OK, 0, None)
    assert _status(_exited(3))[:3] == (ExecStatus.RUNTIME_ERROR, 3, None)
    assert _status(signal.SIGSEGV)[:3] == (ExecStatus.RUNTIME_ERROR, None, signal.SIGSEGV)
    assert _status(signal.SIGABRT)[0] is ExecStatus.RUNTIME_ERROR
    status, _, sig, detail = _status(signal.SIGTERM)
    assert status is ExecStatus.KILLED and sig == signal.SIGTERM and "SIGTERM" in detail


def test_limits_take_precedence_over_the_exit_status():
    assert _status(signal.SIGKILL, timed_out=True)[0] is ExecStatus.TIMEOUT
    assert _status(_exited(0), output_overflow="stdout")[0] is ExecStatus.OUTPUT_LIMIT
    assert _status(signal.SIGXCPU, cpu_s=2.0)[0] is ExecStatus.TIMEOUT
    status, _, _, detail = _status(signal.SIGKILL, cpu_s=2.0)  # hard CPU limit (soft + 1)
    assert status is ExecStatus.TIMEOUT and "CPU-time limit 2 s" in detail
    assert _status(signal.SIGXFSZ)[0] is ExecStatus.OUTPUT_LIMIT
    assert _status(signal.SIGKILL, oom_killed=True)[0] is ExecStatus.MEMORY_LIMIT
    assert _status(_exited(1), oom_killed=True)[0] is ExecStatus.MEMORY_LIMIT  # a child was killed
    assert _status(_exited(0), oom_killed=True)[0] is ExecStatus.OK  # ...and the program coped


def test_stderr_markers_refine_failures_but_never_make_a_success():
    assert _status(_exited(1), "Traceback...\nMemoryError\n")[0] is ExecStatus.MEMORY_LIMIT
    assert (
        _status(
            signal.SIGABRT,
            "terminate called after throwing an instance of 'std::bad_alloc'",
            language=CPP,
        )[0]
        is ExecStatus.MEMORY_LIMIT
    )
    assert _status(_exited(1), "OSError: [Errno 27] File too large")[0] is ExecStatus.OUTPUT_LIMIT
    assert _status(_exited(0), "MemoryError")[0] is ExecStatus.OK
    assert _status(_exited(1), "std::bad_alloc")[0] is ExecStatus.RUNTIME_ERROR  # not a C++ run
