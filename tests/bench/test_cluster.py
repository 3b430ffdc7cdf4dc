"""`python bench/cluster.py --quick`: every table a-f printed and saved, from simulations run
in two worker processes; the simulated numbers are those of the same simulations run one
after the other in this process (the virtual clock does not depend on where it runs)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import types
from concurrent.futures import Future
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TITLES = {
    "a": "sync vs async",
    "b": "effective training throughput",
    "c": "maximum generation",
    "d": "interruptible generation",
    "e": "throughput vs eta",
    "f": "controller's own cost",
}


@pytest.fixture
def cluster_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import cluster

    return cluster


@pytest.mark.slow
def test_quick_bench_prints_every_table_and_parallel_runs_match_serial(tmp_path, cluster_bench):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "cluster.py"),
            "--quick",
            "--jobs",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    starts = [out.index(f"{letter}. ") for letter in TITLES]
    assert starts == sorted(starts), out
    for letter, title in TITLES.items():
        assert re.search(rf"^{letter}\. .*{title}", out, re.MULTILINE), (letter, out)
    assert "(2 at once)" in done.stderr
    saved = (tmp_path / "table-quick.txt").read_text()
    assert saved.strip() in out

    # (f): both modes at 16 and 32 accelerators: step s, cpu s, of which gc, share, pack s,
    # intake s, ..., the machine's speed (ref us)
    shares = re.findall(
        r"^\s+(16|32)\s+(sync|async)\s+[0-9.]+\s+([0-9.]+)\s+([0-9.]+)\s+"
        r"([0-9.]+)%\s+[0-9.]+\s+([0-9.]+)\s+\d+\s+[0-9.]+\s+([0-9.]+) ",
        out,
        re.MULTILINE,
    )
    assert len(shares) == 4, out
    assert all(
        float(gc) <= float(cpu) and float(intake) >= 0 and float(ref) > 0
        for _, _, cpu, gc, _, intake, ref in shares
    )

    serial = cluster_bench.Bench(quick=True, seed=1, jobs=1)
    table_b, _ = cluster_bench.table_b(serial)
    assert table_b in out  # every throughput and efficiency the same, digit for digit
    assert serial.simulations == 4


@pytest.mark.slow
def test_table_r_measures_the_controller_in_the_simulation_and_alone(cluster_bench):
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=1)
    text = cluster_bench.table_r(bench)
    # run, rewards, in sim s, gc s, share, alone s, gc s, share, intake s, pack s, w/o s,
    # ratio, alone/in, ref us, ref al, at 14 us
    found = re.findall(
        r"^\s+(\d)\s+(reward|rollout)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)%\s+([0-9.]+)"
        r"\s+([0-9.]+)\s+([0-9.]+)%\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)"
        r"\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)%$",
        text,
        re.MULTILINE,
    )
    # rewards by reward workers, then by the rollout servers (quick: one run of each)
    assert [(row[0], row[1]) for row in found] == [("1", "reward"), ("2", "rollout")], text
    for row in found:  # the threads beside the loop, and the replay without the intake
        intake, pack, without, ratio = (float(value) for value in row[8:12])
        assert intake >= 0 and pack > 0 and without > 0 and ratio > 0, text
    rows = [(row[0], *row[2:8], *row[12:]) for row in found]
    assert all(float(row[3]) > 0 and float(row[6]) > 0 and float(row[8]) > 0 for row in rows), text
    assert all(float(row[2]) <= float(row[1]) and float(row[5]) <= float(row[4]) for row in rows)
    for row in rows:  # the alone share priced at ref us 14 by the yardstick around the replay
        share, ref_alone, slow = float(row[6]), float(row[9]), float(row[10])
        # to the printed digits: the shares to 0.05 points, ref al to 0.05 us
        low = (share - 0.05) * 14 / (ref_alone + 0.05) - 0.05
        high = (share + 0.05) * 14 / (ref_alone - 0.05) + 0.05
        assert ref_alone > 0 and low <= slow <= high, row
    # (f)'s largest quick run: 64 accelerators, the batch scaled with the cluster
    assert "64 accelerators" in text and bench.simulations == 2


@pytest.mark.slow
def test_table_q_measures_the_controller_alone_at_each_queue_length(cluster_bench):
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=1)
    text = cluster_bench.table_q(bench)
    # queued, seed, completions per answer, step s, staleness, max, alone s, share, ref al
    rows = re.findall(
        r"^\s+(\d+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)"
        r"\s+([0-9.]+)%\s+([0-9.]+)$",
        text,
        re.MULTILINE,
    )
    assert [(int(row[0]), int(row[1])) for row in rows] == [(0, 1), (47, 1)], text
    for _, _, answer, step, mean, largest, alone, share, ref in rows:
        assert float(answer) >= 1 and 0 <= float(mean) <= int(largest) and float(ref) > 0, text
        # the share is the CPU over the step, to the printed digits: alone s to 0.005 s
        # (a quick run's is a few hundredths), the share to 0.05 points
        slack = 100 * 0.005 / float(step) + 0.05 + 1e-9
        assert float(share) == pytest.approx(100 * float(alone) / float(step), abs=slack)
    assert "64 accelerators" in text and bench.simulations == 2


@pytest.mark.slow
def test_table_t_prices_a_completion_against_its_length(cluster_bench):
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=1)
    text = cluster_bench.table_t(bench)
    # max tok, tok/traj, step s, alone s, share, us/compl, ref al, at 14 us
    rows = re.findall(
        r"^\s+(\d+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)%\s+([0-9.]+)"
        r"\s+([0-9.]+)\s+([0-9.]+)$",
        text,
        re.MULTILINE,
    )
    assert [int(row[0]) for row in rows] == [1024, 4096], text
    batch = re.search(r"64 accelerators, batch (\d+) x (\d+)", text)  # (f)'s largest quick run
    assert batch, text
    completions = int(batch[1]) * int(batch[2])
    for _, _, _, alone, _, us, ref, slow in rows:
        # the per-completion figures are the step's CPU over the batch, and scale with speed
        assert float(us) == pytest.approx(float(alone) / completions * 1e6, rel=0.05, abs=0.5)
        assert float(slow) == pytest.approx(float(us) * 14 / float(ref), rel=0.05, abs=0.1)
    assert int(rows[1][1]) > int(rows[0][1])  # longer completions carry more tokens
    fit = re.search(r"= (-?[0-9.]+) \+ (-?[0-9.]+) per 1,000 tokens.*leaves ([0-9.]+) us", text)
    assert fit, text
    # a line through two points passes through both
    slope = (float(rows[1][7]) - float(rows[0][7])) / (int(rows[1][1]) - int(rows[0][1]))
    assert float(fit[2]) == pytest.approx(slope * 1000, rel=0.05, abs=0.05)
    assert float(fit[3]) > 0 and bench.simulations == 2


def test_one_job_runs_each_configuration_once(cluster_bench, monkeypatch):
    calls = []
    monkeypatch.setattr(cluster_bench, "simulate", lambda config: calls.append(config) or config)
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=1)
    first = bench.run("async", num_accelerators=16, eta=8)
    # the same resolved configuration: interrupt is on by default
    assert bench.run("async", num_accelerators=16, eta=8, interrupt=True) is first
    bench.run("async", num_accelerators=16, eta=4)
    assert len(calls) == bench.simulations == 2
    assert calls[0].num_prompts == cluster_bench.QUICK_BATCH["num_prompts"]


def test_async_runs_are_measured_after_the_pipeline_fills(cluster_bench):
    """Steps 3-4 of 4 were not an async run's steady state (docs/history.md, "The measured window"):
    the paper's batch is measured over steps 5-7, the quarter batch over 5-12."""
    full, quick = cluster_bench.Bench(quick=False, seed=1), cluster_bench.Bench(quick=True, seed=1)
    assert (full.config("async").steps, full.config("async").measure_from) == (7, 4)
    ablation = full.config("async", ablation=True)
    assert (ablation.steps, ablation.measure_from, ablation.num_prompts) == (12, 4, 128)
    assert (quick.config("async").steps, quick.config("async").measure_from) == (4, 2)
    assert (full.config("sync").steps, full.config("sync").measure_from) == (2, 1)


