"""What LoRA changes for the system, measured against full fine-tuning in one run.

    python bench/lora.py [--sizes 10M,100M,500M] [--rank 16] [--modes disk,stream,shm]
                         [--train-sizes 10M,100M] [--repeats 2] [--quick]

Two tables, each LoRA against full fine-tuning of the same model, as ratios:

1. One published version: its bytes, and the seconds from the trainer holding it to a
   rollout-worker process holding all of it, per weight_sync mode (bench/weight_sync.py's
   measurement, sender and receiver in separate processes): full weights against the
   adapters of rank `--rank` on every projection (areal.models.lora; bf16).
2. The trainer (fp32, as a run trains): the bytes of its parameters and of its AdamW state
   after a real PPO step (workers/trainer/ppo.PPOTrainer; with LoRA the optimiser holds the
   adapters alone), the gradients at the step's peak (the trainable parameters' bytes), and
   the seconds of one step (median of `--repeats` + 1 after a warm-up; one thread) on the
   same packed batch.

Models are bench/weight_sync.py's Qwen2 shapes of about 10M, 100M and 500M parameters,
built here with random weights. `--quick` runs 10M with one repeat and the disk mode (a
smoke test). Full runs write docs/results/lora.md (bench/results_page.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results_page import publish, write_results
from weight_sync import MODELS, build_model, build_tensors, measure

from areal.config import load_config
from areal.types import PackedBatch
from areal.workers.trainer.ppo import PPOTrainer

MODES = ("disk", "stream", "shm")
TRAIN_LENGTHS = [160, 96, 128, 128]
"""Sequences of the training batch (512 tokens, the first 32 of each a prompt)."""


def publication(
    size: str, rank: int, modes: list[str], dtype: str, repeats: int, keys: str
) -> dict:
    full_bytes = sum(
        t.numel() * t.element_size() for _, t in build_tensors(size, getattr(torch, dtype))
    )
    lora_bytes = sum(
        t.numel() * t.element_size()
        for _, t in build_tensors(f"{size}+lora{rank}", getattr(torch, dtype))
    )
    row = {
        "model": size,
        "rank": rank,
        "full_bytes": full_bytes,
        "lora_bytes": lora_bytes,
        "seconds": {},
    }
    for mode in modes:
        times = {}
        for what, name in (("full", size), ("lora", f"{size}+lora{rank}")):
            times[what] = min(measure(mode, name, dtype, keys)[0] for _ in range(repeats))
            print(f"  {name} {mode}: {times[what]:.4f} s", file=sys.stderr, flush=True)
        row["seconds"][mode] = times
    return row


def _batch(vocab: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(0)
    total = sum(TRAIN_LENGTHS)
    cu = torch.tensor([0, *TRAIN_LENGTHS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    mask = torch.ones(total, dtype=torch.bool)
    for start in cu[:-1].tolist():
        mask[start : start + 32] = False
    return PackedBatch(
        token_ids=torch.randint(3, vocab, (total,), generator=gen),
        logprobs=torch.where(mask, -8.0 - torch.rand(total, generator=gen), 0.0),
        versions=torch.where(mask, 0, -1),
        loss_mask=mask,
        cu_seqlens=cu,
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )


def trainer_costs(size: str, rank: int, repeats: int) -> dict:
    row = {"model": size, "rank": rank}
    vocab = MODELS[size][3]
    for what in ("full", "lora"):
        overrides = [
            f"trainer.lora.rank={rank if what == 'lora' else 0}",
            f"trainer.lora.alpha={2 * rank}",
            "trainer.micro_batch_tokens=8192",
        ]
        trainer = PPOTrainer(build_model(size, torch.float32), load_config(overrides=overrides))
        batch = _batch(vocab)
        seconds = []
        for version in range(repeats + 2):  # the first step warms up (and creates AdamW state)
            start = time.perf_counter()
            trainer.step(batch, version)
            seconds.append(time.perf_counter() - start)
        params = list(trainer.model.parameters())
        row[what] = {
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in trainer.params),
            "optimizer_bytes": sum(
                t.numel() * t.element_size()
                for state in trainer.optimizer.state.values()
                for t in state.values()
                if torch.is_tensor(t)
            ),
            "step_s": statistics.median(seconds[1:]),
        }
        print(f"  {size} {what} trainer: {row[what]}", file=sys.stderr, flush=True)
        del trainer
    return row


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}" if num_bytes >= 2**20 / 10 else f"{num_bytes / 2**20:.3f}"


def tables(pub: list[dict], train: list[dict], modes: list[str], dtype: str) -> str:
    lines = [
        f"1. one published version ({dtype}): MB, and seconds from the trainer to a "
        "rollout-worker process (best of repeats)"
    ]
    head = f"{'model':>6} {'rank':>4} {'MB full':>9} {'MB LoRA':>9} {'ratio':>8}" + "".join(
        f" {m + ' full':>11} {m + ' LoRA':>11} {'ratio':>7}" for m in modes
    )
    lines += [head]
    for row in pub:
        cells = "".join(
            f" {row['seconds'][m]['full']:>10.4f}s {row['seconds'][m]['lora']:>10.4f}s "
            f"{row['seconds'][m]['lora'] / row['seconds'][m]['full']:>7.3f}"
            for m in modes
        )
        lines.append(
            f"{row['model']:>6} {row['rank']:>4} {_mb(row['full_bytes']):>9} "
            f"{_mb(row['lora_bytes']):>9} {row['lora_bytes'] / row['full_bytes']:>8.4f}" + cells
        )
    lines += [
        "",
        "2. the trainer (fp32, AdamW, one PPO step on 512 tokens, one thread): MB of "
        "parameters + optimiser state, gradients at the peak, seconds per step",
    ]
    head = (
        f"{'model':>6} {'rank':>4} {'MB full':>9} {'MB LoRA':>9} {'ratio':>7} "
        f"{'grad MB full':>13} {'LoRA':>7} {'step s full':>12} {'LoRA':>8} {'ratio':>6}"
    )
    lines += [head]
    for row in train:
        full, lora = row["full"], row["lora"]
        f_mem = full["param_bytes"] + full["optimizer_bytes"]
        l_mem = lora["param_bytes"] + lora["optimizer_bytes"]
        lines.append(
            f"{row['model']:>6} {row['rank']:>4} {_mb(f_mem):>9} {_mb(l_mem):>9} "
            f"{l_mem / f_mem:>7.3f} {_mb(full['trainable_bytes']):>13} "
            f"{_mb(lora['trainable_bytes']):>7} {full['step_s']:>11.2f}s "
            f"{lora['step_s']:>7.2f}s {lora['step_s'] / full['step_s']:>6.2f}"
        )
    return "\n".join(lines)


NOTES = """\
LoRA's ranks and target modules are trainer.lora's (rank as given, alpha 2 x rank, every
projection of the decoder layers). Table 1 times the same paths as
[weight_sync](weight_sync.md) (`shm` in its steady state). In table 2 the LoRA trainer
still holds the frozen base in fp32; what LoRA removes is the base's gradients and AdamW
state, and the weight-gradient half of the backward pass (the cost model's
`backward_weight_grad_share`, sim/costs.yaml), while the activations' gradients still
flow through every layer.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,100M,500M", help="models of table 1")
    parser.add_argument("--train-sizes", default="10M,100M", help="models of table 2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtype", default="bfloat16", help="published dtype (table 1)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 10M, disk mode, one repeat"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write table.txt here (default: nowhere)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.train_sizes, args.modes, args.repeats = "10M", "10M", "disk", 1
    torch.set_num_threads(1)
    keys = tempfile.mkdtemp(prefix="areal-bench-keys-")
    from areal.auth import init_keys

    init_keys(keys)
    modes = args.modes.split(",")
    pub = [
        publication(size, args.rank, modes, args.dtype, args.repeats, keys)
        for size in args.sizes.split(",")
    ]
    train = [trainer_costs(size, args.rank, args.repeats) for size in args.train_sizes.split(",")]
    text = tables(pub, train, modes, args.dtype)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.txt").write_text(text + "\n")
    if publish(args.quick, args.out):
        page = write_results(
            "lora",
            title="LoRA against full fine-tuning: publication and trainer",
            command="python " + " ".join(sys.argv),
            table=text,
            data={"publication": pub, "trainer": train, "dtype": args.dtype},
            notes=NOTES,
        )
        print(f"results page: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
