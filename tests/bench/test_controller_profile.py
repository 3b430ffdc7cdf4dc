"""`python bench/controller_profile.py --timed`: the replayed controller's handlers timed
with their thread's CPU clock, a table per measured step."""

from __future__ import annotations

import dataclasses

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from cluster import Bench, table_r_config  # noqa: E402
from controller_profile import HANDLERS, Timers, simulation  # noqa: E402


def test_timers_count_only_while_enabled_and_reach_a_function_imported_by_name(monkeypatch):
    source = types.ModuleType("timed_source")
    source.work = lambda n: sum(range(n))  # type: ignore[attr-defined]
    user = types.ModuleType("timed_user")
    user.work = source.work  # type: ignore[attr-defined]  # `from timed_source import work`
    monkeypatch.setitem(sys.modules, "timed_source", source)
    monkeypatch.setitem(sys.modules, "timed_user", user)
    import transformers  # noqa: F401  # a lazy module, whose attributes import on access

    timers = Timers(["timed_source:work"])
    assert source.work(10) == 45 and timers.calls["timed_source:work"] == 0
    timers.enable()
    assert source.work(100_000) == user.work(100_000) == sum(range(100_000))
    timers.disable()
    user.work(10)
    assert timers.calls["timed_source:work"] == 2 and timers.cpu_s["timed_source:work"] > 0
    assert re.search(r"^work\s+1\s+[0-9.]+\s+[0-9.]+$", timers.table(steps=2), re.M)


@pytest.mark.slow
def test_a_small_replay_times_every_handler_and_nests_them():
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "controller_profile.py"),
            "--accelerators=64",
            "--prompts=64",
            "--steps=4",
            "--timed",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = {
        name: (float(calls), float(ms))
        for name, calls, ms, _ in re.findall(
            r"^(\S+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$", done.stdout, re.M
        )
    }
    assert set(rows) == {name.rpartition(":")[2] for name in HANDLERS}
    assert rows["Core._on_completions"][0] > 0 and rows["Core.on_message"][0] > 0
    # inclusive times: a handler holds what it calls
    assert rows["Core.on_message"][1] >= rows["Core._on_completions"][1]
    assert rows["Core._on_completions"][1] >= rows["Ledger.finish_completions"][1]


def test_table_r_profiles_the_run_table_r_measures_with_the_options_given_changed():
    args = types.SimpleNamespace(table_r=True, overrides=[])
    # table (r)'s run, its one replay profiled (not the second, without the intake)
    table_r = table_r_config(Bench(quick=False, seed=1))
    assert table_r.alone_without_intake
    assert simulation(args) == dataclasses.replace(table_r, alone_without_intake=False)
    assert simulation(args).num_accelerators == 2048
    changed = simulation(types.SimpleNamespace(table_r=True, overrides=["rollout_rewards=true"]))
    assert changed == dataclasses.replace(simulation(args), rollout_rewards=True)
