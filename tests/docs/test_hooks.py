"""The site's hooks: the API source tree over the package-dir layout, and the results table
that links the bench pages that exist and names the command of those that do not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # lays out build/api-src/areal as a side effect
    return module


def test_the_api_source_tree_is_the_installed_package_layout(hooks):
    tree = hooks.API_SOURCE
    assert (tree / "config.py").resolve() == ROOT / "areal" / "config.py"
    for name in ("controller", "workers", "sandbox", "sim"):
        assert (tree / name / "__init__.py").resolve() == ROOT / name / "__init__.py"
    assert not (tree / "__pycache__").exists()


def test_results_table_links_existing_pages_and_names_the_command_of_missing_ones(
    hooks, tmp_path, monkeypatch
):
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    (tmp_path / "chaos.md").write_text("# chaos\n")
    table = hooks.results_table("../")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert len(rows) == len(hooks.PAGES)
    assert "[chaos](../results/chaos.md)" in rows["Faults injected into one run"]
    assert (
        "not run yet: `python bench/speedup.py --seeds 3`"
        in rows["Synchronous vs asynchronous training"]
    )


def test_every_bench_that_publishes_is_listed(hooks):
    """Each bench that calls write_results names a page the table knows."""
    listed = {name for name, _, _ in hooks.PAGES}
    for bench in ("speedup", "ablation", "chaos", "soak", "sandbox"):
        source = (ROOT / "bench" / f"{bench}.py").read_text()
        assert f'"{bench}"' in source and "write_results(" in source, bench
        assert bench in listed
    assert {"engines", "engines-gpu"} <= listed
    assert {f"cluster-{t}" for t in "abcdefgrs"} <= listed
