"""Timings of this machine's torch rollout engine and trainer, in the cost model's units.

What bench/calibration.py fits (areal.sim.calibrate) to give the simulator a measured
`cpu-2core` entry. Everything runs the project's own code on the model and settings of
bench/speedup.py (one torch thread per engine and per trainer, as the real run's workers):

    decode    b requests of p random prompt tokens, no stop token, timed to n1 and to n2
              new tokens: the difference is n2 - n1 decode steps of b sequences whose KV
              context starts at b * (p + n1) tokens (prefill cancels out)
    prefill   the same with one new token: the prefill of b prompts of p tokens
    train     PPOTrainer.step on packed batches of a few sizes (recomputed proximal
              log-probs, as the real run), then the publication to disk the real trainer
              does after each step (workers/trainer/worker.py)
    weights   one engine weight update with sequences running: pause (abort), load from
              disk, resume; what a rollout worker pays per new version
    checkpoint one trainer checkpoint (the real run saves one every 10 steps)
    contention decode timed again while training steps run in a second process
              (`python bench/machine_timings.py --background train MODEL_DIR`), against
              the median of undisturbed timings taken before and after (training's
              slowdown is measured inside a real run instead: bench/calibration.py)

Each timing is the median of `repeats`. Nothing here fits or predicts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal.config import RunConfig, load_config
from areal.models.hf import load_model
from areal.sim.calibrate import DecodeSample, PrefillSample, TrainSample
from areal.types import PackedBatch
from areal.workers.rollout.engine import DiskWeights, SamplingParams
from areal.workers.rollout.torch_engine import TorchEngine
from areal.workers.trainer.checkpoint import save_checkpoint
from areal.workers.trainer.ppo import PPOTrainer
from areal.workers.trainer.publish import publish_to_disk

CONTENDED_DECODE = (64, 16, 136)
"""(batch, prompt tokens, new tokens) of the contended decode sample: the order of a sync
step's batch of 64 completions."""
BACKGROUND_TRAIN = (64, 64)
"""(sequences, tokens each) of the background training load: about one real step's
batch."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to measure (the full calibration, or `quick` for the test suite)."""

    decode_grid: tuple[tuple[int, int], ...] = (
        (1, 16),
        (1, 192),
        (8, 16),
        (8, 192),
        (32, 16),
        (32, 192),
        (64, 16),
        (64, 192),
        (128, 16),
        (128, 192),
    )
    """(batch, prompt tokens) pairs."""
    decode_tokens: tuple[int, int] = (8, 72)
    train_grid: tuple[tuple[int, int], ...] = ((16, 32), (64, 24), (64, 64), (64, 120), (128, 96))
    """(sequences, tokens each) of the packed training batches."""
    repeats: int = 3

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            decode_grid=((1, 16), (32, 16), (32, 192), (128, 16)),
            decode_tokens=(8, 72),
            train_grid=((16, 32), (64, 24), (64, 64)),
            repeats=1,
        )


@dataclass(kw_only=True)
class Timings:
    decode: list[DecodeSample] = field(default_factory=list)
    prefill: list[PrefillSample] = field(default_factory=list)
    train: list[TrainSample] = field(default_factory=list)
    publish_s: float = 0.0
    weight_update_s: float = 0.0
    checkpoint_s: float = 0.0
    decode_contention: float = 1.0
    """Contended over undisturbed time of the same decode sample."""


def run_config(model_dir: Path, run_dir: Path, overrides: list[str]) -> RunConfig:
    return load_config(overrides=[*overrides, f"model.path={model_dir}", f"run_dir={run_dir}"])


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


# -- generation --------------------------------------------------------------------------------


