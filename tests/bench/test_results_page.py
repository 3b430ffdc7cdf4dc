"""bench/results_page.py: a bench's table becomes a JSON file and a markdown page that name
the command, the date, the commit and the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import results_page
from results_page import code_version, publish, write_results


def test_the_page_and_its_json_carry_the_table_and_where_it_was_measured(tmp_path):
    table = "mode  tok/s\n----------\nsync    100\nasync   250"
    page = write_results(
        "demo",
        title="Demo bench",
        command="python bench/demo.py",
        table=table,
        data={"rows": [["sync", 100], ["async", 250]]},
        notes="async is 2.5x.",
        results_dir=tmp_path,
    )
    text = page.read_text()
    assert text.startswith("# Demo bench\n")
    assert "`python bench/demo.py`" in text and table in text and "async is 2.5x." in text
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["data"] == {"rows": [["sync", 100], ["async", 250]]}
    assert saved["command"] == "python bench/demo.py" and saved["machine"]["cores"] >= 1
    assert saved["date"].endswith("UTC") and "cpu" in saved["machine"]


def test_only_full_runs_into_the_default_place_publish(tmp_path):
    assert publish(quick=False)
    assert not publish(quick=True)
    assert not publish(quick=False, out=tmp_path)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_the_page_names_the_commit_and_the_changes_it_was_measured_with(tmp_path):
    """Uncommitted changes to tracked files are named (the numbers came from that code);
    results pages and untracked files are not."""
    repo = tmp_path / "repo"
    (repo / "docs" / "results").mkdir(parents=True)
    (repo / "bench.py").write_text("a\n")
    (repo / "docs" / "results" / "old.md").write_text("page\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    commit, changed = code_version(repo)
    assert commit and changed == []
    (repo / "docs" / "results" / "old.md").write_text("a page the bench wrote\n")
    (repo / "new.py").write_text("untracked\n")
    assert code_version(repo) == (commit, [])
    (repo / "bench.py").write_text("b\n")
    assert code_version(repo) == (commit, ["bench.py"])
    assert code_version(tmp_path / "elsewhere") == (None, [])


def test_a_page_measured_with_changes_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(results_page, "code_version", lambda: ("abc1234", ["sim/run.py"]))
    page = write_results(
        "demo", title="Demo", command="c", table="t", data={}, results_dir=tmp_path
    )
    assert ", commit abc1234 with uncommitted changes to sim/run.py" in page.read_text()
    assert json.loads((tmp_path / "demo.json").read_text())["uncommitted"] == ["sim/run.py"]
