"""The CPU tool-use demonstration, per engine and seed: does RL teach the calculator?

    python bench/tool_arithmetic.py [--engines torch vllm] [--seeds 1 2] [--out DIR]
                                    [--quick] [key=value ...]

Each run is `python -m areal.controller --config examples/tool_arithmetic.yaml` with
`rollout.engine=E seed=S` (a new seed warm-starts a new model, cached afterwards), in its own
process. Prints, per run, held-out greedy pass@1 and the share of held-out episodes that
call the calculator before and after training, with Wilson 95 % intervals over the 256
held-out problems, the gain, and the run's wall time (warm-start build included when it
happened in that run, shown apart); then the mean gain per engine over its seeds, with the
range. Saves `results.json` and `pass_at_1.png` (held-out pass@1 against training step,
every run) under `--out` (default bench/results/tool_arithmetic). `--quick` is a smoke test
(torch, one seed, 4 steps, a 1-step warm start, 16 held-out problems): it checks the
pipeline, not learning.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from areal.intervals import proportion_interval

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tool_arithmetic.yaml"
QUICK = [
    "trainer.total_steps=4",
    "model.warmstart.steps=1",
    "task.params.num_eval=16",
    "eval.every_steps=0",
    "trainer.batch_size=16",
]


def run_one(engine: str, seed: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{engine}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous bench's run: never mixed with this
    command = [
        sys.executable,
        "-m",
        "areal.controller",
        "--config",
        str(CONFIG),
        f"rollout.engine={engine}",
        f"seed={seed}",
        f"run_dir={run_dir}",
        "logging.progress=false",
        *extra,
    ]
    print("$", " ".join(command[1:]), flush=True)
    start = time.monotonic()
    with open(out / f"{engine}-seed{seed}.log", "w") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(
            f"run {engine} seed {seed} failed (exit {done.returncode}); see "
            f"{out / f'{engine}-seed{seed}.log'}"
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "engine": engine,
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_s": time.monotonic() - start,
        "summary": summary,
        "evals": [
            {
                k: r.get(k)
                for k in ("version", "eval/pass@1", "eval/num_problems", "eval/tool_use_fraction")
            }
            for r in evals
        ],
        "warmstart_s": warm_start_seconds(out / f"{engine}-seed{seed}.log"),
    }


def warm_start_seconds(log: Path) -> float | None:
    """Seconds the warm start took if this run built it (its log says so), else None."""
    for line in log.read_text().splitlines():
        if "areal.models.warmstart: warm start" in line and "SFT steps" in line:
            return float(line.rsplit(",", 1)[1].strip().removesuffix(" s"))
    return None


def table(results: list[dict]) -> str:
    head = (
        f"{'engine':>6} {'seed':>4}  {'pass@1 before [95% CI]':>24}  "
        f"{'pass@1 after [95% CI]':>23}  {'gain':>6}  {'tool use':>11}  {'run s':>6}  "
        f"{'of it warm start s':>18}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        first, last = r["evals"][0], r["evals"][-1]
        n = int(first["eval/num_problems"])
        cells = []
        for e in (first, last):
            p = e["eval/pass@1"]
            lo, hi = proportion_interval(p * n, n)
            cells.append(f"{p:.3f} [{lo:.3f},{hi:.3f}]")
        use = "->".join(f"{e.get('eval/tool_use_fraction') or 0:.2f}" for e in (first, last))
        gain = 100 * (last["eval/pass@1"] - first["eval/pass@1"])
        rows.append(
            f"{r['engine']:>6} {r['seed']:>4}  {cells[0]:>24}  {cells[1]:>23}  "
            f"{gain:+6.1f}  {use:>11}  {r['wall_s']:6.0f}  "
            f"{'cached' if r['warmstart_s'] is None else round(r['warmstart_s']):>18}"
        )
    for engine in sorted({r["engine"] for r in results}):
        gains = [
            100 * (r["evals"][-1]["eval/pass@1"] - r["evals"][0]["eval/pass@1"])
            for r in results
            if r["engine"] == engine
        ]
        rows.append(
            f"{engine}: mean gain {sum(gains) / len(gains):+.1f} points over "
            f"{len(gains)} seed(s), range [{min(gains):+.1f}, {max(gains):+.1f}]"
        )
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        xs = [e["version"] for e in r["evals"]]
        ax.plot(
            xs,
            [e["eval/pass@1"] for e in r["evals"]],
            marker="o",
            label=f"{r['engine']} seed {r['seed']}",
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out pass@1 (greedy)")
    ax.set_title("tool_arithmetic: RL learns to use the calculator")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/tool_arithmetic")
    parser.add_argument("--quick", action="store_true", help="smoke test: torch, seed 1, 4 steps")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    engines, seeds, extra = args.engines, args.seeds, list(args.overrides)
    if args.quick:
        engines, seeds, extra = (
            ["torch"],
            [1],
            [*QUICK, "cache_dir=" + str(args.out / "cache"), *extra],
        )
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_one(e, s, args.out, extra) for e in engines for s in seeds]
    text = table(results)
    print(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.txt").write_text(text + "\n")
    plot(results, args.out / "pass_at_1.png")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