async def _generate_s(engine: TorchEngine, batch: int, prompt: int, new_tokens: int) -> float:
    """Seconds for `batch` requests of `prompt` random tokens to each get `new_tokens`."""
    generator = torch.Generator().manual_seed(batch * 1000 + prompt)
    prompts = torch.randint(3, 90, (batch, prompt), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=new_tokens)  # no stop token: exactly new_tokens
    start = time.perf_counter()
    outputs = await asyncio.gather(
        *(engine.generate(f"m{i}", ids, params) for i, ids in enumerate(prompts))
    )
    seconds = time.perf_counter() - start
    if any(len(o.token_ids) != new_tokens for o in outputs):
        raise RuntimeError(
            f"a timed request stopped early: the decode timing is not of {new_tokens} steps"
        )
    return seconds


async def _median_async(fn, repeats: int) -> float:
    return statistics.median([await fn() for _ in range(repeats)])


async def _generation(cfg: RunConfig, plan: Plan, timings: Timings) -> None:
    engine = TorchEngine.from_config(cfg)
    await engine.start()
    try:
        await _generate_s(engine, 8, 16, 8)  # warm-up: first calls pay one-off costs
        n1, n2 = plan.decode_tokens
        for batch, prompt in plan.decode_grid:  # each lambda is awaited in its own iteration
            first = await _median_async(
                lambda: _generate_s(engine, batch, prompt, 1),  # noqa: B023
                plan.repeats,
            )
            short = await _median_async(
                lambda: _generate_s(engine, batch, prompt, n1),  # noqa: B023
                plan.repeats,
            )
            long = await _median_async(
                lambda: _generate_s(engine, batch, prompt, n2),  # noqa: B023
                plan.repeats,
            )
            timings.prefill.append(PrefillSample(lengths=(prompt,) * batch, seconds=first))
            timings.decode.append(
                DecodeSample(
                    batch=batch, context=batch * (prompt + n1), steps=n2 - n1, seconds=long - short
                )
            )
            print(
                f"  decode b={batch:>3} p={prompt:>3}: prefill {first * 1e3:.1f} ms, "
                f"{(long - short) / (n2 - n1) * 1e3:.2f} ms/step",
                file=sys.stderr,
                flush=True,
            )
        timings.weight_update_s = await _median_async(
            lambda: _weight_update_s(engine, cfg), plan.repeats
        )
        batch, prompt, new = CONTENDED_DECODE
        alone = [await _generate_s(engine, batch, prompt, new) for _ in range(plan.repeats)]
        with _background(cfg, "train"):
            loaded = await _median_async(
                lambda: _generate_s(engine, batch, prompt, new), plan.repeats
            )
        alone += [await _generate_s(engine, batch, prompt, new) for _ in range(plan.repeats)]
        timings.decode_contention = loaded / statistics.median(alone)
    finally:
        await engine.close()


async def _weight_update_s(engine: TorchEngine, cfg: RunConfig) -> float:
    """Pause with 64 sequences running, load the weights from disk, resume."""
    model = load_model(cfg.model.path, dtype=cfg.model.dtype, device="cpu")
    path = publish_to_disk(list(model.state_dict().items()), cfg, 1)
    params = SamplingParams(max_new_tokens=300)
    running = asyncio.gather(*(engine.generate(f"w{i}", [5] * 16, params) for i in range(64)))
    await asyncio.sleep(0.3)
    start = time.perf_counter()
    await engine.pause()  # the running requests come back short (ABORT), as in a real update
    await engine.update_weights(DiskWeights(path))
    await engine.resume()
    seconds = time.perf_counter() - start
    await running
    return seconds


# -- training ------------------------------------------------------------------------------------


def packed_batch(num_seqs: int, length: int, prompt: int = 10) -> PackedBatch:
    """Random sequences of `length` tokens (`prompt` of them prompt), groups of 8."""
    generator = torch.Generator().manual_seed(num_seqs * 1000 + length)
    tokens = num_seqs * length
    completion = torch.arange(length) >= prompt
    return PackedBatch(
        token_ids=torch.randint(3, 90, (tokens,), generator=generator),
        logprobs=torch.full((tokens,), -4.0),
        versions=torch.where(completion, 0, -1).repeat(num_seqs),
        loss_mask=completion.repeat(num_seqs),
        cu_seqlens=torch.arange(num_seqs + 1, dtype=torch.int32) * length,
        rewards=(torch.rand(num_seqs, generator=generator) > 0.5).float(),
        group_ids=torch.arange(num_seqs) // 8,
    )


