"""The fork server (controller/preload.py) as real processes: a forked worker is the process
`python -m module args` would have been (environment, working directory, module path,
arguments, unbuffered output in its log, exit code, death by signal), it dies with the
server, and the server is started again after it ended. The pool forks unless a worker is
on a CUDA device (worker_start=auto)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from areal.config import ConfigError, load_config
from areal.controller.pool import WorkerPool
from areal.controller import preload
from areal.controller.preload import ForkServer
from areal.workers.parent import PARENT_ENV

MODULE = """
import os, sys, time
print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("var", os.environ.get("PRELOAD_TEST_VAR"), "parent", os.environ["{parent}"])
print("ppid", os.getppid())
print("preloaded by", getattr(sys.modules.get("quiet_preloaded"), "PID", None))
sys.stderr.write("to stderr, no newline")
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def server():
    server = ForkServer(modules=[])  # the workers' modules take seconds to import
    yield server
    server.close()


@pytest.fixture
def user_module(tmp_path):
    """A module in a directory the server has never seen, found through PYTHONPATH."""
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "forked_job.py").write_text(MODULE.format(parent=PARENT_ENV))
    (package / "quiet_preloaded.py").write_text("import os\nPID = os.getpid()\n")
    (package / "noisy_preloaded.py").write_text("print('a library that talks at import')\n")
    (package / "broken_preloaded.py").write_text("raise RuntimeError('broken at import')\n")
    return package


def _env(user_module, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(user_module), **extra}


def test_a_forked_worker_is_what_python_dash_m_would_run(server, user_module, tmp_path):
    log, workdir = tmp_path / "job.log", tmp_path / "workdir"
    workdir.mkdir()
    before = os.getcwd()
    os.chdir(workdir)
    try:
        child = server.start(
            "forked_job", ["exit", "3"], _env(user_module, PRELOAD_TEST_VAR="x"), log
        )
    finally:
        os.chdir(before)
    assert child.wait(60) == 3 and child.poll() == 3
    out = log.read_text()
    assert "argv ['exit', '3']" in out and f"cwd {workdir}" in out
    server_pid = server._connection.process.pid  # the worker's parent, named to it
    assert f"var x parent {server_pid}" in out and f"ppid {server_pid}" in out
    assert "preloaded by None" in out  # this server preloads nothing
    assert out.endswith("to stderr, no newline")  # written through, not lost in a buffer


def test_a_killed_worker_reports_the_signal_and_wait_times_out_before(
    server, user_module, tmp_path
):
    child = server.start("forked_job", ["sleep", "0"], _env(user_module), tmp_path / "a.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    # ps shows the command a fresh interpreter would have run
    shown = " ".join(psutil.Process(child.pid).cmdline()).split()
    assert shown[1:] == ["-m", "forked_job", "sleep", "0"]
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    child.kill()  # a second kill of an ended worker is harmless


def test_workers_die_with_the_server_which_starts_again(server, user_module, tmp_path):
    child = server.start("forked_job", ["sleep", "0"], _env(user_module), tmp_path / "a.log")
    first = server._connection.process
    first.kill()
    assert child.wait(30) == -signal.SIGKILL  # reported when the server's pipe closed
    deadline = time.monotonic() + 10
    while _running(child.pid):
        assert time.monotonic() < deadline, "the worker outlived its fork server"
        time.sleep(0.05)
    again = server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "b.log")
    assert server._connection.process is not first and again.wait(60) == 0


def test_a_server_started_from_a_thread_that_ends_outlives_it(server, user_module, tmp_path):
    """The server dies with the thread that started it (areal.workers.parent): a run's
    first worker is started from the event loop's default executor, whose threads
    `asyncio.run` ends when it returns, and the next run in the same process must find the
    server still there."""
    thread = threading.Thread(
        target=lambda: server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "a")
    )
    thread.start()
    thread.join()
    first = server._connection.process
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(1)
    child = server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "b")
    assert child.wait(60) == 0 and server._connection.process is first


