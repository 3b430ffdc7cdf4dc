"""`python bench/plan_check.py`: the planner's ranking of real configurations of the CPU
default job against their measured throughput. The table's arithmetic (ranks, Spearman's
rank correlation, the first choice) on given numbers; and the quick run end to end (a
probe, two short real runs), which checks that every number is there, not how close the
prediction is (that depends on the machine's load)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plan_check(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import plan_check

    return plan_check


def test_the_table_ranks_both_ways_and_correlates_them(plan_check):
    configs = plan_check.CONFIGS[:4]
    predicted = {c.name: p for c, p in zip(configs, [400.0, 300.0, 200.0, 100.0], strict=True)}
    measured_tput = [350.0, 390.0, 150.0, 120.0]  # the first two swapped
    state = {
        "steps": 30,
        "predicted": predicted,
        "search": {
            "first_choice": "async 1 x tp1 + 1 trainers, eta 2, interrupt on",
            "tokens_per_s": 401.0,
            "simulations": 14,
        },
        "measured": {
            f"{c.name} | seed 1": {"seconds": 10.0, "tokens": 10 * t}
            for c, t in zip(configs, measured_tput, strict=True)
        },
    }
    text = plan_check.report(state, configs, [1])
    ranks = re.findall(r"\s(\d)\s+(\d)\s+\(seeds", text)
    assert ranks == [("1", "2"), ("2", "1"), ("3", "3"), ("4", "4")], text
    assert "Spearman's rank correlation, predicted vs measured: 0.80" in text
    assert f"first choice among these, {configs[0].name!r}, measured #2" in text
    assert "costs: sim/costs.yaml;" in text
    assert "costs: fitted.yaml;" in plan_check.report(
        {**state, "costs": "fitted.yaml"}, configs, [1]
    )


def test_the_planner_is_given_the_fitted_costs(plan_check, tmp_path):
    (tmp_path / "config.yaml").write_text("")  # the probe's config: the defaults
    options = plan_check.plan_options(tmp_path, 30, tmp_path / "costs-cpu.yaml")
    assert options[0] == f"costs={tmp_path / 'costs-cpu.yaml'}"
    assert not any(o.startswith("costs=") for o in plan_check.plan_options(tmp_path, 30))


def _plan_check(plan_check, capsys, *args: str) -> tuple[int, str]:
    """`python bench/plan_check.py *args`'s exit code and stderr, for a run that ends in
    its argument checks (in this process: the script's imports alone take seconds)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["plan_check.py", *args])
        with pytest.raises(SystemExit) as ended:
            plan_check.main()
    return ended.value.code, capsys.readouterr().err


def test_a_missing_costs_file_is_refused(plan_check, tmp_path, capsys):
    code, stderr = _plan_check(
        plan_check, capsys, "--out", str(tmp_path), "--costs", str(tmp_path / "nope.yaml")
    )
    assert code == 2
    assert f"--costs={tmp_path / 'nope.yaml'}: no such file" in stderr


def test_predictions_from_other_costs_are_not_mixed_with_these(plan_check, tmp_path, capsys):
    (tmp_path / "fitted.yaml").write_text("accelerators: {}\n")
    (tmp_path / "check.json").write_text(
        json.dumps({"steps": 30, "predicted": {"x": 1.0}, "measured": {}})
    )
    code, stderr = _plan_check(
        plan_check, capsys, "--out", str(tmp_path), "--costs", str(tmp_path / "fitted.yaml")
    )
    assert code == 2
    assert "holds predictions from costs=None" in stderr, stderr


@pytest.mark.slow
def test_quick_check_predicts_and_measures_each_configuration(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "plan_check.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(
        r"^(.+?)\s+(\d+)\s+(\d+)\s+[-+][0-9.]+%\s+(\d)\s+(\d)", done.stdout, re.MULTILINE
    )
    assert len(rows) == 2, done.stdout
    assert all(int(predicted) > 0 and int(measured) > 0 for _, predicted, measured, _, _ in rows)
    assert "the planner's own search over" in done.stdout
    assert (tmp_path / "check.json").is_file() and (tmp_path / "table-quick.txt").is_file()