class TimedTrainer:
    """The trainer rank's work per step: PPO step, then the weights published to disk."""

    def __init__(self, cfg: RunConfig) -> None:
        torch.set_num_threads(cfg.trainer.threads)
        self.cfg = cfg
        self.trainer = PPOTrainer(
            load_model(cfg.model.path, dtype=cfg.model.dtype, device="cpu"), cfg
        )
        self.version = 0

    def step_s(self, batch: PackedBatch) -> float:
        start = time.perf_counter()
        self.trainer.step(batch, self.version)
        self.version += 1
        publish_to_disk(list(self.trainer.model.state_dict().items()), self.cfg, self.version)
        return time.perf_counter() - start

    def publish_s(self) -> float:
        start = time.perf_counter()
        self.version += 1
        publish_to_disk(list(self.trainer.model.state_dict().items()), self.cfg, self.version)
        return time.perf_counter() - start


def _training(cfg: RunConfig, plan: Plan, timings: Timings) -> None:
    trainer = TimedTrainer(cfg)
    trainer.step_s(packed_batch(16, 32))  # warm-up
    for num_seqs, length in plan.train_grid:
        batch = packed_batch(num_seqs, length)
        seconds = _median(lambda: trainer.step_s(batch), plan.repeats)  # noqa: B023 (called here)
        timings.train.append(TrainSample(lengths=(length,) * num_seqs, seconds=seconds))
        print(
            f"  train {num_seqs:>3} x {length:>3} tokens: {seconds * 1e3:.0f} ms",
            file=sys.stderr,
            flush=True,
        )
    timings.publish_s = _median(trainer.publish_s, max(plan.repeats, 3))
    start = time.perf_counter()
    save_checkpoint(
        trainer.trainer.model,
        trainer.trainer.optimizer,
        cfg.run_dir,
        10,
        trainer.version,
        cfg.trainer.keep_checkpoints,
    )
    timings.checkpoint_s = time.perf_counter() - start


# -- the other load ------------------------------------------------------------------------------


class _background:
    """A second process running training steps in a loop (the trainer of an async run),
    from its first finished step until the block ends."""

    def __init__(self, cfg: RunConfig, kind: str) -> None:
        self.command = [
            sys.executable,
            __file__,
            "--background",
            kind,
            str(cfg.model.path),
            *cfg_overrides(cfg),
        ]

    def __enter__(self) -> _background:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            self.process.kill()
            raise RuntimeError(f"background load {self.command} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def cfg_overrides(cfg: RunConfig) -> list[str]:
    return [
        f"rollout.threads={cfg.rollout.threads}",
        f"trainer.threads={cfg.trainer.threads}",
        f"rollout.max_concurrent={cfg.rollout.max_concurrent}",
    ]


def _background_main(model_dir: str, overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = run_config(Path(model_dir), Path(run_dir), overrides)
        trainer, batch = TimedTrainer(cfg), packed_batch(*BACKGROUND_TRAIN)
        trainer.step_s(batch)
        print("ready", flush=True)
        while True:
            trainer.step_s(batch)


def measure(model_dir: Path, overrides: list[str], plan: Plan) -> Timings:
    """Every timing of the module docstring, on the model in `model_dir`."""
    timings = Timings()
    with tempfile.TemporaryDirectory(prefix="calibrate-") as run_dir:
        cfg = run_config(model_dir, Path(run_dir), overrides)
        asyncio.run(_generation(cfg, plan, timings))
        _training(cfg, plan, timings)
    return timings


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="background load for the contention timing")
    parser.add_argument("--background", choices=["train"], required=True)
    parser.add_argument("model_dir")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    _background_main(args.model_dir, args.overrides)
