"""Memory and file descriptors of every process of a long training run: does anything grow?

    python bench/soak.py --minutes 60 [--interval 10] [--out bench/results/soak] [key=value ...]

Starts `python -m areal.controller` (the default job unless overrides say otherwise, with
steps enough never to finish on its own), samples the resident memory (RSS) and the open file
descriptors of the controller, of the fork server that starts its local workers and of every
worker (its descendants named by `--worker-id`; any other process, such as a worker's sandbox
or verifier, is summed into the nearest of them above it) every `--interval`
seconds with psutil, and after `--minutes` stops the run with SIGTERM (the current step
finishes, the summary is written). Per process it prints start / end / max and the slope of
a least-squares line through the second half of the samples (what is left once caches and
allocators have warmed up), in MB and descriptors per hour, and that slope relative to the
process's mean in the same half (%/h: the baseline each process is judged against). Saves
the samples (`samples.json`) and a plot of both over time (`soak.png`) under --out.

"start" is the first sample after every worker is ready (the first step record). A process
that restarted mid-run is shown under its worker id, its samples joined. A worker forked
by the fork server counts the pages it still shares with the server in its RSS (copy on
write), so the rows' sum overstates the run's memory; each row's slope is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from results_page import publish, write_results

MB = 1 << 20


@dataclass
class Series:
    """One process's samples: minutes since the first step, RSS in MB, open descriptors."""

    minutes: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[float] = field(default_factory=list)


FORK_SERVER = "fork server"


def label_of(proc: psutil.Process) -> str | None:
    """The worker id a process's command line names, or FORK_SERVER; None for anything else.
    A worker forked by the fork server has its command line as one string (its title,
    controller/fork_server.py), so the words are split again."""
    try:
        words = " ".join(proc.cmdline()).split()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "--worker-id" in words[:-1]:
        return words[words.index("--worker-id") + 1]
    if "areal.controller.fork_server" in words:
        return FORK_SERVER
    return None


def sample(controller: psutil.Process) -> dict[str, tuple[float, int]]:
    """(RSS in MB, open descriptors) of the controller, the fork server and each worker,
    found among all the controller's descendants (local workers are the fork server's
    children); every other process counts with the nearest of them above it."""
    out: dict[str, tuple[float, int]] = {}

    def visit(proc: psutil.Process, owner: str) -> None:
        try:
            rss, fds = proc.memory_info().rss / MB, proc.num_fds()
            children = proc.children()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return
        owner = label_of(proc) or owner
        total_rss, total_fds = out.get(owner, (0.0, 0))
        out[owner] = (total_rss + rss, total_fds + fds)
        for child in children:
            visit(child, owner)

    visit(controller, "controller")
    return out


def slope_per_hour(minutes: list[float], values: list[float]) -> float:
    """Least-squares slope through the second half of the samples, per hour."""
    half = len(minutes) // 2
    x, y = np.asarray(minutes[half:]), np.asarray(values[half:])
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0
    return float(np.polyfit(x, y, 1)[0] * 60)


def summarize(series: dict[str, Series]) -> list[dict[str, float | str]]:
    """One row per process: start / end / max / second-half slope of RSS and descriptors."""
    rows = []
    for name, s in sorted(series.items(), key=lambda kv: (kv[0] != "controller", kv[0])):
        half = len(s.minutes) // 2
        row: dict[str, float | str] = {"process": name, "samples": len(s.minutes)}
        for key, values in (("rss_mb", s.rss_mb), ("fds", s.fds)):
            slope = slope_per_hour(s.minutes, values)
            mean = float(np.mean(values[half:])) if values else 0.0
            row.update(
                {
                    f"{key}_start": values[0],
                    f"{key}_end": values[-1],
                    f"{key}_max": max(values),
                    f"{key}_slope_h": slope,
                    f"{key}_slope_pct_h": 100 * slope / mean if mean else 0.0,
                }
            )
        rows.append(row)
    return rows


