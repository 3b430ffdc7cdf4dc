"""The simulator checked against this machine: predicted vs measured sync and async runs.

    python bench/cluster.py --calibrate [--quick] [--out DIR]

1. measures this machine's torch engine and trainer on the model of bench/speedup.py
   (bench/machine_timings.py) and fits the cost model's factors to them
   (areal.sim.calibrate): a `cpu-2core` accelerator entry (one accelerator = one core
   running one worker with one torch thread, as the real run's rollout worker and trainer)
   and a `tiny` model shape, written to OUT/costs-cpu.yaml with their sources;
2. runs a short real async run with another seed (the probe: seed 2, eta 2, 12 steps) and
   prices training as it costs inside a run: the fitted training price times the probe's
   trainer steps (as its controller timed them, less the publication) over what the fit
   prices for the same batches, the median step (areal.sim.calibrate.fit_train_slowdown).
   A fit to step 1's timings alone priced later runs' batches off by more than the target
   (either way), though a trainer trains them alone as fast as in the run and as fast as
   synthetic batches of their size: a shared machine's speed drifts over minutes
   (docs/history.md, calibration). The
   probe's steps are real batches, in a real run, a minute before the runs being
   predicted, and none of them is a step of those runs;
3. runs bench/speedup.py's sync and async runs (its config: 40 steps of 8 prompts x 8
   samples, eta 2, max_new_tokens 384, one rollout worker, one trainer rank, interruption
   on), saving their trained batches;
4. simulates each with the real controller on two simulated `cpu-2core` accelerators (one
   generating, one training), replaying the real run's prompt and completion lengths
   (areal.sim.replay) and evaluating as many held-out prompts before training as the real
   run did (its first training groups are generated meanwhile), and prints predicted vs
   measured wall time from the end of the first training step to the end of the last (see
   `after_first`), their ratio and the error of each.

The lengths come from the real runs (what the model wrote is not what is being predicted;
how long writing and training on it takes is); everything else is the fitted cost model.
`--quick` (the test suite's): a shorter warm start, fewer timings, a 2-step probe, 4-step
runs, 16 held-out prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvloop
import yaml

sys.path.insert(0, str(Path(__file__).parent))

import speedup
from machine_timings import Plan, Timings, measure

from areal.config import load_config
from areal.controller.setup import saved_batch_path
from areal.records import read_records
from areal.sim.calibrate import (
    GenerationFit,
    SlowdownFit,
    TrainFit,
    TrainSample,
    fit_generation,
    fit_train_slowdown,
    fit_training,
)
from areal.sim.config import sim_config
from areal.sim.cost import accelerator, cost_model, load_costs, model_shape
from areal.sim.replay import ReplayWorkload
from areal.sim.run import simulate

ACCELERATOR, MODEL = "cpu-2core", "tiny"
COMMAND = "python bench/cluster.py --calibrate"
REWARD_LATENCY_S = 0.002
"""Assumption: one ZeroMQ round trip to the reward worker and an exact integer check."""
PROBE_SEED = 2
"""The probe run's seed: not the seed of the runs being predicted (1)."""
PROBE_STEPS = 12
"""The probe's steps: 11 compared, and a checkpoint (every 10th step) as the runs have."""
QUICK_WARMSTART = ["model.warmstart.steps=200"]
"""--quick: a shorter warm start (a sixth of the default's steps; the smoke test's numbers
mean nothing), so that a fresh machine does not spend minutes building the full one."""
NOMINAL = {
    "peak_flops": (
        134.4e9,
        "nominal, not measured: one core of this machine's Xeon (lscpu: "
        "avx512f, BogoMIPS 4200 = 2.1 GHz) x 2 AVX-512 FMA units x 16 fp32 lanes x "
        "2 FLOPs; the fitted mfu/train_mfu are fractions of it",
    ),
    "hbm_bandwidth": (
        10.0e9,
        "nominal, not measured: 10 GB/s of memory bandwidth per core; "
        "the fitted hbm factor is a fraction of it",
    ),
}


