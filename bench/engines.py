"""Rollout engines side by side: vLLM vs the built-in torch engine vs plain `generate`.

    python bench/engines.py [--device cpu|cuda] [--engines vllm,torch,hf] [--out DIR]

One run, one workload for all: `--requests` random prompts of 8-40 tokens over the
embedded tiny model's vocabulary (a Qwen2 built locally; `--hidden-size`/`--layers` make
it larger), `--new-tokens` sampled tokens each at temperature 1, no stop token, every
request submitted at once (max concurrent sequences = requests).

- generation: tokens/s from the first submission to the last result; request latency
  (submission -> result) mean and p90. Plain `transformers` `generate` runs the same
  prompts as one left-padded batch, without log-probs (a ceiling, not an engine).
- interruption: with every request in flight (budget `--long-tokens`), the wall time of
  pause -> update_weights(disk) -> resume, and of the same with the weights as tensors
  (stream mode); then `overhead`: the wall time of the workload run through
  `InterruptibleGenerator` with one update in its middle, minus the same run without it
  (the cost of the aborted work, the prefix recomputation and the load, end to end).

Prints a table with ratios to the torch engine; writes engines.json (and engines.png) into
--out. Engines that cannot run here (vLLM not installed, or CUDA-only) are skipped with the
reason. Start-up time is reported but not part of any rate. Other processes skew numbers:
the load average is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from areal.config import TinyModelConfig
from areal.models.hf import load_model
from areal.models.tiny import save_tiny_model
from areal.models.weights import load_tensors
from areal.workers.rollout.engine import DiskWeights, Engine, SamplingParams, TensorWeights
from areal.workers.rollout.interruptible import InterruptibleGenerator

sys.path.insert(0, str(Path(__file__).parent))
from results_page import publish, write_results


def make_prompts(num: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 90, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 41, (num,), generator=g)
    ]


async def generation(
    engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str
) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    latencies: list[float] = []

    async def one(i: int, prompt: list[int]) -> int:
        start = time.perf_counter()
        out = await engine.generate(f"{tag}{i}", prompt, params)
        latencies.append(time.perf_counter() - start)
        return len(out.token_ids)

    start = time.perf_counter()
    num_tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    wall = time.perf_counter() - start
    latencies.sort()
    return {
        "tokens_per_s": num_tokens / wall,
        "wall_s": wall,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
    }


async def interruption(
    engine: Engine, prompts: list[list[int]], weights: list[Path], long_tokens: int, new_tokens: int
) -> dict[str, float]:
    """Phases of one pause -> load -> resume with everything in flight, per weight source."""
    result: dict[str, float] = {}
    sources = {"disk": DiskWeights(weights[1]), "tensors": TensorWeights(load_tensors(weights[0]))}
    params = SamplingParams(max_new_tokens=long_tokens, temperature=1.0)
    for mode, source in sources.items():
        tasks = [
            asyncio.create_task(engine.generate(f"{mode}{i}", p, params))
            for i, p in enumerate(prompts)
        ]
        await engine.generate(f"{mode}-probe", prompts[0], SamplingParams(max_new_tokens=8))
        t0 = time.perf_counter()
        await engine.pause()
        t1 = time.perf_counter()
        await engine.update_weights(source)
        t2 = time.perf_counter()
        await engine.resume()
        t3 = time.perf_counter()
        aborted = await asyncio.gather(*tasks)
        result.update(
            {
                f"{mode}_pause_s": t1 - t0,
                f"{mode}_load_s": t2 - t1,
                f"{mode}_resume_s": t3 - t2,
                f"{mode}_total_s": t3 - t0,
            }
        )
        result[f"{mode}_tokens_in_flight"] = float(sum(len(o.token_ids) for o in aborted))
    result["overhead_s"] = await _interrupted_overhead(engine, prompts, weights, new_tokens)
    return result


async def _interrupted_overhead(
    engine: Engine, prompts: list[list[int]], weights: list[Path], new_tokens: int
) -> float:
    """Wall time of the workload with one mid-way update minus the same without one."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    walls = []
    for version, update in ((1, False), (2, True)):
        generator = InterruptibleGenerator(engine, version=version)
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(generator.generate(f"o{version}-{i}", p, params))
            for i, p in enumerate(prompts)
        ]
        if update:
            await generator.generate(
                "o-probe", prompts[0], SamplingParams(max_new_tokens=new_tokens // 2)
            )
            assert await generator.update_weights(DiskWeights(weights[1]), version + 1) > 0
        results = await asyncio.gather(*tasks)
        walls.append(time.perf_counter() - start)
        assert all(len(r.token_ids) == new_tokens for r in results)
    return walls[1] - walls[0]


async def bench_engine(
    name: str, args: argparse.Namespace, weights: list[Path], prompts: list[list[int]]
) -> dict[str, float]:
    if name == "torch":
        from areal.workers.rollout.torch_engine import TorchEngine

        engine: Engine = TorchEngine(
            weights[0],
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            max_concurrent=len(prompts),
        )
    else:
        from areal.workers.rollout.vllm_engine import VllmEngine

        engine = VllmEngine(
            weights[0],
            device=args.device,
            dtype=args.dtype,
            max_concurrent=len(prompts),
            cpu_kvcache_space_gb=0.5,
            gpu_memory_utilization=0.3,
            enforce_eager=args.enforce_eager,
            max_model_len=args.max_len,
        )
    start = time.perf_counter()
    await engine.start()
    row = {"start_s": time.perf_counter() - start}
    try:
        await generation(engine, prompts[:4], 8, "warm")
        row.update(await generation(engine, prompts, args.new_tokens, "g"))
        row.update(await interruption(engine, prompts, weights, args.long_tokens, args.new_tokens))
    finally:
        await engine.close()
    return row


def bench_generate(
    args: argparse.Namespace, weights: list[Path], prompts: list[list[int]]
) -> dict[str, float]:
    start = time.perf_counter()
    model = load_model(weights[0], device=args.device, dtype=args.dtype)
    row = {"start_s": time.perf_counter() - start}
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)
    mask = torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]

    def run(num_tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask.long().to(args.device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(8)  # warm-up
    wall = run(args.new_tokens)
    row.update(
        {
            "tokens_per_s": len(prompts) * args.new_tokens / wall,
            "wall_s": wall,
            "latency_mean_s": wall,
            "latency_p90_s": wall,
        }
    )
    return row


def skip_reason(name: str, device: str) -> str | None:
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed"
        from vllm.platforms import current_platform

        if current_platform.is_cpu() != (device == "cpu"):
            return f"the installed vLLM does not run on {device}"
    return None


def print_table(rows: dict[str, dict[str, float]]) -> None:
    base = rows.get("torch", {}).get("tokens_per_s")
    print(
        f"\n{'engine':<8}{'start s':>9}{'tok/s':>9}{'vs torch':>10}{'lat mean':>10}"
        f"{'lat p90':>9}{'pause':>8}{'load disk':>10}{'load tens':>10}{'resume':>8}"
        f"{'overhead':>10}"
    )
    for name, r in rows.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"

        def s(key: str, r: dict = r) -> str:
            return f"{r[key]:.3f}" if key in r else "n/a"

        print(
            f"{name:<8}{r['start_s']:>9.1f}{r['tokens_per_s']:>9.0f}{ratio:>10}"
            f"{r['latency_mean_s']:>10.3f}{r['latency_p90_s']:>9.3f}{s('disk_pause_s'):>8}"
            f"{s('disk_load_s'):>10}{s('tensors_load_s'):>10}{s('disk_resume_s'):>8}"
            f"{s('overhead_s'):>10}"
        )
    print(
        "times in seconds; pause/load/resume: one interruption with every request in flight;"
        " overhead: end-to-end extra wall time of one mid-run update"
    )


def save_plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar(names, [rows[n]["tokens_per_s"] for n in names], color="tab:blue")
    ax1.set_title("generation (tokens/s)")
    engines = [n for n in names if "disk_total_s" in rows[n]]
    x = range(len(engines))
    ax2.bar(
        [i - 0.2 for i in x],
        [rows[n]["disk_total_s"] for n in engines],
        width=0.4,
        color="tab:orange",
        label="pause+load(disk)+resume",
    )
    ax2.bar(
        [i + 0.2 for i in x],
        [max(rows[n]["overhead_s"], 0) for n in engines],
        width=0.4,
        color="tab:red",
        label="end-to-end overhead",
    )
    ax2.set_xticks(list(x), engines)
    ax2.set_title("one interruption (s)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engines", default="vllm,torch,hf")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--long-tokens",
        type=int,
        default=300,
        help="budget of the requests in flight during an interruption",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (torch, hf)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=512, help="model positions")
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM: no CUDA graphs / compilation (faster start)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results folder (default bench/results/engines; only a run there "
        "writes the docs' results page, docs/results/engines.md, or "
        "engines-gpu.md on a GPU)",
    )
    return parser.parse_args()


async def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    page = publish(quick=False, out=args.out)
    out = Path(args.out or "bench/results/engines")
    out.mkdir(parents=True, exist_ok=True)
    shape = TinyModelConfig(
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.hidden_size // 32,
        num_kv_heads=max(1, args.hidden_size // 64),
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=args.max_len,
    )
    prompts = make_prompts(args.requests)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = [save_tiny_model(Path(tmp) / f"v{s}", shape, seed=s) for s in (0, 1)]
        for name in args.engines.split(","):
            reason = skip_reason(name, args.device)
            if reason:
                print(f"skipping {name}: {reason}")
                continue
            print(f"running {name} ...", flush=True)
            rows[name] = (
                bench_generate(args, weights, prompts)
                if name == "hf"
                else await bench_engine(name, args, weights, prompts)
            )
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        print(
            f"{args.requests} requests x {args.new_tokens} tokens, {args.device}, "
            f"{args.dtype}, model hidden {args.hidden_size} x {args.layers} layers; load "
            f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        print_table(rows)
    table = printed.getvalue()
    print("\n" + table, end="")
    (out / "engines.json").write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    if rows:
        save_plot(rows, out / "engines.png")
    print(f"results in {out}/engines.json, engines.png")
    if page and rows:
        name = "engines" if args.device == "cpu" else "engines-gpu"
        print(
            "results page: "
            + str(
                write_results(
                    name,
                    title=f"Inference engines on {args.device} (bench/engines.py)",
                    command=" ".join(["python", *sys.argv]),
                    table=table,
                    data={"args": vars(args), "results": rows},
                    notes="The same requests through each engine: throughput and latency, and the "
                    "cost of one interruption (pause with every request in flight, load new "
                    "weights, resume).",
                )
            )
        )


if __name__ == "__main__":  # a guard vLLM needs: its CPU workers are started with spawn
    asyncio.run(main())