def table(rows: list[dict[str, float | str]], minutes: float) -> str:
    head = (
        f"{'process':<12} {'RSS MB start':>12} {'end':>7} {'max':>7} {'MB/h 2nd half':>14} "
        f"{'%/h':>6} {'fds start':>9} {'end':>5} {'max':>5} {'fds/h':>7}"
    )
    lines = [f"soak: {minutes:.1f} minutes sampled", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['process']:<12} {r['rss_mb_start']:>12.0f} {r['rss_mb_end']:>7.0f} "
            f"{r['rss_mb_max']:>7.0f} {r['rss_mb_slope_h']:>+14.1f} {r['rss_mb_slope_pct_h']:>+6.1f} "
            f"{r['fds_start']:>9.0f} {r['fds_end']:>5.0f} {r['fds_max']:>5.0f} "
            f"{r['fds_slope_h']:>+7.1f}"
        )
    return "\n".join(lines)


def plot(series: dict[str, Series], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, s in sorted(series.items()):
        top.plot(s.minutes, s.rss_mb, label=name)
        bottom.plot(s.minutes, s.fds, label=name)
    top.set_ylabel("resident memory (MB)")
    bottom.set_ylabel("open file descriptors")
    bottom.set_xlabel("minutes since the first training step")
    top.legend(loc="upper left", fontsize=8)
    top.set_title("soak: every process of one training run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _first_step_seen(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and '"kind": "step"' in path.read_text()


def soak(args: argparse.Namespace, run_dir: Path) -> tuple[dict[str, Series], int, float]:
    """Run, sample, stop; returns the series, the controller's exit code, minutes sampled."""
    command = [
        sys.executable,
        "-m",
        "areal.controller",
        f"run_dir={run_dir}",
        "trainer.total_steps=1000000",
        "logging.progress=false",
        *args.overrides,
    ]
    log = open(run_dir.parent / "controller.log", "w")  # noqa: SIM115 (the child's, for its life)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    controller = psutil.Process(proc.pid)
    series: dict[str, Series] = {}
    started = None
    try:
        while proc.poll() is None:
            if started is None and _first_step_seen(run_dir):
                started = time.monotonic()
            if started is not None:
                now = (time.monotonic() - started) / 60
                if now >= args.minutes:
                    break
                for name, (rss, fds) in sample(controller).items():
                    s = series.setdefault(name, Series())
                    s.minutes.append(now)
                    s.rss_mb.append(rss)
                    s.fds.append(fds)
            time.sleep(args.interval if started is not None else 1.0)
        if proc.poll() is not None:
            raise SystemExit(
                f"the controller exited early ({proc.returncode}); see "
                f"{run_dir.parent / 'controller.log'}"
            )
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return series, code, (time.monotonic() - started) / 60 if started else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--quick", action="store_true", help="2 minutes, a sample every 5 s")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default bench/results/soak; only a full run "
        "there writes the docs' results page, docs/results/soak.md)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    page = publish(args.quick, args.out) and not args.overrides
    args.out = args.out or Path("bench/results/soak")
    if args.quick:
        args.minutes, args.interval = 2.0, 5.0
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        series, code, minutes = soak(args, Path(tmp) / "run")
        summary = Path(tmp) / "run" / "summary.json"
        steps = json.loads(summary.read_text())["steps"] if summary.is_file() else None
    rows = summarize(series)
    text = table(rows, minutes)
    ending = f"controller stopped by SIGTERM: exit code {code}, summary.json " + (
        f"written after {steps} training steps" if steps is not None else "MISSING"
    )
    print(text)
    print(ending)
    (args.out / "samples.json").write_text(
        json.dumps(
            {
                "minutes": minutes,
                "steps": steps,
                "overrides": args.overrides,
                "rows": rows,
                "series": {k: vars(v) for k, v in series.items()},
            },
            indent=1,
        )
    )
    plot(series, args.out / "soak.png")
    print(f"saved {args.out / 'samples.json'} and {args.out / 'soak.png'}")
    if page:
        print(
            "results page: "
            + str(
                write_results(
                    "soak",
                    title="Memory and open files over a long run (bench/soak.py)",
                    command=" ".join(["python", *sys.argv]),
                    table=text + "\n" + ending,
                    data={"minutes": minutes, "steps": steps, "rows": rows},
                    notes="Resident memory and open descriptors of every process of the default job, "
                    "sampled through the run; the slopes are fitted over its second half, after "
                    "start-up, the first steps and the first checkpoint.",
                )
            )
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
