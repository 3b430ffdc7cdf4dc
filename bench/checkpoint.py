"""Seconds to save and to load a trainer checkpoint (weights + AdamW state), next to a memory
copy and a plain disk write of the same bytes, and to one publication of the weights alone.

    python bench/checkpoint.py [--sizes 10M,100M] [--repeats 2] [--out bench/results/checkpoint]

For Qwen2-architecture models of about 10M and 100M parameters (random init, fp32 as the
trainer holds them, built here), after one AdamW step so that the optimiser state exists
(exp_avg, exp_avg_sq: a checkpoint writes ~4x the weights):

- memcpy:   `dst.copy_(src)` of every byte a checkpoint writes, in this process.
- disk:     the same bytes written to one file in the run directory and fsync'd (DCP's
            writer syncs its files too): the physical reference of a save on this disk.
- publish:  publish_to_disk of the weights alone (what every step already does in disk mode).
- save:     save_checkpoint as the trainer calls it every trainer.checkpoint_every steps:
            torch.distributed.checkpoint of weights + AdamW (one process), plus the weights
            again as safetensors for rollout workers on resume. The step waits for all of it.
- async:    trainer.checkpoint_async: what the step waits for (the state copied in memory);
            `async write` is the background thread's time to write it, while training goes on.
- load:     load_checkpoint into a fresh model and optimiser, what a restarted trainer does.

The best of `--repeats` runs is reported (the machine is shared). A checkpoint every N steps
costs save / N per step (async / N with trainer.checkpoint_async); compare it with the step
time of your run (metrics.jsonl, train_s). Only a run into the default `--out` writes the
docs' results page (docs/results/checkpoint.md).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results_page import write_results
from weight_sync import MODELS

from areal.config import load_config
from areal.models.weights import save_tensors
from areal.workers.trainer.checkpoint import (
    BackgroundCheckpoints,
    load_checkpoint,
    save_checkpoint,
)
from areal.workers.trainer.publish import publish_to_disk


DEFAULT_OUT = Path("bench/results/checkpoint")


def build(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, inter, vocab, heads, kv = MODELS[name]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(name: str, repeats: int, root: Path) -> dict[str, float]:
    model, optimizer = build(name)
    weights = [p.detach() for p in model.parameters()]
    # What a checkpoint writes: weights + AdamW state (DCP), and the weights again (safetensors).
    tensors = (
        weights
        + [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
        + weights
    )
    copies = [torch.empty_like(t) for t in tensors]
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    cfg = load_config(overrides=[f"run_dir={root}", "weight_sync.keep_versions=1"])
    named = list(model.named_parameters())
    step = iter(range(1, 1000))

    def disk():
        path = root / "disk.bin"
        with open(path, "wb") as out:
            for t in tensors:
                out.write(t.numpy().data)
            out.flush()
            os.fsync(out.fileno())
        path.unlink()

    def save():
        save_checkpoint(
            model,
            optimizer,
            root,
            next(step),
            0,
            keep=2,
            weights=named,
            write_weights=save_tensors,
        )

    row = {
        "params": params,
        "gb": nbytes / 1e9,
        "memcpy": _best(
            lambda: [c.copy_(t) for c, t in zip(copies, tensors, strict=True)], repeats
        ),
        "disk": _best(disk, repeats),
        "publish": _best(lambda: publish_to_disk(named, cfg, 1), repeats),
        "save": _best(save, repeats),
    }
    background, waits, writes = BackgroundCheckpoints(), [], []
    for _ in range(repeats):  # the step waits for `start`; the write is waited for untimed
        start = time.perf_counter()
        background.start(model, optimizer, root, next(step), 0, 2, named, save_tensors)
        waits.append(time.perf_counter() - start)
        written = background.wait()
        assert written is not None
        writes.append(written.write_s)
    row["async"], row["async_write"] = min(waits), min(writes)
    latest = sorted((root / "checkpoints").iterdir())[-1]
    fresh, fresh_optimizer = build(name)
    row["load"] = _best(lambda: load_checkpoint(fresh, fresh_optimizer, latest), repeats)
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    if not same:
        raise AssertionError("the loaded weights differ from the saved ones")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    for name in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix="areal-ckpt-bench-") as root:
            rows[name] = measure(name, args.repeats, Path(root))
    header = (
        f"{'model':>6} {'params':>7} {'ckpt GB':>8} {'memcpy s':>9} {'disk s':>7} "
        f"{'publish s':>10} {'save s':>7} {'async s':>8} {'async write s':>14} {'load s':>7} "
        f"{'save/disk':>10} {'async/save':>11}"
    )
    printed = io.StringIO()
    for line in (header, "-" * len(header)):
        print(line, file=printed)
    for name, r in rows.items():
        print(
            f"{name:>6} {r['params'] / 1e6:>6.1f}M {r['gb']:>8.3f} {r['memcpy']:>9.3f} "
            f"{r['disk']:>7.3f} {r['publish']:>10.3f} {r['save']:>7.3f} {r['async']:>8.3f} "
            f"{r['async_write']:>14.3f} {r['load']:>7.3f} {r['save'] / r['disk']:>9.2f}x "
            f"{r['async'] / r['save']:>10.2f}x",
            file=printed,
        )
    print(printed.getvalue(), end="")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=2)
    )
    print(f"saved {args.out / 'checkpoint.json'}")
    if args.out == DEFAULT_OUT:
        page = write_results(
            "checkpoint",
            title="Trainer checkpoints: save, background save and load (bench/checkpoint.py)",
            command=" ".join(["python", *sys.argv]),
            table=printed.getvalue(),
            data=rows,
            notes="Seconds, best of the repeats. disk: the checkpoint's bytes written to one "
            "file and fsync'd, the baseline of `save/disk`; async: what a step waits for with "
            "trainer.checkpoint_async (the state copied in memory), the baseline of "
            "`async/save` being the step's wait without it; async write: the background "
            "thread's time, spent while the next steps train.",
        )
        print(f"results page: {page}")


if __name__ == "__main__":
    main()