def test_table_a_shares_its_1_5b_runs_with_table_b(cluster_bench, monkeypatch):
    calls = []

    def fake(config):
        calls.append(config)
        return types.SimpleNamespace(
            step_s=60.0, max_staleness=1, trained_tokens_per_s=float(config.num_accelerators)
        )

    def planned(bench, row, n):  # the planner's own search is tested in tests/sim
        candidate = types.SimpleNamespace(gen_fraction=0.75, rollout_tp=row.rollout_tp)
        return types.SimpleNamespace(candidate=candidate, step_s=50.0)

    monkeypatch.setattr(cluster_bench, "simulate", fake)
    monkeypatch.setattr(cluster_bench, "planned_best", planned)
    bench = cluster_bench.Bench(quick=False, seed=1, jobs=1)
    table = cluster_bench.table_a(bench)
    cluster_bench.table_b(bench)
    # (a): 4 models x 3 runs (sync, sync paying its switches, async); (b): 5 sizes x 2
    # modes, of which 1.5B at 128 GPUs, sync and async, are (a)'s
    assert len(calls) == bench.simulations == 12 + 10 - 2
    shared = [
        c for c in calls if c.model == "1.5b" and c.num_accelerators == 128 and not c.switch_costs
    ]
    assert len(shared) == 2 and all(c.wire for c in shared)
    assert sum(c.switch_costs for c in calls) == 4
    assert "1.20x" in table  # sync / plan: 60 / 50 s


