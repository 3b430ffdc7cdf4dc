"""bench/results_page.py: a bench's table becomes a JSON file and a markdown page that name
the command, the date, the commit and the machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from results_page import publish, write_results


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
