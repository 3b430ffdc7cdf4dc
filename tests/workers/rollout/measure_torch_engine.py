"""Measurement, not a test: TorchEngine throughput and the cost of one interruption.

    python tests/workers/rollout/measure_torch_engine.py [--threads 1] [--repeats 3]

Throughput: N requests x T new tokens (random prompts of 8-40 tokens, temperature 1, no
stop token) on the embedded tiny model, from submission to the last result. For reference,
the same workload through plain `model.generate` (one padded batch). Interruption: with N
sequences in flight, the wall time of pause -> update_weights(disk) -> resume, split into
its phases. The machine's load average is printed: other processes skew the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from areal.models.hf import load_model
from areal.models.tiny import save_tiny_model
from areal.workers.rollout.engine import DiskWeights, SamplingParams
from areal.workers.rollout.torch_engine import TorchEngine


def prompts(num: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(n),), generator=g).tolist()
            for n in torch.randint(8, 41, (num,), generator=g)]


async def engine_throughput(engine: TorchEngine, num: int, new: int, seed: int) -> float:
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(f"{seed}-{i}", p, params)
                                  for i, p in enumerate(prompts(num, seed))))
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def generate_throughput(model_dir: Path, num: int, new: int) -> float:
    model = load_model(model_dir)
    batch = prompts(num, 0)
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in batch])[:, None])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask.long(), do_sample=True, max_new_tokens=new,
                       min_new_tokens=new, pad_token_id=0, top_k=0)
    return num * new / (time.perf_counter() - start)


async def interruption_cost(engine: TorchEngine, weights: Path, num: int) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=400, temperature=1.0)
    tasks = [asyncio.create_task(engine.generate(f"x{i}", p, params))
             for i, p in enumerate(prompts(num, 99))]
    await engine.generate("probe", [5, 6, 7], SamplingParams(max_new_tokens=8))
    t0 = time.perf_counter()
    await engine.pause()
    t1 = time.perf_counter()
    await engine.update_weights(DiskWeights(weights))
    t2 = time.perf_counter()
    await engine.resume()
    t3 = time.perf_counter()
    outs = await asyncio.gather(*tasks)
    return {"pause_s": t1 - t0, "load_s": t2 - t1, "resume_s": t3 - t2, "total_s": t3 - t0,
            "aborted_tokens_mean": statistics.mean(len(o.token_ids) for o in outs)}


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / "v0", seed=0)
        weights = save_tiny_model(Path(tmp) / "v1", seed=1)
        engine = TorchEngine(model_dir, threads=args.threads)
        await engine.start()
        await engine_throughput(engine, 8, 8, seed=1000)  # warm-up
        rates = [await engine_throughput(engine, args.requests, args.new_tokens, seed=r)
                 for r in range(args.repeats)]
        print(f"load average {os.getloadavg()[0]:.1f}; threads={args.threads}")
        print(f"TorchEngine {args.requests} x {args.new_tokens}: "
              f"{' '.join(f'{r:.0f}' for r in rates)} tokens/s (median "
              f"{statistics.median(rates):.0f})")
        costs = [await interruption_cost(engine, weights, args.requests)
                 for _ in range(args.repeats)]
        for key in costs[0]:
            print(f"interruption {key}: " + " ".join(f"{c[key]:.3f}" for c in costs))
        await engine.close()
        rate = generate_throughput(model_dir, args.requests, args.new_tokens)
        print(f"plain model.generate, one padded batch: {rate:.0f} tokens/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
