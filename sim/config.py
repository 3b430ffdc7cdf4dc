"""What to simulate: the cluster, the model, the system (sync or async) and the workload size.

A typed tree like the run's own config (areal.config): defaults < YAML file < `key=value`
overrides, each field with its help text (shown by `python -m areal.sim --help`), checked
with errors that name the field, the value and the fix. `to_run_overrides` turns it into the
controller's own options (areal.config.RunConfig): the simulated controller is configured
exactly as a real one would be, with the worker counts the placement implies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal.config import ConfigError, RolloutConfig, opt

from areal.sim.cost import COSTS_FILE, cost_model, load_costs

PLACEMENTS = ("split", "colocated")
T = TypeVar("T")


NEVER_LOST_S = 86400
"""The simulated run's controller.heartbeat_timeout_s: no worker is ever lost in one."""


@dataclass(kw_only=True)
class SimConfig:
    accelerator: str = opt(
        "h800",
        "accelerator kind, an entry of the cost file (h800, h100, "
        "h200, a100, or your own entry in a `costs` file)",
    )
    num_accelerators: int = opt(128, "accelerators in the cluster")
    model: str = opt("1.5b", "model shape, an entry of the cost file (1.5b, 7b, 14b, 32b)")
    mode: str = opt(
        "async",
        "async: generation and training overlap, bounded by eta; sync: "
        "generate a batch, then train",
        ["async", "sync"],
    )
    placement: str = opt(
        "split",
        "split: generation and training on separate accelerators "
        "(gen_fraction of them generate); colocated: every accelerator "
        "generates, then every one trains (sync only, as verl runs)",
        list(PLACEMENTS),
    )
    switch_costs: bool = opt(
        False,
        "colocated placement: pay what a colocated synchronous "
        "system pays each step to switch its accelerators between "
        "generation and training (the engine's weights to host memory "
        "and back, its KV cache dropped and allocated again, the "
        "trainer's states in and out: costs.yaml `colocation`); false: "
        "the idealised baseline, which pays none of it",
    )
    gen_fraction: float = opt(
        0.75, "split placement: fraction of the accelerators that generate (AReaL: 3/4)"
    )
    rollout_tp: int = opt(1, "accelerators per rollout server (tensor parallel)")
    eta: int | None = opt(4, "staleness bound of async mode; null: unbounded")
    interrupt: bool = opt(True, "async mode: interrupt generation for new weights")
    strict: bool = opt(
        False,
        "async mode: the controller's staleness.strict (no trained "
        "token more than eta versions old; groups that cannot make it are "
        "dropped and generated again)",
    )
    rollout_rewards: bool = opt(
        False,
        "the run's reward.num_workers=0: each rollout server checks its own "
        "completions (the workload's reward latency each, reward.max_concurrency at "
        "once) and its Completions carries the rewards; false: reward workers score "
        "them (one per 8 nodes), through the controller",
    )
    num_prompts: int = opt(512, "prompts per training step")
    group_size: int = opt(16, "samples per prompt")
    max_new_tokens: int = opt(27648, "longest completion")
    num_minibatches: int = opt(4, "PPO minibatches (optimiser steps) per training step")
    prox_logp: str = opt(
        "recompute",
        "proximal log-probs: a forward pass, or loglinear (none)",
        ["recompute", "loglinear"],
    )
    lora_rank: int = opt(
        0,
        "LoRA rank of the trained adapters (trainer.lora.rank): a version "
        "is the adapters alone and training skips the base's weight "
        "gradients (the cost file's `lora` entry); 0: full fine-tuning",
    )
    max_concurrent_prompts: int = opt(
        512, "prompts in flight over all rollout servers at once (AReaL max_concurrent_rollouts)"
    )
    steps: int = opt(8, "training steps to simulate")
    measure_from: int = opt(
        3, "step time is measured over the steps after this one (the pipeline fills first)"
    )
    report_steps: int = opt(1000, "hours are reported for a run of this many steps")
    eval_prompts: int = opt(
        1,
        "held-out prompts evaluated (one greedy answer each) at the "
        "start and the end, a real run's eval.max_prompts: the first "
        "training groups are generated beside the start's",
    )
    seed: int = opt(1, "seed of prompt and completion lengths and rewards")
    wire: bool = opt(
        True,
        "encode and decode every message as on the wire (msgpack + raw "
        "frames), so the controller pays its real decoding cost",
    )
    measure_alone: bool = opt(
        False,
        "also measure the controller's CPU cost alone: replay "
        "the messages it received to a fresh controller with no "
        "simulated worker beside it (sim/alone.py; needs wire)",
    )
    alone_without_intake: bool = opt(
        False,
        "with measure_alone, replay the same messages a second time to a controller "
        "without an intake thread (controller.intake_thread=false: its event loop reads "
        "the tokens itself): the intake's effect, paired on one recording",
    )
    heartbeat_interval_s: float | None = opt(
        300.0,
        "the run's controller.heartbeat_interval_s: each side sends a Heartbeat in each "
        "interval in which it sent the other nothing else. Workers are never lost in a "
        "simulation, so the default keeps them rare (a faster simulation); a measurement "
        "of the controller's CPU sets a real run's (null: its default, automatic: 1 s, "
        "longer past 500 workers), whose Heartbeats it pays for",
    )
    max_queued: int = opt(
        RolloutConfig().max_queued,
        "the run's rollout.max_queued: requests each rollout server holds beyond what it "
        "decodes at once. While it holds any, its finished completions wait and go to the "
        "controller together: more queued means fewer, larger answers (less controller CPU "
        "a completion) and completions that reach the controller later (staler)",
    )
    costs: str | None = opt(None, "cost parameter file; null: the shipped sim/costs.yaml")
    run_dir: str | None = opt(
        None, "where the simulated run writes metrics.jsonl; null: a temporary directory"
    )

    def check(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank={self.lora_rank!r} must be >= 0 (0: full fine-tuning)")
        for name in (
            "num_accelerators",
            "rollout_tp",
            "num_prompts",
            "group_size",
            "max_new_tokens",
            "num_minibatches",
            "max_concurrent_prompts",
            "steps",
            "report_steps",
            "eval_prompts",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 1")
        if not 0 <= self.measure_from < self.steps:
            raise ConfigError(
                f"measure_from={self.measure_from} must be in [0, steps="
                f"{self.steps}): at least one step is measured"
            )
        if self.heartbeat_interval_s is not None and not (
            0 < self.heartbeat_interval_s <= NEVER_LOST_S / 3
        ):
            raise ConfigError(
                f"heartbeat_interval_s={self.heartbeat_interval_s!r} must be in "
                f"(0, {NEVER_LOST_S / 3:g}]: a third of the heartbeat timeout"
            )
        if self.max_queued < 0:
            raise ConfigError(f"max_queued={self.max_queued!r} must be >= 0 (0: none queued)")
        if self.alone_without_intake and not self.measure_alone:
            raise ConfigError(
                "alone_without_intake=true is a second replay: it needs measure_alone=true"
            )
        if self.measure_alone and not self.wire:
            raise ConfigError(
                "measure_alone=true replays the messages as frames: it needs wire=true"
            )
        if self.eta is not None and self.eta < 0:
            raise ConfigError(f"eta={self.eta!r} must be >= 0 or null (unbounded)")
        if self.placement == "colocated" and self.mode != "sync":
            raise ConfigError(
                "placement='colocated' runs generation and training on the same "
                "accelerators one after the other: it needs mode='sync'"
            )
        if self.switch_costs and self.placement != "colocated":
            raise ConfigError(
                "switch_costs=true prices switching the same accelerators "
                "between generation and training: it needs "
                "placement='colocated'"
            )
        if self.placement == "split":
            if not 0 < self.gen_fraction < 1:
                raise ConfigError(f"gen_fraction={self.gen_fraction!r} must be in (0, 1)")
            if self.num_rollout_workers < 1 or self.num_trainer_ranks < 1:
                raise ConfigError(
                    f"num_accelerators={self.num_accelerators} with gen_fraction="
                    f"{self.gen_fraction} and rollout_tp={self.rollout_tp} leaves no "
                    "rollout server or no trainer rank; add accelerators or move gen_fraction"
                )
        if self.num_accelerators % self.rollout_tp and self.placement == "colocated":
            raise ConfigError(
                f"num_accelerators={self.num_accelerators} is not a multiple "
                f"of rollout_tp={self.rollout_tp}"
            )

    @property
    def num_gen_accelerators(self) -> int:
        if self.placement == "colocated":
            return self.num_accelerators
        return round(self.num_accelerators * self.gen_fraction)

    @property
    def num_rollout_workers(self) -> int:
        return self.num_gen_accelerators // self.rollout_tp

    @property
    def num_trainer_ranks(self) -> int:
        if self.placement == "colocated":
            return self.num_accelerators
        return self.num_accelerators - self.num_rollout_workers * self.rollout_tp

    @property
    def unbounded_eta(self) -> int:
        """The eta that stands for "unbounded": the run's length in batches plus the
        concurrency limit in batches. Admission never waits on it within the run (what is in
        flight is bounded by max_concurrent_prompts); a larger one would only make the
        controller queue requests that can never be dispatched before the run ends."""
        return self.steps + math.ceil(self.max_concurrent_prompts / self.num_prompts) + 1

    @property
    def batch_size(self) -> int:
        return self.num_prompts * self.group_size

    def to_run_overrides(self, run_dir: str) -> list[str]:
        """The controller's options for this simulated run (areal.config.RunConfig keys)."""
        eta = self.eta if self.eta is not None else self.unbounded_eta
        per_worker = math.ceil(
            self.max_concurrent_prompts * self.group_size / self.num_rollout_workers
        )
        num_nodes = max(1, self.num_accelerators // 8)
        return [
            f"mode={self.mode}",
            f"seed={self.seed}",
            f"run_dir={run_dir}",
            f"task.group_size={self.group_size}",
            f"trainer.batch_size={self.batch_size}",
            f"trainer.total_steps={self.steps}",
            f"trainer.num_minibatches={self.num_minibatches}",
            f"trainer.num_ranks={self.num_trainer_ranks}",
            f"trainer.ppo.prox_logp={self.prox_logp}",
            # Faults are not simulated: no checkpoint replay buffer to keep.
            "trainer.checkpoint_every=0",
            f"rollout.num_workers={self.num_rollout_workers}",
            f"rollout.max_new_tokens={self.max_new_tokens}",
            f"rollout.max_concurrent={per_worker}",
            f"rollout.max_queued={self.max_queued}",
            f"rollout.interrupt={self.interrupt}",
            f"staleness.eta={eta}",
            f"staleness.strict={self.strict}",
            # Reward checks run on CPUs beside the accelerators: one worker (256 checks at
            # once) per 8 nodes is never the bottleneck here.
            f"reward.num_workers={0 if self.rollout_rewards else math.ceil(num_nodes / 8)}",
            "reward.max_concurrency=256",
            "weight_sync.mode=disk",
            "eval.every_steps=0",
            f"eval.max_prompts={self.eval_prompts}",
            # No worker is lost in a simulation: liveness never times out.
            "controller.heartbeat_interval_s="
            + ("null" if self.heartbeat_interval_s is None else f"{self.heartbeat_interval_s}"),
            f"controller.heartbeat_timeout_s={NEVER_LOST_S}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.level=WARNING",
        ]


def load_sim_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> SimConfig:
    """Defaults, then the YAML file, then `key=value` overrides; validated."""
    return load_options(SimConfig, path, overrides)


def load_options(
    schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> T:
    """An options dataclass of this module's kind (fields made with `opt`, a `check()`):
    defaults, then the YAML file, then `key=value` overrides; validated."""
    node = OmegaConf.structured(schema)
    try:
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {str(path)!r} must hold a mapping")
            node = OmegaConf.merge(node, OmegaConf.create(loaded))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(
                    f"override {item!r} is not of the form key=value (e.g. num_accelerators=256)"
                )
            node = OmegaConf.merge(node, OmegaConf.from_dotlist([item]))
        cfg: Any = OmegaConf.to_object(node)  # a SimConfig: the schema it was made from
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err}") from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(
            f"{schema.__name__} key {key!r}: {str(err).splitlines()[0]}; --help lists the options"
        ) from None
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise ConfigError(
                f"{f.name}={getattr(cfg, f.name)!r} is not one of {', '.join(choices)}"
            )
    cfg.check()
    check_costs(cfg)
    return cfg


def check_costs(cfg: Any) -> None:
    """The cost file (`cfg.costs`) prices `cfg.model` on `cfg.accelerator` (and its
    `lora_rank`, where the options have one): checked when the options are loaded, so that
    an unknown name or a malformed file is a ConfigError saying which, at once, and not a
    traceback from the first simulation (a plan's, in another process, minutes later)."""
    path = Path(cfg.costs) if cfg.costs is not None else COSTS_FILE
    try:
        modified = path.stat().st_mtime_ns
    except OSError:
        modified = None  # load_costs names the missing file
    try:
        _priced(path, modified, cfg.accelerator, cfg.model, getattr(cfg, "lora_rank", 0))
    except (ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError) as err:
        where = cfg.costs if cfg.costs is not None else "the shipped sim/costs.yaml"
        raise ConfigError(f"costs={where}: {err}") from None


@functools.cache
def _priced(path: Path, modified: int | None, accelerator: str, model: str, lora_rank: int) -> None:
    """`check_costs`' check, once per version of a file (its modification time) and entry:
    a plan and the benches build hundreds of options, and parsing the cost file takes tens
    of milliseconds. A check that raises is not cached: it fails again each time."""
    cost_model(load_costs(path), accelerator, model, lora_rank)


def sim_config(**values: Any) -> SimConfig:
    """A validated SimConfig from keyword values (for code: the bench, the tests)."""
    return load_sim_config(overrides=[f"{key}={_text(value)}" for key, value in values.items()])


def _text(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)
