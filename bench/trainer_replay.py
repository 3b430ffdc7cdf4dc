"""A run's trained batches timed again on a trainer alone: is training slower inside a run?

    python bench/trainer_replay.py RUN_DIR [--costs FILE]

RUN_DIR is a real run made with `logging.save_batches=true` (bench/calibration.py's runs
are: e.g. bench/results/calibration/probe-async). Each of its saved batches is trained
again, in order, by the run's own trainer code (PPOTrainer.step, then the publication to
disk) in this process, with nothing else running, starting from the run's initial model;
each step after the first is printed next to what the run's trainer took for the same batch
(`train/step_s` + `train/publish_s` of its step record, checkpoints left out) and what the
cost model prices it at (`cpu-2core`, `tiny` of FILE, default sim/costs.yaml). The totals
say whether a run's trainer is slowed by what shares the machine with it (generation, the
controller, the reward worker) or whether the cost model misprices the run's batches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from machine_timings import TimedTrainer

from areal.config import load_config
from areal.controller.setup import load_saved_batch
from areal.records import read_records
from areal.sim.cost import cost_model, load_costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--costs", type=Path, default=None, help="default: sim/costs.yaml")
    args = parser.parse_args()
    records = [r for r in read_records(args.run_dir) if r["kind"] == "step"]
    cost = cost_model(load_costs(args.costs), "cpu-2core", "tiny")
    with tempfile.TemporaryDirectory(prefix="trainer-replay-") as scratch:
        cfg = load_config(args.run_dir / "config.yaml", [f"run_dir={scratch}"])
        trainer = TimedTrainer(cfg)
        recompute = cfg.trainer.ppo.prox_logp == "recompute"
        print(f"{'step':>4} {'tokens':>7} {'in run s':>9} {'alone s':>8} {'model s':>8}")
        totals = np.zeros(3)
        for index, record in enumerate(records, start=1):
            batch = load_saved_batch(args.run_dir, index)
            alone = trainer.step_s(batch)  # step 1 too: the trainer state follows the run's
            if index == 1:
                continue
            in_run = record["train/step_s"] + record.get("train/publish_s", 0.0)
            lengths = np.diff(batch.cu_seqlens.numpy())
            model = cost.train_s(
                lengths, cfg.trainer.num_minibatches, 1, recompute, cfg.trainer.micro_batch_tokens
            ) + cost.publish_s(False)
            totals += (in_run, alone, model)
            print(f"{index:>4} {int(lengths.sum()):>7} {in_run:>9.3f} {alone:>8.3f} {model:>8.3f}")
    in_run, alone, model = totals
    print(
        f"steps 2-{len(records)}: in run {in_run:.3f} s, alone {alone:.3f} s, model "
        f"{model:.3f} s; in run / alone {in_run / alone:.3f}, alone / model "
        f"{alone / model:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