def test_a_request_to_a_server_that_just_died_goes_to_a_new_one(
    server, user_module, tmp_path, monkeypatch
):
    assert (
        server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "a.log").wait(60)
        == 0
    )
    first = server._connection.process
    first.kill()
    first.wait()
    monkeypatch.setattr(first, "poll", lambda: None)  # dead, but not yet seen to be
    child = server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "b.log")
    assert server._connection.process is not first and child.wait(60) == 0


def _assert_a_fork_finds_quiet_preloaded_imported(server, user_module, tmp_path) -> None:
    """A worker forked by `server` finds `quiet_preloaded` imported by the server itself."""
    child = server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "a.log")
    assert child.wait(60) == 0
    server_pid = server._connection.process.pid
    assert f"preloaded by {server_pid}" in (tmp_path / "a.log").read_text()


def test_the_server_preloads_the_modules_it_is_given(tmp_path, user_module, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(user_module))  # the server finds it at its start
    server = ForkServer(modules=["quiet_preloaded"])
    try:
        _assert_a_fork_finds_quiet_preloaded_imported(server, user_module, tmp_path)
    finally:
        server.close()


def test_what_a_preloaded_module_prints_does_not_reach_the_protocol(
    tmp_path, user_module, monkeypatch, capfd
):
    monkeypatch.setenv("PYTHONPATH", str(user_module))
    server = ForkServer(modules=["noisy_preloaded"])
    try:
        child = server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "a.log")
        assert child.wait(60) == 0
    finally:
        server.close()
    assert "a library that talks at import" in capfd.readouterr().err  # on the server's stderr


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize(
    ("worker_start", "devices", "forks"),
    [
        ("auto", [], True),
        ("auto", ["cuda:0"], False),
        ("preload", ["cuda:0"], True),
        ("exec", [], False),
    ],
)
def test_the_pool_forks_unless_a_worker_is_on_a_cuda_device(tmp_path, worker_start, devices, forks):
    overrides = [f"worker_start={worker_start}", f"run_dir={tmp_path}"]
    if devices:
        overrides.append(f"trainer.devices={devices}")
    pool = WorkerPool(load_config(overrides=overrides), tmp_path, "tcp://127.0.0.1:1", "s")
    assert pool.forks_workers is forks


SECRET = ["controller.auth=secret", "controller.secret=s"]
"""What a run with remote workers needs besides (areal.config)."""


@pytest.mark.parametrize(
    ("overrides", "starts"),
    [
        ([], True),
        (["worker_start=exec"], False),
        (["launcher=ray"], False),
        (["controller.remote_kinds=[reward]", *SECRET], True),
        (["controller.remote_kinds=[rollout,reward,trainer]", *SECRET], False),
    ],
)
def test_warm_starts_the_server_only_for_a_run_that_forks_local_workers(
    tmp_path, user_module, monkeypatch, overrides, starts
):
    server = ForkServer(modules=[])
    monkeypatch.setattr(preload, "_server", server)
    cfg = load_config(overrides=[*overrides, f"run_dir={tmp_path}"])
    try:
        preload.warm(cfg)
        assert (server._connection is not None) is starts
        if starts:  # warming a running server changes nothing; its first request is served
            first = server._connection.process
            preload.warm(cfg)
            child = server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "a")
            assert child.wait(60) == 0 and server._connection.process is first
    finally:
        server.close()


def test_warm_for_an_agent_run_preloads_the_agent_runner_too(tmp_path, user_module, monkeypatch):
    """`quiet_preloaded` (which records the pid that imported it) stands in for the agent
    runner, whose imports take seconds."""
    monkeypatch.setenv("PYTHONPATH", str(user_module))  # the server finds it at its start
    monkeypatch.setattr(preload, "AGENT_PRELOAD", ["quiet_preloaded"])
    server = ForkServer(modules=[])
    monkeypatch.setattr(preload, "_server", server)
    try:
        preload.warm(load_config(overrides=["agent.function=agents:solve", f"run_dir={tmp_path}"]))
        _assert_a_fork_finds_quiet_preloaded_imported(server, user_module, tmp_path)
    finally:
        server.close()


