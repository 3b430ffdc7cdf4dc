"""Hostile programs: each is contained, classified, and leaves the launcher alive with no
process behind. Runs are sequential so that a leftover can be pinned on its program."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field

import pytest

from areal.sandbox import ExecStatus, Limits


FAST = Limits(
    wall_s=1.0,
    cpu_s=1.0,
    memory_bytes=512 << 20,
    file_size_bytes=4 << 20,
    disk_bytes=8 << 20,
    num_processes=32,
    stdout_bytes=1 << 20,
    stderr_bytes=64 << 10,
)
SLOW = dataclasses.replace(FAST, wall_s=20.0, cpu_s=20.0)
"""For programs that must reach a limit other than time (allocation is slow in this VM)."""


@dataclass(frozen=True)
class Case:
    source: str
    expected: ExecStatus
    limits: Limits = FAST
    stdout_has: tuple[str, ...] = field(default=())


CASES = {
    "infinite_loop": Case("while True:\n    pass", ExecStatus.TIMEOUT),
    "sleep_forever": Case(
        "import time\ntime.sleep(10**6)", ExecStatus.TIMEOUT, Limits(wall_s=1.0, cpu_s=5.0)
    ),
    "fork_bomb_persistent": Case(
        """
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.001)
        """,
        ExecStatus.TIMEOUT,
        Limits(wall_s=1.0, cpu_s=5.0, num_processes=32),
    ),
    "fork_bomb_crashing": Case("import os\nwhile True:\n    os.fork()", ExecStatus.RUNTIME_ERROR),
    "thread_bomb": Case(
        """
        import threading, time
        while True:
            threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
        """,
        ExecStatus.RUNTIME_ERROR,
    ),
    "memory_bomb_at_once": Case("x = bytearray(8 * 1024**3)", ExecStatus.MEMORY_LIMIT),
    # Each process stays under its own address-space limit; together they exceed the run's.
    "memory_bomb_across_processes": Case(
        """
        import os, time
        kids = []
        for _ in range(8):
            pid = os.fork()
            if pid == 0:
                block = bytearray(b'x') * (300 << 20)
                time.sleep(3)
                os._exit(0)
            kids.append(pid)
        statuses = [os.waitpid(kid, 0)[1] for kid in kids]
        raise SystemExit(1 if any(os.WIFSIGNALED(s) for s in statuses) else 0)
        """,
        ExecStatus.MEMORY_LIMIT,
        dataclasses.replace(SLOW, run_memory_bytes=512 << 20),
    ),
    "memory_bomb_gradual": Case(
        """
        chunks = []
        while True:
            chunks.append(bytearray(10**7))
        """,
        ExecStatus.MEMORY_LIMIT,
        SLOW,
    ),
    # Python 3.11 keeps Python frames on the heap: unbounded recursion exhausts memory, and
    # CPython reports the failed frame allocation as "SystemError: error return without
    # exception set" (exit 1), a runtime error...
    "deep_recursion": Case(
        """
        import sys
        sys.setrecursionlimit(10**8)
        def f(n):
            return f(n + 1) + 1
        f(0)
        """,
        ExecStatus.RUNTIME_ERROR,
        dataclasses.replace(SLOW, memory_bytes=128 << 20),
    ),
    # ...while recursion inside C code (repr of a deeply nested list) overflows the C stack.
    "c_stack_overflow": Case(
        """
        import sys
        sys.setrecursionlimit(10**8)
        x = []
        for _ in range(10**6):
            x = [x]
        repr(x)
        """,
        ExecStatus.RUNTIME_ERROR,
        SLOW,
    ),
    "huge_stdout": Case("while True:\n    print('x' * 4096)", ExecStatus.OUTPUT_LIMIT),
    "infinite_stderr": Case(
        "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)", ExecStatus.OUTPUT_LIMIT
    ),
    "large_file": Case(
        """
        with open('big.bin', 'wb') as f:
            while True:
                f.write(b'x' * (1 << 20))
                f.flush()
        """,
        ExecStatus.OUTPUT_LIMIT,
    ),
    "fill_tmp_disk": Case(
        """
        i = 0
        while True:
            with open(f'/tmp/f{i}', 'wb') as f:
                f.write(b'x' * (1 << 20))
            i += 1
        """,
        ExecStatus.OUTPUT_LIMIT,
    ),
    "ignore_sigterm": Case(
        """
        import signal, time
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        while True:
            time.sleep(0.01)
        """,
        ExecStatus.TIMEOUT,
    ),
    "ignore_sigxcpu_busy": Case(
        """
        import signal
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        while True:
            pass
        """,
        ExecStatus.TIMEOUT,
        Limits(wall_s=10.0, cpu_s=1.0),
    ),
    "raise_own_limits": Case(
        """
        import resource
        raised = []
        for name in ('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE'):
            r = getattr(resource, name)
            try:
                resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                raised.append(name)
            except (ValueError, OSError):
                pass
        print('raised:', raised, flush=True)
        x = bytearray(2 * 1024**3)
        """,
        ExecStatus.MEMORY_LIMIT,
        stdout_has=("raised: []",),
    ),
    "segfault_ctypes": Case("import ctypes\nctypes.string_at(0)", ExecStatus.RUNTIME_ERROR),
    "abort_native": Case("import os\nos.abort()", ExecStatus.RUNTIME_ERROR),
    "busy_loop_in_c_regex": Case(
        "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')", ExecStatus.TIMEOUT
    ),
    "close_std_streams": Case("import os\nos.close(1)\nos.close(2)\nos.close(0)", ExecStatus.OK),
    "read_etc_shadow": Case("print(open('/etc/shadow').read())", ExecStatus.RUNTIME_ERROR),
    "become_root": Case("import os\nos.setuid(0)", ExecStatus.RUNTIME_ERROR),
    "fd_exhaustion": Case(
        "fs = []\nwhile True:\n    fs.append(open('/dev/null'))", ExecStatus.RUNTIME_ERROR
    ),
    "spawn_shell_with_background_jobs": Case(
        """
        import subprocess
        subprocess.Popen(['sh', '-c', 'sleep 1000 & sleep 1000 & echo started'])
        import time; time.sleep(0.2)
        print('done')
        """,
        ExecStatus.OK,
        stdout_has=("done",),
    ),
    "child_stops_itself": Case(
        """
        import os, signal
        if os.fork() == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        print('parent leaves')
        """,
        ExecStatus.OK,
        stdout_has=("parent leaves",),
    ),
    # The program is PID 1 of its namespace: it sees no one else and cannot even kill itself.
    "kill_everything_visible": Case(
        """
        import os, signal
        for pid in [*range(1, 4096), -1, 0, os.getppid()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        print('survived')
        """,
        ExecStatus.OK,
        stdout_has=("survived",),
    ),
    "sees_only_itself_in_proc": Case(
        """
        import os
        print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
        """,
        ExecStatus.OK,
        stdout_has=("[1]",),
    ),
    "unicode_garbage_output": Case(
        """
        import sys
        sys.stdout.buffer.write(bytes(range(256)) * 40)
        sys.stderr.write('\\udcff'.encode('utf-8', 'surrogatepass').decode('latin-1'))
        """,
        ExecStatus.OK,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_program_is_contained_and_classified(sandbox, run_contained, name):
    case = CASES[name]
    result = run_contained(case.source, case.limits)
    assert result.status is case.expected, (result.status, result.detail, result.stderr_text[-500:])
    for text in case.stdout_has:
        assert text in result.stdout_text
    if case.expected is ExecStatus.OUTPUT_LIMIT and name in ("huge_stdout", "infinite_stderr"):
        captured = result.stdout if name == "huge_stdout" else result.stderr
        cap = case.limits.stdout_bytes if name == "huge_stdout" else case.limits.stderr_bytes
        assert len(captured) == cap
    assert sandbox.run("print(6*7)").stdout == b"42\n", "sandbox unusable after the run"


def test_unicode_garbage_bytes_arrive_intact(sandbox):
    result = sandbox.run("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 40)")
    assert result.status is ExecStatus.OK
    assert result.stdout == bytes(range(256)) * 40
    assert "\ufffd" in result.stdout_text  # invalid UTF-8 decodes with replacement, no error


def test_secret_in_parent_environment_is_invisible(run_contained, secret):
    assert os.environ.get("AREAL_TEST_SECRET_TOKEN") == secret
    source = """
        import os
        print(dict(os.environ))
        for pid in os.listdir('/proc'):
            for name in ('environ', 'cmdline'):
                try:
                    print(open(f'/proc/{pid}/{name}', 'rb').read())
                except OSError as exc:
                    print(pid, name, exc)
        """
    result = run_contained(source, FAST)
    assert result.status is ExecStatus.OK, result.stderr_text
    assert "HOME" in result.stdout_text and secret not in result.stdout_text
    assert "AREAL_TEST_SECRET_TOKEN" not in result.stdout_text


def test_connect_to_listening_loopback_socket_never_arrives(run_contained, free_port):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_port))
        listener.listen(1)
        listener.setblocking(False)
        source = f"""
            import socket
            s = socket.socket()
            s.settimeout(2)
            s.connect(('127.0.0.1', {free_port}))
            s.sendall(b'escaped')
            """
        result = run_contained(source, FAST)
        assert result.status is ExecStatus.RUNTIME_ERROR
        assert "Network is unreachable" in result.stderr_text
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.slow
def test_daemonised_grandchild_dies_with_the_run(run_contained, tmp_path):
    tmp_path.chmod(0o777)
    marker = tmp_path / "daemon-was-here"
    source = f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(1.5)
                for path in ({str(marker)!r}, '/tmp/daemon-was-here'):
                    try:
                        open(path, 'w').write('alive')
                    except OSError:
                        pass
                time.sleep(1000)
            os._exit(0)
        print('parent exits now')
        """
    result = run_contained(source, FAST)
    assert result.status is ExecStatus.OK and b"parent exits now" in result.stdout
    time.sleep(2.0)
    assert not marker.exists()


def test_writes_outside_working_directory_do_not_reach_the_host(run_contained, tmp_path):
    tmp_path.chmod(0o777)
    host_file = tmp_path / "from-sandbox"
    host_tmp = f"/tmp/areal-sandbox-escape-{os.getpid()}"
    source = f"""
        import os
        for path in ({str(host_file)!r}, {host_tmp!r}, '/etc/areal-escape', '/root/areal-escape',
                     '/work/areal-escape', '../escape', '/dev/shm/escape'):
            try:
                with open(path, 'w') as f:
                    f.write('x')
                print('wrote', path)
            except OSError as exc:
                print('refused', path, exc.strerror)
        """
    result = run_contained(source, FAST)
    assert result.status is ExecStatus.OK, result.stderr_text
    for path in (
        str(host_file),
        host_tmp,
        "/etc/areal-escape",
        "/root/areal-escape",
        "/work/areal-escape",
        "/tmp/escape",
        "/dev/shm/escape",
    ):
        assert not os.path.exists(path), path
    assert f"refused {host_file}" in result.stdout_text  # read-only root: EROFS


def test_killing_the_parent_leaves_test_process_and_launcher_alive(sandbox, run_contained):
    source = f"""
        import os, signal
        for pid in (os.getppid(), {os.getpid()}, {sandbox.launcher_pid}, 1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as exc:
                print(pid, exc.strerror)
        print('still here')
        """
    result = run_contained(source, FAST)
    # Host pids do not exist in the run's PID namespace; getppid() is 0 there, and SIGKILL
    # from inside a namespace to its init (the program itself) is ignored by the kernel.
    assert result.status is ExecStatus.OK and "still here" in result.stdout_text
    assert f"{os.getpid()} No such process" in result.stdout_text
    assert sandbox.run("print('alive')").stdout == b"alive\n"
