"""Sandbox throughput vs a bare subprocess, same programs, one run; launcher start-up with
the minimal root vs the host's read-only tree.

    python bench/sandbox.py [--runs 30] [--concurrency 2] [--startups 5]

Start-up: `Sandbox(config).start()` (launcher process, namespaces, root, probes), then the
first run, for `minimal_root=True` (the default: the launcher pivots into a minimal root)
and `minimal_root=False` (programs see the host's tree, read-only), alternating.

For each program, five runners execute it with the same stdin:
- bare:    `subprocess.run([python, "main.py"])` in a temp folder: no isolation at all;
- sandbox: the warm launcher, in-process Python (fork per run, full isolation, minimal root);
- sandbox-hostroot: the same with `minimal_root=False`;
- sandbox-exec: the launcher exec'ing a fresh `python main.py` (isolation + interpreter start);
- sandbox-exec-hostroot: the same with `minimal_root=False`.
Each runner executes in blocks of consecutive runs, the blocks of all runners alternating
over `--rounds`, so load drift on a shared machine hits all runners alike while each keeps
the cache locality it would have in a reward worker (one run after another).
Reported: mean and median milliseconds per execution (sequential), executions per second
sequential and with `--concurrency` callers, and each runner's time relative to bare.
No thresholds: this prints numbers, it does not judge them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areal.sandbox import PYTHON, PYTHON_EXEC, ExecStatus, Limits, Sandbox, SandboxConfig

sys.path.insert(0, str(Path(__file__).parent))
from results_page import write_results

PROGRAMS = {
    "hello": ("print('hello')", b""),
    "sum_stdin": (
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
        " ".join(str(i) for i in range(20000)).encode(),
    ),
    "compute_50ms": ("s = 0\nfor i in range(400000):\n    s += i * i % 7\nprint(s)", b""),
    "typical_imports": (
        "import collections, heapq, itertools, functools, bisect, math, re\n"
        "print(len(collections.Counter('abracadabra')))",
        b"",
    ),
}
LIMITS = Limits(wall_s=30.0, cpu_s=30.0)


def bare_runner(folder: str) -> Callable[[str, bytes], bytes]:
    def run(source: str, stdin: bytes) -> bytes:
        path = os.path.join(folder, "main.py")
        with open(path, "w") as f:
            f.write(source)
        done = subprocess.run(
            [sys.executable, "main.py"], input=stdin, cwd=folder, capture_output=True, check=True
        )
        return done.stdout

    return run


def sandbox_runner(sb: Sandbox, language) -> Callable[[str, bytes], bytes]:
    def run(source: str, stdin: bytes) -> bytes:
        result = sb.run(source, stdin=stdin, language=language, limits=LIMITS)
        if result.status is not ExecStatus.OK:
            raise RuntimeError(
                f"sandbox run failed: {result.status} {result.detail} {result.stderr_text[-300:]}"
            )
        return result.stdout

    return run


def measure(
    runners: dict[str, Callable],
    source: str,
    stdin: bytes,
    runs: int,
    rounds: int,
    concurrency: int,
) -> dict[str, dict[str, float]]:
    expected = runners["bare"](source, stdin)
    for run in runners.values():  # warm-up, and every runner must agree on the output
        assert run(source, stdin) == expected
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(rounds):
        order = list(runners.items())[:: 1 if round_index % 2 == 0 else -1]
        for name, run in order:
            for _ in range(max(1, runs // rounds)):
                start = time.perf_counter()
                run(source, stdin)
                samples[name].append(time.perf_counter() - start)
    stats = {}
    for name, run in runners.items():
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda _: run(source, stdin), range(runs * concurrency)))  # noqa: B023
        parallel = runs * concurrency / (time.perf_counter() - start)
        mean = statistics.fmean(samples[name])
        stats[name] = {
            "mean_ms": 1000 * mean,
            "median_ms": 1000 * statistics.median(samples[name]),
            "per_s": 1 / mean,
            "parallel_per_s": parallel,
        }
    return stats


def measure_startup(repeats: int) -> dict[str, dict[str, float]]:
    """Seconds to a started launcher and to its first answer, per root mode (alternating)."""
    samples: dict[str, dict[str, list[float]]] = {
        name: {"start": [], "first_run": []} for name in ("hostroot", "minimal")
    }
    for index in range(2 * repeats):
        name = ("hostroot", "minimal")[index % 2]
        start = time.perf_counter()
        sb = Sandbox(SandboxConfig(minimal_root=name == "minimal"))
        sb.start()
        started = time.perf_counter()
        if sb.run("print(1)").stdout != b"1\n":
            raise RuntimeError("first run failed")
        samples[name]["start"].append(started - start)
        samples[name]["first_run"].append(time.perf_counter() - started)
        sb.close()
    return {
        name: {key: 1000 * statistics.median(values) for key, values in by_key.items()}
        for name, by_key in samples.items()
    }


def print_startup(repeats: int) -> dict:
    stats = measure_startup(repeats)
    header = f"{'root':10s} {'start ms (median)':>18s} {'first run ms':>13s}"
    print(
        f"launcher start-up, median of {repeats} each, alternating\n{header}\n{'-' * len(header)}"
    )
    for name, s in stats.items():
        print(f"{name:10s} {s['start']:18.1f} {s['first_run']:13.1f}")
    ratio = stats["minimal"]["start"] / stats["hostroot"]["start"]
    print(f"minimal / hostroot start-up: {ratio:.2f}x\n")
    return stats


class _Tee(io.StringIO):
    """Console output kept as well: the table the results page shows is the one printed."""

    def write(self, text: str) -> int:
        sys.__stdout__.write(text)
        return super().write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", type=int, default=30, help="sequential executions per runner and program"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating blocks the runs are split into"
    )
    parser.add_argument(
        "--concurrency", type=int, default=2, help="callers in the parallel measurement"
    )
    parser.add_argument("--startups", type=int, default=5, help="launcher starts per root mode")
    parser.add_argument(
        "--no-page",
        action="store_true",
        help="do not write the docs' results page (docs/results/sandbox.md)",
    )
    args = parser.parse_args()
    printed, data = _Tee(), {"args": vars(args), "programs": {}}
    with (
        contextlib.redirect_stdout(printed),
        Sandbox() as sb,
        Sandbox(SandboxConfig(minimal_root=False)) as host,
        tempfile.TemporaryDirectory() as folder,
    ):
        print(sb.isolation.describe())
        print(
            f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, "
            f"runs={args.runs} in {args.rounds} rounds, concurrency={args.concurrency}\n"
        )
        data["startup"] = print_startup(args.startups)
        runners = {
            "bare": bare_runner(folder),
            "sandbox": sandbox_runner(sb, PYTHON),
            "sandbox-hostroot": sandbox_runner(host, PYTHON),
            "sandbox-exec": sandbox_runner(sb, PYTHON_EXEC),
            "sandbox-exec-hostroot": sandbox_runner(host, PYTHON_EXEC),
        }
        header = (
            f"{'program':16s} {'runner':21s} {'mean ms':>8s} {'median ms':>9s} {'exec/s':>7s} "
            f"{'exec/s x' + str(args.concurrency):>10s} {'time vs bare':>12s} {'overhead ms':>11s}"
        )
        print(header)
        print("-" * len(header))
        for program, (source, stdin) in PROGRAMS.items():
            stats = measure(runners, source, stdin, args.runs, args.rounds, args.concurrency)
            data["programs"][program] = stats
            bare = stats["bare"]
            for name, s in stats.items():
                print(
                    f"{program:16s} {name:21s} {s['mean_ms']:8.1f} {s['median_ms']:9.1f} {s['per_s']:7.1f} "
                    f"{s['parallel_per_s']:10.1f} {s['mean_ms'] / bare['mean_ms']:11.2f}x "
                    f"{s['mean_ms'] - bare['mean_ms']:+11.1f}"
                )
        print(
            "\noverhead ms = mean ms minus bare mean ms (negative: faster than a bare subprocess)"
        )
    if not args.no_page:
        print(
            "results page: "
            + str(
                write_results(
                    "sandbox",
                    title="Sandbox against a bare subprocess (bench/sandbox.py)",
                    command=" ".join(["python", *sys.argv]),
                    table=printed.getvalue(),
                    data=data,
                    notes="Each program runs alternately under every runner; `bare` is a plain "
                    "subprocess without isolation, the baseline of the ratios.",
                )
            )
        )


if __name__ == "__main__":
    main()