@dataclass(frozen=True)
class Check:
    mode: str
    measured_s: float
    predicted_s: float
    measured_tokens: int
    predicted_tokens: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def _model_entry(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    source = f"config.json of the warm-started embedded model ({model_dir.name})"
    values = dict(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        vocab=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    entry: dict[str, Any] = {
        key: {"value": value, "source": source} for key, value in values.items()
    }
    entry["mem_fraction"] = {
        "value": 1.0,
        "source": "the torch engine's KV cache is sized "
        "apart from the weights: hbm_bytes holds weights + that cache",
    }
    return entry


def _accelerator_entry(costs: dict[str, Any], timings: Timings, stamp: str) -> dict[str, Any]:
    """The measured accelerator without its efficiency mapping (filled in by the fits)."""
    model = model_shape(costs, MODEL)
    # The torch engine holds max_concurrent sequences of up to 512 tokens (torch_engine.py).
    kv_tokens = 128 * 512
    weight_rate = model.weight_bytes / timings.publish_s
    measured = f"measured by {COMMAND} on {stamp}"
    return {
        "peak_flops": {"value": NOMINAL["peak_flops"][0], "source": NOMINAL["peak_flops"][1]},
        "hbm_bytes": {
            "value": float(model.weight_bytes + kv_tokens * model.kv_bytes_per_token),
            "source": "weights + the torch engine's KV cache of 128 x 512 tokens "
            "(rollout.max_concurrent x 512, workers/rollout/torch_engine.py)",
        },
        "hbm_bandwidth": {
            "value": NOMINAL["hbm_bandwidth"][0],
            "source": NOMINAL["hbm_bandwidth"][1],
        },
        "intra_node_bandwidth": {
            "value": weight_rate,
            "source": f"{measured}: cost-model "
            f"weight bytes / {timings.publish_s * 1e3:.1f} ms, the "
            "trainer publishing its weights to disk",
        },
        "inter_node_bandwidth": {
            "value": weight_rate,
            "source": f"{measured}: as intra_node_bandwidth (one machine)",
        },
        "devices_per_node": {"value": 2, "source": "lscpu: 2 cores"},
        "shared_cores": {
            "value": 2,
            "source": "lscpu: 2 cores, shared by every worker "
            "process of a run: more busy worker threads than cores run at "
            "cores / threads of their speed (sim/workers.py, Host)",
        },
    }


def fit_costs(
    model_dir: Path, timings: Timings, stamp: str
) -> tuple[dict[str, Any], GenerationFit, TrainFit]:
    """The shipped cost file plus the measured `cpu-2core` entry and the `tiny` model."""
    costs = load_costs()
    costs["models"][MODEL] = _model_entry(model_dir)
    costs["accelerators"][ACCELERATOR] = _accelerator_entry(costs, timings, stamp)
    acc, model = accelerator(costs, ACCELERATOR), model_shape(costs, MODEL)
    gen = fit_generation(acc, model, timings.decode, timings.prefill)
    train = fit_training(acc, model, timings.train)
    # The trainer's measured step includes its publication to disk; the cost model adds
    # publish_s (weight bytes over the measured bandwidth = the measured publication) itself,
    # so it is taken out here.
    # The real run also saves a checkpoint every 10 steps (trainer.checkpoint_every): spread.
    publish = model.weight_bytes / acc.inter_node_bandwidth
    overhead = train.train_step_overhead_s - publish + timings.checkpoint_s / 10
    measured = f"measured by {COMMAND} on {stamp}"
    decode_fit = (
        f"{measured}; fit to {len(timings.decode)} decode and "
        f"{len(timings.prefill)} prefill timings, rms relative error "
        f"{gen.decode_rms:.1%} (decode), {gen.prefill_rms:.1%} (prefill)"
    )
    train_fit = f"{measured}; fit to {len(timings.train)} trainer steps, rms {train.rms:.1%}"
    costs["accelerators"][ACCELERATOR]["efficiency"] = {
        "mfu": {"value": gen.mfu, "source": decode_fit},
        "hbm": {
            "value": gen.hbm,
            "source": decode_fit
            + (
                "; not set by these timings (the memory term never decides a step): the largest "
                "value that fits as well"
                if gen.hbm > 0.999
                else ""
            ),
        },
        "link": {"value": 1.0, "source": "the bandwidths above are measured effective ones"},
        "step_overhead_s": {"value": gen.step_overhead_s, "source": decode_fit},
        "layer_step_overhead_s": {
            "value": 0.0,
            "source": "folded into step_overhead_s (one model shape measured)",
        },
        "seq_step_overhead_s": {"value": gen.seq_step_overhead_s, "source": decode_fit},
        "train_mfu": {"value": train.train_mfu, "source": train_fit},
        "train_pack_attention": {
            "value": train.train_pack_attention,
            "source": (f"{train_fit}: the better of attention per sequence and over whole packs"),
        },
        "train_step_overhead_s": {
            "value": max(0.0, overhead),
            "source": (
                f"{train_fit}: fixed {train.train_step_overhead_s * 1e3:.1f} ms - publication "
                f"{publish * 1e3:.1f} ms (priced apart) + checkpoint {timings.checkpoint_s * 1e3:.0f}"
                " ms / 10 steps" + (" (clamped at 0)" if overhead < 0 else "")
            ),
        },
        "weight_update_overhead_s": {
            "value": max(0.0, timings.weight_update_s - publish),
            "source": (
                f"{measured}: one engine weight update with 64 sequences running (pause, load "
                f"from disk, resume) {timings.weight_update_s * 1e3:.0f} ms - the bytes' move "
                f"{publish * 1e3:.1f} ms (priced apart)"
            ),
        },
        "decode_pack_attention": {
            "value": gen.decode_pack_attention,
            "source": (
                f"{decode_fit}: the better of attention per context token and per (batch x context)"
            ),
        },
        "contention": {
            "value": timings.decode_contention,
            "source": (
                f"{measured}: decode time while a trainer runs in a second process over decode "
                "time alone (the real run's controller and reward worker not included)"
            ),
        },
    }
    return costs, gen, train


def run_steps(
    model_dir: Path, run_dir: Path, mode: str, seed: int, steps: int, extra: list[str]
) -> list[dict[str, Any]]:
    """One bench/speedup.py run (eta 2), its batches saved: its step records."""
    args = argparse.Namespace(eta=2, steps=steps, overrides=[*extra, "logging.save_batches=true"])
    start = time.monotonic()  # speedup._run removes a previous calibration's run first
    _, records = uvloop.run(
        speedup._run(speedup._overrides(args, model_dir, run_dir, mode, seed=seed))
    )
    print(
        f"  real {run_dir.name} run: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True
    )
    return [r for r in records if r["kind"] == "step"]


def in_run_steps(
    run_dir: Path, records: list[dict[str, Any]], recompute: bool
) -> list[TrainSample]:
    """Each step after the first of a run: its batch's lengths and the seconds the
    controller waited for the trainer's answer (`perf/train_s`: the step, the publication,
    a checkpoint where due, and the messages)."""
    samples = []
    for index, record in enumerate(records[1:], start=2):
        batch = np.load(saved_batch_path(run_dir, index))
        samples.append(
            TrainSample(
                lengths=tuple(int(n) for n in np.diff(batch["cu_seqlens"])),
                seconds=float(record["perf/train_s"]),
                recompute_prox=recompute,
            )
        )
    return samples


def probe_training(
    costs: dict[str, Any], model_dir: Path, out: Path, steps: int, stamp: str
) -> SlowdownFit:
    """The training price of a real async run of seed PROBE_SEED (see the module
    docstring): the fitted `train_mfu` and `train_step_overhead_s` in `costs` scaled by
    the probe's factor."""
    run_dir = out / "probe-async"
    records = run_steps(model_dir, run_dir, "async", PROBE_SEED, steps, ["eval.max_prompts=16"])
    cfg = load_config(run_dir / "config.yaml")
    fit = fit_train_slowdown(
        cost_model(costs, ACCELERATOR, MODEL),
        in_run_steps(run_dir, records, cfg.trainer.ppo.prox_logp == "recompute"),
        num_minibatches=cfg.trainer.num_minibatches,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
    )
    efficiency = costs["accelerators"][ACCELERATOR]["efficiency"]
    probe = (
        f"; times {fit.factor:.3f}, the training price of a real async run of seed "
        f"{PROBE_SEED} (bench/speedup.py's settings, {steps} steps, measured by {COMMAND} "
        f"on {stamp}): its trainer's steps 2-{steps} as its controller timed them, less "
        "the publication, over the fit's price of the same batches, the median step; "
        f"rms {fit.rms:.1%} per step"
    )
    for key, scale in (("train_mfu", 1 / fit.factor), ("train_step_overhead_s", fit.factor)):
        efficiency[key] = {
            "value": efficiency[key]["value"] * scale,
            "source": efficiency[key]["source"] + probe,
        }
    efficiency["train_contention"] = {
        "value": 1.0,
        "source": (
            "the training price above is the one of a run whose trainer shares the machine with "
            "generation (the probe); a trainer training a run's batches again alone was not faster "
            "than the run's (bench/trainer_replay.py; docs/history.md, calibration)"
        ),
    }
    return fit


def real_runs(
    model_dir: Path, out: Path, steps: int, extra: list[str]
) -> dict[str, tuple[float, int]]:
    """bench/speedup.py's sync and async runs (seed 1), batches saved for the replay: per
    mode, (wall seconds and tokens trained after the first step, see `after_first`)."""
    summaries = {}
    for mode in ("sync", "async"):
        steps_done = run_steps(model_dir, out / mode, mode, 1, steps, extra)
        summaries[mode] = after_first(
            [r["perf/train_elapsed_s"] for r in steps_done],
            [r["perf/trained_tokens"] for r in steps_done],
        )
    return summaries


def after_first(times: list[float], tokens: list[int]) -> tuple[float, int]:
    """(seconds, tokens) from the end of the first training step to the end of the last.

    The first step is left out of the comparison: a real run evaluates 256 held-out prompts
    before training starts, and its first batch is generated meanwhile (outside the
    training clock). The simulated run evaluates as many (`first_eval_problems`): an async
    run's next batches are generated meanwhile too, and with a 4-step run's 3 compared
    steps, which groups they hold depends on it (without it the quick runs' trained tokens
    were predicted far short; docs/history.md, "The opening evaluation")."""
    return times[-1] - times[0], tokens[-1] - tokens[0]


def predict(costs_path: Path, run_dir: Path, mode: str, steps: int) -> tuple[float, float]:
    """(simulated wall seconds, trained tokens) after the first step of the run in
    `run_dir`, which evaluated as many held-out prompts at its start as the real one."""
    cfg = sim_config(
        accelerator=ACCELERATOR,
        model=MODEL,
        costs=str(costs_path),
        num_accelerators=2,
        gen_fraction=0.5,
        mode=mode,
        eta=2,
        interrupt=True,
        num_prompts=8,
        group_size=8,
        max_new_tokens=384,
        num_minibatches=1,
        max_concurrent_prompts=16,
        steps=steps,
        measure_from=1,
        seed=1,
        eval_prompts=first_eval_problems(run_dir),
    )
    result = simulate(cfg, workload=ReplayWorkload.from_run(run_dir, REWARD_LATENCY_S))
    seconds = result.step_s * (steps - 1)  # measured over steps 2..steps (measure_from=1)
    return seconds, result.trained_tokens_per_s * seconds


def first_eval_problems(run_dir: Path) -> int:
    """How many held-out prompts the real run evaluated before training: its first
    training groups were generated beside them (a head start `after_first` does not
    remove for an async run, whose buffer holds batches generated meanwhile)."""
    for record in read_records(run_dir):
        if record.get("kind") == "eval":
            return int(record["eval/num_problems"])
    raise ValueError(
        f"{run_dir}: no evaluation record; bench/speedup.py's runs evaluate before training"
    )


def table(checks: dict[str, Check]) -> str:
    head = f"{'after step 1':<22} {'measured':>10} {'predicted':>10} {'error':>8}"
    rows = [head, "-" * len(head)]
    for c in checks.values():
        rows.append(
            f"{c.mode + ' wall s':<22} {c.measured_s:>10.1f} "
            f"{c.predicted_s:>10.1f} {c.error:>+8.1%}"
        )
    sync, async_ = checks["sync"], checks["async"]
    measured, predicted = sync.measured_s / async_.measured_s, sync.predicted_s / async_.predicted_s
    rows.append(
        f"{'sync / async time':<22} {measured:>9.2f}x {predicted:>9.2f}x "
        f"{predicted / measured - 1:>+8.1%}"
    )
    for c in checks.values():
        rows.append(
            f"{c.mode + ' trained tokens':<22} {c.measured_tokens:>10} "
            f"{c.predicted_tokens:>10.0f} "
            f"{c.predicted_tokens / c.measured_tokens - 1:>+8.1%}"
        )
    return "\n".join(rows)


def fitted_lines(
    gen: GenerationFit, train: TrainFit, timings: Timings, slowdown: SlowdownFit
) -> str:
    return "\n".join(
        [
            f"decode step = {gen.step_overhead_s * 1e3:.2f} ms + {gen.seq_step_overhead_s * 1e6:.0f}"
            f" us x batch + roofline (mfu {gen.mfu:.3g}, hbm {gen.hbm:.3g} of nominal; attention "
            f"per {'batch x ' if gen.decode_pack_attention else ''}context token); rms "
            f"error {gen.decode_rms:.1%} decode, {gen.prefill_rms:.1%} prefill",
            f"train step = {train.train_step_overhead_s * 1e3:.1f} ms + (3+1) x forward FLOPs at "
            f"train_mfu {train.train_mfu:.3g} of nominal (attention over "
            f"{'whole packs' if train.train_pack_attention else 'each sequence'}); rms error "
            f"{train.rms:.1%}",
            f"weight update {timings.weight_update_s * 1e3:.0f} ms, publish "
            f"{timings.publish_s * 1e3:.0f} ms, checkpoint {timings.checkpoint_s * 1e3:.0f} ms; "
            f"contention decode {timings.decode_contention:.2f}x (beside a trainer process)",
            f"training price x {slowdown.factor:.3f} in a run: seed-{PROBE_SEED} async probe, "
            f"median of {slowdown.steps} step{'s' if slowdown.steps != 1 else ''} over the fit's "
            f"price, rms {slowdown.rms:.1%} per step",
        ]
    )


def run(quick: bool, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    steps = 4 if quick else 40  # quick: 3 compared steps
    extra = ["eval.max_prompts=16"] if quick else []
    model_dir = speedup._warm_model(argparse.Namespace(overrides=QUICK_WARMSTART if quick else []))
    start = time.monotonic()
    timings = measure(model_dir, speedup.LONG_TAIL_TASK, Plan.quick() if quick else Plan())
    print(f"  timings: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    (out / "timings.json").write_text(json.dumps(dataclasses.asdict(timings)))
    costs, gen, train = fit_costs(model_dir, timings, stamp)
    slowdown = probe_training(costs, model_dir, out, 2 if quick else PROBE_STEPS, stamp)
    costs_path = out / "costs-cpu.yaml"
    costs_path.write_text(yaml.safe_dump(costs, sort_keys=False, width=100))
    summaries = real_runs(model_dir, out, steps, extra)
    checks = {}
    for mode, (measured_s, measured_tokens) in summaries.items():
        predicted_s, predicted_tokens = predict(costs_path, out / mode, mode, steps)
        checks[mode] = Check(mode, measured_s, predicted_s, measured_tokens, predicted_tokens)
    text = (
        f"{table(checks)}\n({steps} steps of 8 prompts x 8 samples, eta 2, seed 1; "
        f"steps 2-{steps} compared; fitted cost file: {costs_path})\n"
        f"{fitted_lines(gen, train, timings, slowdown)}"
    )
    (out / ("calibration-quick.txt" if quick else "calibration.txt")).write_text(text + "\n")
    return text