def test_warm_makes_a_running_server_import_more_before_its_next_fork(
    tmp_path, user_module, monkeypatch
):
    """An application's agent run after a run without agents: the server that the first
    warmed imports the agent runner (`quiet_preloaded` stands in) before its next fork."""
    monkeypatch.setenv("PYTHONPATH", str(user_module))
    server = ForkServer(modules=[])
    try:
        server.warm()
        first = server._connection.process
        server.warm(["quiet_preloaded"])
        _assert_a_fork_finds_quiet_preloaded_imported(server, user_module, tmp_path)
        assert server._connection.process is first
    finally:
        server.close()


def test_a_server_started_again_imports_what_warm_added(tmp_path, user_module, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(user_module))
    server = ForkServer(modules=[])
    try:
        server.warm(["quiet_preloaded"])
        first = server._connection.process
        first.kill()
        first.wait()
        _assert_a_fork_finds_quiet_preloaded_imported(server, user_module, tmp_path)
        assert server._connection.process is not first
    finally:
        server.close()


def test_a_module_the_server_fails_to_import_is_reported_and_it_serves_on(
    tmp_path, user_module, monkeypatch, capfd
):
    monkeypatch.setenv("PYTHONPATH", str(user_module))
    server = ForkServer(modules=[])
    try:
        server.warm()
        first = server._connection.process
        server.warm(["broken_preloaded", "quiet_preloaded"])
        _assert_a_fork_finds_quiet_preloaded_imported(server, user_module, tmp_path)
        assert server._connection.process is first
    finally:
        server.close()
    assert (
        "broken_preloaded not preloaded (RuntimeError: broken at import)" in capfd.readouterr().err
    )


def test_an_unknown_worker_start_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="worker_start='spawn' is not one of auto"):
        load_config(overrides=["worker_start=spawn"])


def test_a_line_that_is_not_a_reply_is_skipped_and_the_replies_after_it_are_read(caplog):
    # Whatever reaches the server's reply pipe besides replies (a library writing to the
    # duplicated descriptor) must not end the reader: a request would wait forever.
    lines = ["not json", "[1, 2]", '{"pid": "7"}', '{"exit": 5}', '{"pid": 4242}']
    script = "import sys; sys.stdout.write(sys.argv[1])"
    connection = preload._Connection.__new__(preload._Connection)
    connection.process = subprocess.Popen(
        [sys.executable, "-c", script, "\n".join(lines) + "\n"], stdout=subprocess.PIPE, text=True
    )
    connection.children, connection.started = {}, []
    connection.replied = threading.Condition()
    connection._read()  # returns when the pipe closes
    started, ended = connection.started
    assert started.pid == 4242 and started.poll() == -signal.SIGKILL  # ended with the server
    assert ended is None  # a request after the server ended fails instead of waiting
    skipped = [r.getMessage() for r in caplog.records if "not a reply" in r.getMessage()]
    assert len(skipped) == 4 and "not json" in skipped[0]


def test_a_kill_reaches_only_a_child_the_server_has_not_reaped(server, user_module, tmp_path):
    # A worker's pid may be reused once the server has reaped it, before the controller
    # hears of its exit: the kill goes through the server, which signals only its own.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first = server.start("forked_job", ["exit", "0"], _env(user_module), tmp_path / "a.log")
        assert first.wait(60) == 0
        # as if the bystander had taken the ended worker's pid before its notice came
        preload.PreloadedProcess(bystander.pid, server._connection.kill).kill()
        # the server reads its stdin in order: once this one is answered, the kill was read
        after = server.start("forked_job", ["sleep", "0"], _env(user_module), tmp_path / "b.log")
        assert bystander.poll() is None
        after.kill()
        assert after.wait(30) == -signal.SIGKILL
    finally:
        bystander.kill()
        bystander.wait()
