"""The sandbox as a program runner: I/O, exit statuses, languages, concurrency, isolation
report and policy, launcher lifecycle, and the fallback modes."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from areal.sandbox import (
    CPP,
    PYTHON_EXEC,
    ExecStatus,
    IsolationError,
    IsolationReport,
    Limits,
    Sandbox,
    SandboxConfig,
    SandboxConfigError,
)
from areal.sandbox.client import check_isolation_policy

QUICK = Limits(wall_s=5.0, cpu_s=5.0)


def test_stdin_argv_and_extra_files_reach_the_program(sandbox):
    source = textwrap.dedent("""
        import sys
        data = sys.stdin.read().split()
        print(sum(map(int, data)), sys.argv[1:], open('table.txt').read().strip())
        print(__name__, sys.argv[0])
        """)
    result = sandbox.run(
        source, stdin="1 2 3\n4\n", argv=("-x", "y"), files={"table.txt": b"T\n"}, limits=QUICK
    )
    assert result.status is ExecStatus.OK, result.stderr_text
    assert result.stdout_text.splitlines() == ["10 ['-x', 'y'] T", "__main__ /tmp/work/main.py"]
    assert result.exit_code == 0 and result.signal is None
    assert result.wall_s > 0 and result.peak_memory_bytes > 0


def test_exit_status_exceptions_and_stderr_are_reported(sandbox):
    assert sandbox.run("import sys; sys.exit(7)").exit_code == 7
    failed = sandbox.run("def f():\n    raise ValueError('bad input')\nf()")
    assert failed.status is ExecStatus.RUNTIME_ERROR and failed.exit_code == 1
    assert (
        "ValueError: bad input" in failed.stderr_text and 'main.py", line 2' in failed.stderr_text
    )
    message = sandbox.run("raise SystemExit('goodbye')")
    assert message.exit_code == 1 and message.stderr_text == "goodbye\n"
    syntax = sandbox.run("def (:")
    assert syntax.status is ExecStatus.RUNTIME_ERROR and "SyntaxError" in syntax.stderr_text


def test_in_process_python_behaves_like_a_fresh_interpreter(sandbox):
    source = textwrap.dedent("""
        import atexit, random, sys, threading, time
        atexit.register(lambda: print('atexit ran'))
        def late():
            time.sleep(0.2)
            print('thread finished')
        threading.Thread(target=late).start()
        print(random.random(), sys.stdin.readline().strip(), sys.stdout.encoding)
        """)
    first = sandbox.run(source, stdin="héllo\n", limits=QUICK)
    second = sandbox.run(source, stdin="héllo\n", limits=QUICK)
    assert first.status is ExecStatus.OK, first.stderr_text
    lines = first.stdout_text.splitlines()
    assert lines[0].endswith("héllo utf-8")
    assert lines[1:] == ["thread finished", "atexit ran"]  # non-daemon threads joined, then atexit
    assert first.stdout_text.split()[0] != second.stdout_text.split()[0]  # random reseeded per run


def test_large_stdin_and_stdout_round_trip(sandbox):
    payload = ("0123456789" * 100 + "\n") * 2000  # ~2 MB, larger than any pipe buffer
    result = sandbox.run(
        "import sys\nsys.stdout.write(sys.stdin.read())", stdin=payload, limits=QUICK
    )
    assert result.status is ExecStatus.OK and result.stdout_text == payload


def test_python_exec_language_runs_a_fresh_interpreter(sandbox):
    result = sandbox.run(
        "import sys\nprint(sys.argv[0], input())", stdin="x\n", language=PYTHON_EXEC, limits=QUICK
    )
    assert result.status is ExecStatus.OK, (result.detail, result.stderr_text)
    assert result.stdout_text == "main.py x\n"


@pytest.mark.slow
def test_cpp_is_compiled_and_run_in_the_sandbox(sandbox):
    source = '#include <cstdio>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}'
    result = sandbox.run(source, stdin="2 40", language=CPP, limits=QUICK)
    assert result.status is ExecStatus.OK, (result.detail, result.stderr_text)
    assert result.stdout_text == "42\n"
    broken = sandbox.run("int main(){ return x; }", language=CPP, limits=QUICK)
    assert broken.status is ExecStatus.COMPILE_ERROR and "error" in broken.stderr_text


def test_concurrent_runs_from_threads_and_asyncio_get_their_own_results(sandbox):
    source = "import time\nn = int(input())\ntime.sleep(0.05)\nprint(n * n)"
    with ThreadPoolExecutor(8) as executor:
        results = list(
            executor.map(lambda n: sandbox.run(source, stdin=f"{n}\n", limits=QUICK), range(16))
        )
    assert [r.stdout_text for r in results] == [f"{n * n}\n" for n in range(16)]

    async def many():
        return await asyncio.gather(
            *(sandbox.run_async(source, stdin=f"{n}\n", limits=QUICK) for n in range(16))
        )

    assert [r.stdout_text for r in asyncio.run(many())] == [f"{n * n}\n" for n in range(16)]


def test_isolation_report_matches_what_a_program_observes(sandbox):
    report = sandbox.isolation
    if report.level != "full":
        pytest.skip(f"this kernel does not allow full isolation:\n{report.describe()}")
    assert report.mode == "root" and report.pid_namespace and report.net_namespace
    assert report.mount_namespace and report.read_only_root
    assert "RLIMIT_NPROC" in report.rlimits and report.run_uids[0] >= 61000
    first, last = report.run_uids
    assert (
        last - first + 1 == sandbox.config.max_concurrency
        and f"uids {first}.." in report.unprivileged
    )
    seen = sandbox.run("import os\nprint(os.getpid(), os.getuid(), sorted(os.listdir('/tmp')))")
    pid, uid, tmp = seen.stdout_text.split(" ", 2)
    # The run's own /tmp: its working directory, and the way to exposed paths below /tmp.
    exposed_below_tmp = {
        entry.split("/")[2] for entry in report.visible if entry.startswith("/tmp/")
    }
    assert pid == "1" and first <= int(uid) <= last
    assert eval(tmp) == sorted({"work", *exposed_below_tmp})


def test_launchers_on_one_machine_get_disjoint_uid_blocks(sandbox, sandbox_factory):
    other = sandbox_factory()
    if not (sandbox.isolation.run_uids and other.isolation.run_uids):
        pytest.skip("not in root mode: programs keep the caller's uid")
    mine, theirs = sandbox.isolation.run_uids, other.isolation.run_uids
    assert mine[1] < theirs[0] or theirs[1] < mine[0]


def test_peak_memory_is_the_whole_runs_own(sandbox):
    if not sandbox.isolation.memory_cgroup:
        pytest.skip("no memory cgroup: peak is the main process's ru_maxrss")
    small = sandbox.run("print(1)")
    big = sandbox.run(
        "import os, time\nif os.fork() == 0:\n    x = bytearray(b'x') * (80 << 20)\n"
        "    os._exit(0)\ny = bytearray(b'y') * (60 << 20)\nos.wait()",
        limits=QUICK,
    )
    assert big.status is ExecStatus.OK, big.stderr_text
    assert small.peak_memory_bytes < 40 << 20  # the launcher's shared pages are not charged
    assert big.peak_memory_bytes > 60 << 20, big.peak_memory_bytes
    mine = glob.glob(
        f"/sys/fs/cgroup/memory/**/areal-sandbox-{sandbox.launcher_pid}", recursive=True
    )
    assert len(mine) == 1 and glob.glob(f"{mine[0]}/run-*") == []  # removed before answering


def test_running_without_isolation_is_refused_unless_allowed():
    bare = IsolationReport(mode="none", unprivileged="none", kernel="x", notes=("unshare: EPERM",))
    with pytest.raises(IsolationError, match="allow_unisolated"):
        check_isolation_policy(bare, allow_unisolated=False)
    check_isolation_policy(bare, allow_unisolated=True)
    with pytest.raises(SandboxConfigError, match="allow_unisolated"):
        SandboxConfig(mode="none")
    with pytest.raises(SandboxConfigError, match="Limits.wall_s=0"):
        Limits(wall_s=0)
    with pytest.raises(SandboxConfigError, match="sandbox.mode='jail'"):
        SandboxConfig(mode="jail")


@pytest.mark.slow
def test_launcher_death_is_survived(sandbox_factory):
    sb = sandbox_factory()
    old = sb.launcher_pid
    slow = threading.Thread(
        target=lambda: results.append(
            sb.run("import time; time.sleep(0.5); print('done')", limits=QUICK)
        )
    )
    results = []
    slow.start()
    time.sleep(0.2)
    os.kill(old, signal.SIGKILL)  # the in-flight run's supervisor is independent of it
    slow.join()
    assert results[0].status is ExecStatus.OK and results[0].stdout == b"done\n"
    assert sb.run("print('again')").stdout == b"again\n" and sb.launcher_pid != old
    second = psutil.Process(sb.launcher_pid)
    doomed = [second, *second.children()]  # idle spare supervisors die with their launcher
    second.kill()
    _, alive = psutil.wait_procs(doomed, timeout=10)
    assert alive == []
    assert asyncio.run(sb.run_async("print('async')")).stdout == b"async\n"
    assert sb.launcher_pid != second.pid


def test_close_kills_in_flight_runs(sandbox_factory):
    sb = sandbox_factory()
    results = []
    runner = threading.Thread(
        target=lambda: results.append(
            sb.run("import time; time.sleep(60)", limits=Limits(wall_s=60, cpu_s=60))
        )
    )
    runner.start()
    time.sleep(0.3)
    launcher = psutil.Process(sb.launcher_pid)
    started = time.monotonic()
    sb.close()
    runner.join(timeout=15)
    assert not runner.is_alive() and time.monotonic() - started < 10
    assert results[0].status is ExecStatus.SANDBOX_ERROR
    assert not launcher.is_running()
    after = sb.run("print(1)")
    assert after.status is ExecStatus.SANDBOX_ERROR and "closed" in after.detail


@pytest.mark.slow
def test_user_namespace_mode_isolates_without_root_privileges(sandbox_factory):
    sb = sandbox_factory(SandboxConfig(mode="userns"))
    report = sb.isolation
    assert report.mode == "userns" and report.level == "full", report.describe()
    if os.geteuid() != 0:
        # As root the program keeps root's real uid, which the kernel exempts from
        # RLIMIT_NPROC (SandboxConfig.mode): a fork bomb there once filled the machine's
        # memory (over a thousand processes) and the OOM killer took the test processes.
        bomb = sb.run(
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            limits=Limits(wall_s=1, cpu_s=5, num_processes=16),
        )
        assert bomb.status is ExecStatus.TIMEOUT
    net = sb.run("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert net.status is ExecStatus.RUNTIME_ERROR and "unreachable" in net.stderr_text
    caps = sb.run("print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0])")
    assert caps.stdout_text.split()[1] == "0000000000000000"


@pytest.mark.slow
def test_unisolated_mode_still_kills_daemons_and_removes_the_workdir(sandbox_factory, tmp_path):
    sb = sandbox_factory(SandboxConfig(mode="none", allow_unisolated=True))
    assert sb.isolation.level == "none"
    tmp_path.chmod(0o777)
    marker = tmp_path / "daemon-was-here"
    source = textwrap.dedent(f"""
        import os, time
        print(os.getcwd(), flush=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(1.0)
                open({str(marker)!r}, 'w').write('alive')
                time.sleep(1000)
            os._exit(0)
        """)
    result = sb.run(source, limits=QUICK)
    assert result.status is ExecStatus.OK, result.stderr_text
    workdir = result.stdout_text.strip()
    time.sleep(1.5)
    assert not marker.exists() and not os.path.exists(workdir)
    launcher = psutil.Process(sb.launcher_pid)
    assert all(p.children() == [] for p in launcher.children())  # only idle spare supervisors
    looping = sb.run("while True:\n    pass", limits=Limits(wall_s=0.5, cpu_s=5))
    assert looping.status is ExecStatus.TIMEOUT


@pytest.fixture
def sandbox_factory():
    made: list[Sandbox] = []

    def make(config: SandboxConfig | None = None) -> Sandbox:
        sb = Sandbox(config or SandboxConfig())
        sb.start()
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


def test_memory_cgroup_can_be_turned_off(sandbox_factory):
    sb = sandbox_factory(SandboxConfig(memory_cgroup=False))
    assert not sb.isolation.memory_cgroup
    assert sb.run("print(2)").stdout == b"2\n"