def test_default_jobs_are_bounded_by_cores_and_memory(cluster_bench, monkeypatch):
    class Memory:
        available = 13 * 2**30

    monkeypatch.setattr(cluster_bench.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cluster_bench.psutil, "virtual_memory", lambda: Memory)
    assert cluster_bench.default_jobs() == 13 // cluster_bench.SIM_MEMORY_GB
    Memory.available = 2**30
    assert cluster_bench.default_jobs() == 1
    Memory.available = 2**40
    assert cluster_bench.default_jobs() == 8


@pytest.mark.slow
@pytest.mark.parametrize("wire, most_at_once", [(True, 1), (False, 2)])
def test_measured_simulations_run_one_at_a_time(cluster_bench, monkeypatch, wire, most_at_once):
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=2)
    running, most = [], []
    lock, both = threading.Lock(), threading.Event()

    def start(config):
        done = Future()

        def work():
            with lock:
                running.append(config)
                most.append(len(running))
                if len(running) == 2:
                    both.set()
            both.wait(timeout=0.5)  # the other table's run overlaps this one, if it may
            with lock:
                running.remove(config)
            done.set_result(config)

        threading.Thread(target=work).start()
        return done

    monkeypatch.setattr(bench, "_start", start)
    tables = [
        lambda b, mode=mode: [b.run(mode, wire=wire, num_accelerators=n) for n in (16, 32)]
        for mode in ("sync", "async")
    ]
    made = bench.tables(tables)
    assert [len(table.result(timeout=30)) for table in made] == [2, 2]
    bench.close()
    assert bench.simulations == 0 and max(most) == most_at_once


def test_the_longest_queued_simulation_starts_first_and_measured_ones_last(
    cluster_bench, monkeypatch
):
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=2)
    started, pending = [], []

    def start(config):
        started.append((config.wire, config.max_new_tokens))
        pending.append(done := Future())
        return done

    monkeypatch.setattr(bench, "_start", start)
    runs = [
        bench.start("async", wire=wire, num_accelerators=16, max_new_tokens=length)
        for wire, length in [
            (False, 100),
            (False, 200),
            (True, 9000),
            (False, 300),
            (False, 400),
            (True, 8000),
        ]
    ]
    assert started == [(False, 100), (False, 200)]  # both processes taken at once
    while pending:  # each finished simulation frees its process for the next queued one
        pending.pop(0).set_result(None)
    assert started == [
        (False, 100),
        (False, 200),
        (False, 400),
        (False, 300),
        (True, 9000),
        (True, 8000),
    ]
    assert all(run.done() for run in runs)
    bench.close()


@pytest.mark.parametrize("jobs", [1, 2])
def test_no_tables_is_no_work(cluster_bench, jobs):
    """`--only f` asks for no table of unmeasured simulations: nothing to make, no error."""
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=jobs)
    assert bench.tables([]) == []
    bench.close()


@pytest.mark.slow
def test_strict_table_compares_the_same_runs_with_and_without_strict(cluster_bench, monkeypatch):
    calls = []
    real = cluster_bench.simulate
    monkeypatch.setattr(
        cluster_bench, "simulate", lambda config: calls.append(config) or real(config)
    )
    bench = cluster_bench.Bench(quick=True, seed=1, jobs=1)
    table = cluster_bench.table_s(bench)
    rows = [line.split() for line in table.splitlines()[2:4]]
    assert [row[0] for row in rows] == ["1", "2"]
    for row in rows:  # the ratio is of the two throughputs printed beside it
        assert float(row[3].rstrip("x")) == pytest.approx(float(row[2]) / float(row[1]), abs=0.006)
    assert [(c.eta, c.strict) for c in calls] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(c.mode == "async" for c in calls)
