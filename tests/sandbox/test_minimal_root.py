"""What a sandboxed program sees of the file system: the minimal root and nothing else, an
interpreter wherever it lives (a virtualenv in a 0700 folder below /tmp or the home
directory included), and a loud start-up failure where the interpreter cannot run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import areal
from areal.sandbox import PYTHON, PYTHON_EXEC, ExecStatus, Limits, Sandbox, SandboxConfig
from areal.sandbox.client import SandboxStartError

QUICK = Limits(wall_s=10.0, cpu_s=10.0)


def _top_level(visible: tuple[str, ...]) -> set[str]:
    """First path component of every visible entry ('/bin -> usr/bin' -> 'bin')."""
    return {entry.split()[0].split("/")[1] for entry in visible}


@pytest.fixture
def planted(tmp_path):
    """World-readable files where a program must not find them: beside the host's root
    folders, and beside the interpreter's folder (its parent is partly exposed)."""
    paths = [
        Path(f"/opt/areal-planted-{os.getpid()}"),
        Path(f"/var/tmp/areal-planted-{os.getpid()}"),
        Path(sys.prefix).parent / f"areal-planted-{os.getpid()}",
    ]
    for path in paths:
        path.write_text("host secret\n")
        path.chmod(0o644)
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_a_file_planted_outside_the_exposed_set_cannot_be_read_or_listed(sandbox, planted):
    assert sandbox.isolation.minimal_root, sandbox.isolation.describe()
    source = textwrap.dedent(f"""
        import json, os
        seen = {{}}
        for path in {[str(p) for p in planted]!r}:
            try:
                read = open(path).read()
            except OSError as exc:
                read = type(exc).__name__
            try:
                listed = os.path.basename(path) in os.listdir(os.path.dirname(path))
            except OSError as exc:
                listed = type(exc).__name__
            seen[path] = [read, listed]
        print(json.dumps(seen))
        """)
    result = sandbox.run(source, limits=QUICK)
    assert result.status is ExecStatus.OK, result.stderr_text
    seen = json.loads(result.stdout_text)
    assert seen == {
        str(planted[0]): ["FileNotFoundError", "FileNotFoundError"],
        str(planted[1]): ["FileNotFoundError", "FileNotFoundError"],
        str(planted[2]): ["FileNotFoundError", False],
    }  # the folder, not the file


def test_the_root_holds_only_the_minimal_set_the_report_names(sandbox):
    report = sandbox.isolation
    assert report.minimal_root and report.root_switch in ("pivot_root", "chroot")
    assert "/usr" in report.visible and os.path.realpath(sys.base_prefix) in report.visible
    result = sandbox.run(
        "import os\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/etc')))\n"
        "print(sorted(os.listdir('/dev')))",
        limits=QUICK,
    )
    assert result.status is ExecStatus.OK, result.stderr_text
    root, etc, dev = (eval(line) for line in result.stdout_text.splitlines())
    assert set(root) == _top_level(report.visible)
    assert not {"opt", "home", "var", "srv", "mnt", "sys", "boot"} & set(root)
    assert set(etc) <= {"alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"}
    assert "null" in dev and "shm" in dev and not {"vda", "mem", "kmsg", "tty"} & set(dev)


def test_the_root_is_read_only_but_tmp_is_the_runs_own(sandbox):
    source = textwrap.dedent("""
        import os
        for path in ('/usr/areal-w', '/etc/areal-w', '/areal-w', '/dev/areal-w', '/tmp/areal-w'):
            try:
                open(path, 'w').write('x')
                print(path, 'written')
            except OSError as exc:
                print(path, exc.strerror)
        open('/dev/null', 'w').write('fine')
        """)
    result = sandbox.run(source, limits=QUICK)
    assert result.status is ExecStatus.OK, result.stderr_text
    lines = result.stdout_text.splitlines()
    assert lines[-1] == "/tmp/areal-w written"
    assert all(line.endswith("Read-only file system") for line in lines[:-1]), lines


def _venv_in(folder: Path) -> Path:
    """A virtualenv in `folder` that imports this checkout of areal, plus a module installed
    only there (`only_in_this_venv`)."""
    venv = folder / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    (site,) = venv.glob("lib/python3*/site-packages")
    finders = [m for name, m in sys.modules.items() if name.startswith("__editable___areal")]
    if finders:  # an editable install: the same finder, first on the new venv's path
        source_dir = Path(finders[0].__file__).parent
        for path in source_dir.glob("__editable__*areal*"):
            shutil.copy(path, site)
    else:
        (site / "areal_checkout.pth").write_text(str(Path(areal.__file__).parent.parent) + "\n")
    (site / "only_in_this_venv.py").write_text("ANSWER = 42\n")
    return venv / "bin" / "python"


@pytest.fixture(params=["tmp", "home"])
def private_folder(request):
    """A folder only its owner may enter (0700, as `mktemp -d` makes), right below /tmp or
    the home directory: where CI scripts and cluster runtime environments put virtualenvs.
    The run uid (root mode) cannot traverse it; the sandbox must expose the interpreter
    anyway."""
    parent = "/tmp" if request.param == "tmp" else str(Path.home())
    folder = Path(tempfile.mkdtemp(prefix="areal-venv-", dir=parent))
    assert folder.stat().st_mode & 0o777 == 0o700
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("minimal_root", [True, False])
def test_an_interpreter_in_a_private_folder_runs_and_imports_its_packages(
    private_folder, minimal_root
):
    python = _venv_in(private_folder)
    with Sandbox(SandboxConfig(python=str(python), minimal_root=minimal_root)) as sb:
        report = sb.isolation
        assert report.interpreter == str(python) and report.minimal_root is minimal_root
        source = "import sys, only_in_this_venv\nprint(sys.prefix, only_in_this_venv.ANSWER)"
        for language in (PYTHON, PYTHON_EXEC):
            result = sb.run(source, language=language, limits=QUICK)
            assert result.status is ExecStatus.OK, (
                language.name,
                result.detail,
                result.stderr_text,
            )
            assert result.stdout_text == f"{python.parent.parent} 42\n"
        # Exposed read-only: the venv cannot be changed from inside.
        write = sb.run(f"open({str(python.parent / 'x')!r}, 'w')", limits=QUICK)
        assert "Read-only file system" in write.stderr_text


def test_start_fails_loudly_when_the_interpreter_cannot_run_inside():
    # Without the system folders the dynamic linker is missing: python cannot be exec'd.
    sb = Sandbox(SandboxConfig(system_paths=()))
    with pytest.raises(
        SandboxStartError, match=r"the interpreter '.*' does not run inside the sandbox"
    ):
        sb.start()
    sb.close()
