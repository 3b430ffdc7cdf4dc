"""The typed configuration tree of a run, loaded from YAML with dotted overrides.

Precedence is defaults < YAML file < command line (`trainer.lr=1e-5`). Parsing, merging and
type checking are OmegaConf's (structured configs over these dataclasses); this module adds
the semantic checks (ranges, choices, cross-field rules) and turns every failure into a
`ConfigError` that names the dotted field, the value and the fix.

Each field carries its help text in `metadata["help"]`, which `describe_options()` turns
into the CLI's `--help`; fields marked `secret` never leave the process through
`config_to_dict` / `config_to_yaml` (run directory, W&B, workers' Welcome). This module does
not know what the fields are used for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


def opt(
    default: Any, help: str, choices: Sequence[str] | None = None, *, secret: bool = False
) -> Any:
    """A dataclass field with its help text (and allowed values) attached. `secret`: the
    value is replaced by null wherever the config is written out."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "secret": secret}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _positive(value: float, key: str) -> None:
    if not value > 0:
        raise ConfigError(f"{key}={value!r} must be > 0")


def _non_negative(value: float, key: str) -> None:
    if not value >= 0:
        raise ConfigError(f"{key}={value!r} must be >= 0")


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids of a list like '0-3,8,10-11' (the `taskset -c` syntax)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"{text!r} is not a CPU list like '0-3,8'")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _check_cpus(cpus: list[str], count: int, key: str, count_key: str) -> None:
    if cpus and len(cpus) != count:
        raise ConfigError(
            f"{key} lists {len(cpus)} CPU sets for {count_key}={count}; give "
            "one per process or none"
        )
    for item in cpus:
        try:
            parse_cpu_list(item)
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None


@dataclass(kw_only=True)
class TinyModelConfig:
    """Shape of the embedded default model (a Qwen2-architecture model built locally)."""

    hidden_size: int = opt(128, "width of the embedded model")
    num_layers: int = opt(2, "transformer blocks of the embedded model")
    num_heads: int = opt(4, "attention heads; hidden_size/num_heads must be >= 32 for vLLM")
    num_kv_heads: int = opt(2, "key/value heads (grouped-query attention)")
    intermediate_size: int = opt(512, "MLP width of the embedded model")
    max_position_embeddings: int = opt(512, "longest sequence the embedded model accepts")

    def check(self, key: str) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _positive(getattr(self, name), f"{key}.{name}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"{key}.hidden_size={self.hidden_size} is not divisible by "
                f"{key}.num_heads={self.num_heads}"
            )
        if self.hidden_size // self.num_heads < 32:
            raise ConfigError(
                f"{key}: head_dim = hidden_size/num_heads = {self.hidden_size // self.num_heads} "
                "is below 32, which vLLM cannot serve; raise hidden_size or lower num_heads"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{key}.num_heads must be a multiple of {key}.num_kv_heads")


@dataclass(kw_only=True)
class WarmStartConfig:
    """Supervised warm start of the embedded model, so that RL has something to improve."""

    steps: int = opt(1200, "SFT optimiser steps on the task's training split")
    lr: float = opt(2e-3, "SFT learning rate")
    batch_size: int = opt(32, "SFT sequences per step")

    def check(self, key: str) -> None:
        _non_negative(self.steps, f"{key}.steps")
        _positive(self.lr, f"{key}.lr")
        _positive(self.batch_size, f"{key}.batch_size")


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = opt(
        None, "Hugging Face causal-LM directory (safetensors); null builds the embedded tiny model"
    )
    tokenizer_path: str | None = opt(None, "tokenizer directory; null uses model.path")
    dtype: str = opt(
        "float32", "weights dtype for training and rollout", ["float32", "bfloat16", "float16"]
    )
    trust_remote_code: bool = opt(False, "allow custom modelling code from the model directory")
    tiny: TinyModelConfig = opt(TinyModelConfig(), "embedded model shape (model.path=null only)")

    def model_dir(self) -> str:
        """`path`, once it is set: the controller's set-up writes the embedded model and
        names it there before any worker is welcomed or an evaluation loads it."""
        if self.path is None:
            raise ConfigError(
                "model.path is null: no model directory to read (the controller's set-up "
                "writes the embedded model and sets it; elsewhere pass --model)"
            )
        return self.path

    def tokenizer_dir(self) -> str:
        """Where the tokenizer is read: `tokenizer_path`, else `model_dir()`."""
        return self.tokenizer_path or self.model_dir()

    warmstart: WarmStartConfig = opt(WarmStartConfig(), "embedded model SFT (model.path=null only)")

    def check(self, key: str) -> None:
        if self.path is not None and not Path(self.path).expanduser().is_dir():
            raise ConfigError(
                f"{key}.path={self.path!r} is not a directory; give a local Hugging Face model "
                "directory, or null for the embedded model"
            )
        self.tiny.check(f"{key}.tiny")
        self.warmstart.check(f"{key}.warmstart")


@dataclass(kw_only=True)
class TaskConfig:
    name: str = opt("arithmetic", "a built-in task name or an import path 'package.module:Class'")
    params: dict[str, Any] = opt({}, "keyword arguments for the task class")
    group_size: int = opt(8, "samples generated per prompt (one advantage group)")

    def check(self, key: str) -> None:
        _positive(self.group_size, f"{key}.group_size")


@dataclass(kw_only=True)
class EpisodeConfig:
    """Multi-turn episodes: the model's turns alternate with an environment's observations
    (tool results) in one trajectory (areal.tasks.environment, docs/design.md section 10)."""

    environment: str | None = opt(
        None,
        "null: one completion per sample; a built-in environment ('tools': the "
        "calculator and Python tools of episode.params.tools) or 'package.module:Class'",
    )
    params: dict[str, Any] = opt({}, "keyword arguments for the environment class")
    max_turns: int = opt(
        4,
        "model turns per episode; an episode still unfinished after them "
        "ends with reward 0 (turn_limit)",
    )
    max_turn_tokens: int | None = opt(
        None,
        "token budget of one model turn; null: what is "
        "left of rollout.max_new_tokens, the budget of the whole "
        "episode (model and observation tokens)",
    )
    step_timeout_s: float = opt(
        60.0,
        "time the environment may take to answer one turn; "
        "over it the episode ends with reward 0 (verdict timeout)",
    )

    def check(self, key: str) -> None:
        if self.environment is not None and not self.environment.strip():
            raise ConfigError(
                f"{key}.environment={self.environment!r} is empty; give null, "
                "'tools' or 'package.module:Class'"
            )
        _positive(self.max_turns, f"{key}.max_turns")
        if self.max_turn_tokens is not None:
            _positive(self.max_turn_tokens, f"{key}.max_turn_tokens")
        _positive(self.step_timeout_s, f"{key}.step_timeout_s")


MAX_AGENT_CALLS = 4096
"""Most chat calls an agent episode may make (its Generated lists one entry per segment)."""


@dataclass(kw_only=True)
class AgentConfig:
    """Bring your own agent: each sample runs the user's agent against an OpenAI-compatible
    endpoint in the rollout worker, token for token (areal.tasks.agent, docs/design.md
    section 11, docs/guides/agents.md)."""

    function: str | None = opt(
        None,
        "null: no agent; 'package.module:function' (async def run(client, sample)) or "
        "'package.module:Class' (instances have that method; built with agent.params)",
    )
    params: dict[str, Any] = opt(
        {}, "keyword arguments of an agent class; given to every agent as sample.params"
    )
    discount: float = opt(
        1.0,
        "rewards propagate back through earlier calls: a call's "
        "return is its reward + discount x the next call's return",
    )
    timeout_s: float = opt(
        600.0,
        "time one episode's agent may take; over it the episode "
        "ends with verdict timeout (reward.on_error)",
    )
    max_calls: int = opt(
        32,
        "chat calls per episode; later calls are refused (400) and the "
        "episode ends at its turn limit unless the agent returns a reward",
    )
    max_request_bytes: int = opt(8 << 20, "larger request bodies are refused (400)")
    max_request_tokens: int = opt(
        1 << 16,
        "largest max_tokens / max_completion_tokens a "
        "request may ask for (400 above it); a request asking more "
        "than its segment has left is cut to what is left",
    )
    tool_format: str = opt(
        "auto",
        "how tool calls are written: 'chat' (the chat template's "
        "tools and Qwen2.5's <tool_call> JSON), 'bracket' ([argument] "
        "of the first tool; tokenizers without a chat template); auto: "
        "chat when the tokenizer has a chat template",
        ["auto", "chat", "bracket"],
    )
    observation_template: str | None = opt(
        None,
        "bracket format: how a tool message is rendered, {result} its content; null: "
        "'=' {result} and a newline (what the tool-arithmetic warm start reads)",
    )
    chat_template_kwargs: dict[str, Any] = opt(
        {}, "extra variables of the chat template (e.g. {enable_thinking: false})"
    )
    request_sampling: bool = opt(
        False,
        "a request's temperature and top_p replace the run's "
        "(rollout.temperature / eval.temperature); off: the run's "
        "always apply and the request's are ignored",
    )
    model_name: str = opt("policy", "the model id GET /v1/models lists (requests may name any)")
    host: str = opt("127.0.0.1", "address each rollout worker's endpoint binds")
    port: int = opt(0, "port of the endpoint (rollout worker i binds port + i); 0: a free one")

    def check(self, key: str) -> None:
        if self.function is not None and ":" not in self.function:
            raise ConfigError(
                f"{key}.function={self.function!r} is not an import path 'package.module:function'"
            )
        if not 0 <= self.discount <= 1:
            raise ConfigError(f"{key}.discount={self.discount!r} must be in [0, 1]")
        _positive(self.timeout_s, f"{key}.timeout_s")
        if not 1 <= self.max_calls <= MAX_AGENT_CALLS:
            raise ConfigError(
                f"{key}.max_calls={self.max_calls!r} must be in [1, "
                f"{MAX_AGENT_CALLS}] (a finished episode reports one segment "
                "per call at most)"
            )
        _positive(self.max_request_bytes, f"{key}.max_request_bytes")
        _positive(self.max_request_tokens, f"{key}.max_request_tokens")
        if self.observation_template is not None and "{result}" not in self.observation_template:
            raise ConfigError(
                f"{key}.observation_template={self.observation_template!r} has no {{result}}"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{key}.port={self.port!r} must be in [0, 65535]")


@dataclass(kw_only=True)
class VllmConfig:
    """Options passed through to vLLM's engine arguments (rollout.engine=vllm)."""

    gpu_memory_utilization: float = opt(0.85, "fraction of GPU memory vLLM may take")
    max_model_len: int | None = opt(None, "longest prompt+completion; null: the model's own")
    enforce_eager: bool = opt(True, "skip CUDA-graph capture (faster start, slower decode)")
    cpu_kvcache_space_gb: float = opt(1.0, "KV-cache size on the CPU backend (GiB)")
    tensor_parallel_size: int = opt(1, "GPUs per rollout worker")

    def check(self, key: str) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"{key}.gpu_memory_utilization must be in (0, 1]")
        _positive(self.cpu_kvcache_space_gb, f"{key}.cpu_kvcache_space_gb")
        _positive(self.tensor_parallel_size, f"{key}.tensor_parallel_size")


@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = opt(
        "torch",
        "inference engine: built-in torch, vLLM, or auto (vLLM if importable, else torch)",
        ["auto", "torch", "vllm"],
    )
    num_workers: int = opt(1, "rollout worker processes started by the controller")
    max_new_tokens: int = opt(64, "completion token budget per sample")
    temperature: float = opt(1.0, "sampling temperature (behaviour log-probs include it)")
    top_p: float = opt(1.0, "nucleus sampling mass")
    max_concurrent: int = opt(128, "sequences a worker decodes at once")
    max_queued: int = opt(
        15,
        "requests a worker may hold beyond max_concurrent, queued in its engine; while it "
        "holds any, finished completions are answered together, about max_queued + 1 a "
        "message (the controller's cost is per message)",
    )
    interrupt: bool = opt(
        True,
        "on new weights, interrupt in-flight sequences and continue "
        "them under the new weights (async mode only)",
    )
    threads: int = opt(1, "torch intra-op threads per worker (CPU)")
    devices: list[str] = opt(
        [],
        "device per worker, e.g. ['cuda:0', 'cuda:1']; empty: cpu, or "
        "cuda:i for worker i when CUDA is present",
    )
    cpus: list[str] = opt(
        [],
        "CPU cores per local worker, e.g. ['0-3', '4-7'] (pinned with "
        "sched_setaffinity); empty: not pinned",
    )
    vllm: VllmConfig = opt(VllmConfig(), "vLLM engine options")

    def check(self, key: str) -> None:
        _positive(self.num_workers, f"{key}.num_workers")
        _positive(self.max_new_tokens, f"{key}.max_new_tokens")
        _non_negative(self.temperature, f"{key}.temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{key}.top_p={self.top_p!r} must be in (0, 1]")
        _positive(self.max_concurrent, f"{key}.max_concurrent")
        _non_negative(self.max_queued, f"{key}.max_queued")
        _positive(self.threads, f"{key}.threads")
        if self.devices and len(self.devices) != self.num_workers:
            raise ConfigError(
                f"{key}.devices lists {len(self.devices)} devices for "
                f"{key}.num_workers={self.num_workers}; give one per worker or none"
            )
        _check_cpus(self.cpus, self.num_workers, f"{key}.cpus", f"{key}.num_workers")
        self.vllm.check(f"{key}.vllm")


@dataclass(kw_only=True)
class PPOConfig:
    """The decoupled PPO objective (docs/design.md section 6)."""

    eps_clip: float = opt(
        0.2,
        "clip range of r = pi_theta/pi_prox (low side, and high side unless eps_clip_high is set)",
    )
    eps_clip_high: float | None = opt(None, "separate upper clip range (DAPO 'clip higher')")
    behav_imp_cap: float | None = opt(5.0, "cap on w = pi_prox/pi_behav; null: no cap")
    behav_cap_mode: str = opt(
        "mask",
        "tokens with w above the cap: 'mask' drops them from the loss, 'clamp' clips w to the cap",
        ["mask", "clamp"],
    )
    prox_logp: str = opt(
        "recompute",
        "proximal log-probs: 'recompute' (a forward pass), "
        "'loglinear' (interpolated from per-token versions), or 'behav': "
        "naive PPO, the behaviour policy is the anchor (w = 1; for ablations)",
        ["recompute", "loglinear", "behav"],
    )
    # Off-policy corrections beyond the paper's (areal.algorithms.corrections; recipes in
    # docs/concepts/decoupled-ppo.md).
    behav_imp_floor: float | None = opt(
        None,
        "lower bound on w, handled like the cap by behav_cap_mode (with 'mask' and a cap: "
        "IcePop's two-sided mask); null: none",
    )
    behav_imp_level: str = opt(
        "token",
        "w per token, or per sequence (the geometric mean of its tokens' w, shared "
        "by all of them: a bound then masks or clamps whole sequences)",
        ["token", "sequence"],
    )
    policy_loss: str = opt(
        "ppo",
        "surrogate: 'ppo' (token ratio r, clipped), 'gspo' (GSPO's length-normalised "
        "sequence ratio, clipped), 'cispo' (CISPO: the clipped ratio as a stop-gradient "
        "weight on log pi_theta)",
        ["ppo", "gspo", "cispo"],
    )
    loss_agg_mode: str = opt(
        "token-mean",
        "how token terms become the loss (verl's names): 'token-mean' over all "
        "loss tokens of the batch, 'seq-mean-token-mean' (mean over sequences of their token "
        "mean; GRPO), 'seq-mean-token-sum-norm' (mean over sequences of their token sum / "
        "loss_agg_norm; Dr.GRPO)",
        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
    )
    loss_agg_norm: int | None = opt(
        None,
        "seq-mean-token-sum-norm: the constant token count each sequence's sum is "
        "divided by; null: rollout.max_new_tokens",
    )

    def check(self, key: str) -> None:
        _positive(self.eps_clip, f"{key}.eps_clip")
        if self.eps_clip_high is not None:
            _positive(self.eps_clip_high, f"{key}.eps_clip_high")
        if self.behav_imp_cap is not None and not self.behav_imp_cap > 1:
            raise ConfigError(f"{key}.behav_imp_cap={self.behav_imp_cap!r} must be > 1 or null")
        if self.behav_imp_floor is not None and not 0 < self.behav_imp_floor < 1:
            raise ConfigError(
                f"{key}.behav_imp_floor={self.behav_imp_floor!r} must be in "
                "(0, 1) or null: w = 1 (no drift) must stay inside the bounds"
            )
        if self.loss_agg_norm is not None:
            _positive(self.loss_agg_norm, f"{key}.loss_agg_norm")


@dataclass(kw_only=True)
class AdvantageConfig:
    estimator: str = opt(
        "grpo",
        "grpo: group mean/std; drgrpo: group mean only; rloo: leave-one-out mean",
        ["grpo", "drgrpo", "rloo"],
    )
    reward_scale: float = opt(1.0, "rewards are scaled, then biased, then clipped")
    reward_bias: float = opt(0.0, "added to scaled rewards")
    reward_clip: float | None = opt(None, "clip rewards to [-c, c]; null: no clipping")
    batch_norm: bool = opt(False, "normalise advantages over the whole batch afterwards")
    # DAPO's batch and length shaping (areal.algorithms.shaping, controller/dynamic_sampling.py).
    dynamic_sampling: bool = opt(
        False,
        "drop prompt groups whose advantages are all zero (equal rewards) before "
        "training; admission replaces them, so batches stay full (DAPO dynamic sampling)",
    )
    dynamic_sampling_max_drops: int = opt(
        200,
        "with dynamic_sampling, fail the run after this many groups in a row were "
        "dropped (the task is solved or unsolvable for the model); 0: never",
    )
    overlong_buffer: int = opt(
        0,
        "DAPO soft overlong punishment: completions longer than rollout.max_new_tokens - "
        "overlong_buffer lose reward linearly, overlong_penalty at the limit; 0: off",
    )
    overlong_penalty: float = opt(
        1.0,
        "reward lost by a completion that reaches "
        "rollout.max_new_tokens (with overlong_buffer > 0)",
    )
    mask_truncated: bool = opt(
        False,
        "completions cut by the token budget (finish reason 'length') keep their reward "
        "in the group baseline but get loss mask 0 (DAPO overlong filtering)",
    )

    def check(self, key: str) -> None:
        if self.reward_clip is not None:
            _positive(self.reward_clip, f"{key}.reward_clip")
        _non_negative(self.dynamic_sampling_max_drops, f"{key}.dynamic_sampling_max_drops")
        _non_negative(self.overlong_buffer, f"{key}.overlong_buffer")
        _non_negative(self.overlong_penalty, f"{key}.overlong_penalty")


LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of a Qwen2/Llama decoder block (attention and MLP), not the embedding
or the head: what vLLM serves adapters for on these architectures."""


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA, with PEFT): the base model stays frozen, only the adapters
    train and are published (areal.models.lora; docs/guides/lora.md)."""

    rank: int = opt(0, "LoRA rank r; 0: full fine-tuning (no adapters)")
    alpha: float = opt(16.0, "LoRA scaling numerator: the update is (alpha / rank) * B A")
    dropout: float = opt(
        0.0,
        "dropout on the adapters' input while training (the engines "
        "and the proximal recompute run without it)",
    )
    target_modules: list[str] = opt(
        LORA_TARGET_MODULES,
        "names of the linear layers that get adapters (suffixes of module names, as in PEFT)",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self, key: str) -> None:
        _non_negative(self.rank, f"{key}.rank")
        if self.rank > 512:
            raise ConfigError(f"{key}.rank={self.rank} is above 512, the largest rank vLLM serves")
        _positive(self.alpha, f"{key}.alpha")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{key}.dropout={self.dropout!r} must be in [0, 1)")
        if self.enabled and not self.target_modules:
            raise ConfigError(
                f"{key}.target_modules is empty; name the linear layers that get "
                f"adapters, e.g. {LORA_TARGET_MODULES}"
            )
        bad = [m for m in self.target_modules if m in ("lm_head", "embed_tokens")]
        if bad:
            raise ConfigError(
                f"{key}.target_modules: {bad[0]!r} is not supported (adapters on "
                "the embedding or the head are not published); give linear "
                "layers of the decoder blocks"
            )


@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = opt(60, "training steps (policy versions) in the run")
    batch_size: int = opt(64, "trajectories per training step (B); a multiple of task.group_size")
    lr: float = opt(1e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_betas: list[float] = opt([0.9, 0.999], "AdamW betas")
    grad_clip: float = opt(1.0, "max global gradient norm")
    micro_batch_tokens: int = opt(8192, "token budget of one packed micro-batch")
    num_minibatches: int = opt(1, "optimiser steps per training batch (PPO minibatches)")
    num_ranks: int = opt(1, "data-parallel trainer processes")
    threads: int = opt(1, "torch intra-op threads per trainer rank (CPU)")
    devices: list[str] = opt([], "device per rank, e.g. ['cuda:6', 'cuda:7']; empty: cpu")
    cpus: list[str] = opt([], "CPU cores per local rank, e.g. ['8-11', '12-15']; empty: not pinned")
    data_parallel: str = opt(
        "auto",
        "how ranks combine gradients: FSDP2 'fsdp' (shards "
        "weights, gradients and optimiser state) or a plain gradient "
        "'allreduce' (DDP-equivalent); auto: fsdp on GPUs, allreduce on CPU",
        ["auto", "allreduce", "fsdp"],
    )
    dist_backend: str = opt(
        "auto",
        "torch.distributed backend of the ranks; auto: nccl on GPUs, gloo on CPU",
        ["auto", "gloo", "nccl"],
    )
    dist_timeout_s: float = opt(600.0, "rendezvous and collective timeout of the trainer group")
    store_host: str | None = opt(
        None,
        "address other nodes use to reach trainer rank 0 (its "
        "TCPStore, where process groups meet); null: the address of "
        "its interface that routes to the controller",
    )
    store_port: int = opt(0, "port of trainer rank 0's TCPStore; 0 picks a free one")
    checkpoint_every: int = opt(
        10,
        "save the trainer's state (weights + optimiser, "
        "<run_dir>/checkpoints) every N steps; a lost trainer rank is "
        "restarted from the latest one and the controller replays the "
        "batches trained since; 0: never, and a lost rank fails the run",
    )
    checkpoint_async: bool = opt(
        False,
        "write each checkpoint in a thread of its own while the next "
        "steps train: the step only copies the state (a copy of the "
        "checkpoint in CPU memory while it is written); the "
        "controller hears of it, and can resume from it, once written",
    )
    keep_checkpoints: int = opt(
        2,
        "trainer checkpoints kept on disk (the newest; at least 2, "
        "so that the one the controller last heard of is never gone; "
        "one more with checkpoint_async, whose checkpoints the "
        "controller hears of later)",
    )
    measure_movement: bool = opt(
        False,
        "after each step, a no-grad forward of the batch "
        "under the updated weights (and one under the starting weights "
        "unless ppo.prox_logp=recompute): the step's policy movement "
        "(train/kl_prox_new, train/kl_behav_new) and the behaviour "
        "weights of any objective (train/behav_w_frac/*); 1-2 forwards "
        "per step",
    )
    audit_steps: list[int] = opt(
        [],
        "steps whose batch the trainer saves with the proximal "
        "log-probs its loss used and its weights at the start of the "
        "step, to <run_dir>/audit/step_<n>/ (an end-to-end check of the "
        "objective's inputs: tests/controller/test_pipeline_check.py)",
    )
    ppo: PPOConfig = opt(PPOConfig(), "decoupled PPO objective")
    advantage: AdvantageConfig = opt(AdvantageConfig(), "advantage estimator")
    lora: LoraConfig = opt(LoraConfig(), "low-rank adapters (rank 0: full fine-tuning)")

    def check(self, key: str) -> None:
        _positive(self.total_steps, f"{key}.total_steps")
        if any(step < 1 for step in self.audit_steps):
            raise ConfigError(f"{key}.audit_steps={self.audit_steps!r}: steps count from 1")
        _positive(self.batch_size, f"{key}.batch_size")
        _positive(self.lr, f"{key}.lr")
        _non_negative(self.weight_decay, f"{key}.weight_decay")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"{key}.adam_betas={self.adam_betas!r} must be two numbers in [0, 1)")
        _positive(self.grad_clip, f"{key}.grad_clip")
        _positive(self.micro_batch_tokens, f"{key}.micro_batch_tokens")
        _positive(self.num_minibatches, f"{key}.num_minibatches")
        _positive(self.num_ranks, f"{key}.num_ranks")
        _positive(self.threads, f"{key}.threads")
        _non_negative(self.checkpoint_every, f"{key}.checkpoint_every")
        if self.keep_checkpoints < 2:
            raise ConfigError(
                f"{key}.keep_checkpoints={self.keep_checkpoints!r} must be >= 2: a "
                "trainer lost while saving a checkpoint resumes from the one before"
            )
        if self.devices and len(self.devices) != self.num_ranks:
            raise ConfigError(
                f"{key}.devices lists {len(self.devices)} devices for "
                f"{key}.num_ranks={self.num_ranks}; give one per rank or none"
            )
        _check_cpus(self.cpus, self.num_ranks, f"{key}.cpus", f"{key}.num_ranks")
        _positive(self.dist_timeout_s, f"{key}.dist_timeout_s")
        if not 0 <= self.store_port < 65536:
            raise ConfigError(f"{key}.store_port={self.store_port!r} must be in [0, 65535]")
        self.ppo.check(f"{key}.ppo")
        self.advantage.check(f"{key}.advantage")
        self.lora.check(f"{key}.lora")


@dataclass(kw_only=True)
class RewardConfig:
    num_workers: int = opt(
        1,
        "reward worker processes; 0: none, each rollout worker checks its own "
        "completions before sending them (one Completions carries their rewards: no "
        "Score or Scored through the controller)",
    )
    max_concurrency: int = opt(
        8, "checks a reward worker (with reward.num_workers=0: a rollout worker) runs at once"
    )
    timeout_s: float = opt(
        10.0,
        "per-trajectory reward time limit; over it the check is an "
        "infrastructure failure (verdict 'timeout'): see reward.retries",
    )
    retries: int = opt(
        2,
        "a check that fails for want of infrastructure (verifier or sandbox "
        "error, over reward.timeout_s, reward worker lost) is run again this "
        "many times (by another reward worker; with reward.num_workers=0 by the "
        "rollout worker that generated it); a wrong answer or a program over its own "
        "time limit is a verdict, never retried",
    )
    on_error: str = opt(
        "drop",
        "after the retries: 'drop' the training group (counted as "
        "rollout/dropped_groups/reward_error and replaced; no false zeros) or "
        "score the sample 'zero' with the failure's verdict",
        ["drop", "zero"],
    )

    def check(self, key: str) -> None:
        _non_negative(self.num_workers, f"{key}.num_workers")
        _positive(self.max_concurrency, f"{key}.max_concurrency")
        _positive(self.timeout_s, f"{key}.timeout_s")
        _non_negative(self.retries, f"{key}.retries")


@dataclass(kw_only=True)
class StalenessConfig:
    eta: int = opt(
        2,
        "max policy versions a trajectory may lag the trainer (async mode); "
        "0 is synchronous-equivalent",
    )
    strict: bool = opt(
        False,
        "also hold the bound where batches are consumed: no trained "
        "token was sampled more than eta versions before the version trained; "
        "groups that cannot make it are dropped and generated again (cost: "
        "rollout/dropped_groups/stale, rollout/dropped_tokens). Off: the bound "
        "holds at admission only, and late completions may be staler",
    )

    def check(self, key: str) -> None:
        _non_negative(self.eta, f"{key}.eta")


@dataclass(kw_only=True)
class WeightSyncConfig:
    mode: str = opt(
        "disk",
        "how new weights reach rollout workers: safetensors on a shared "
        "'disk', 'stream' over ZeroMQ, a 'collective' broadcast group, or 'shm': "
        "slots in shared memory that trainer rank 0 and the rollout workers of "
        "one host map (no copy on the reading side; one host only)",
        ["disk", "stream", "collective", "shm"],
    )
    bucket_mb: int = opt(64, "tensor bucket size for stream/collective (MiB)")
    keep_versions: int = opt(
        2,
        "weight versions kept: directories on disk (disk mode), slots in shared memory (shm mode)",
    )
    shm_dir: str = opt(
        "/dev/shm",
        "shm mode: the shared-memory file system holding the "
        "slots (a tmpfs; they take keep_versions x the weights' size in RAM)",
    )
    backend: str = opt(
        "auto",
        "collective mode: process-group backend of trainer rank 0 and "
        "the rollout workers; auto: nccl when both sides use GPUs, else gloo",
        ["auto", "gloo", "nccl"],
    )
    timeout_s: float = opt(
        60.0,
        "collective mode: rendezvous and broadcast timeout; after a "
        "failure the group is re-formed without the members that left",
    )

    def check(self, key: str) -> None:
        _positive(self.bucket_mb, f"{key}.bucket_mb")
        _positive(self.keep_versions, f"{key}.keep_versions")
        if self.mode == "shm" and self.keep_versions < 2:
            raise ConfigError(
                f"{key}.keep_versions={self.keep_versions} with {key}.mode='shm' "
                "must be >= 2: a version is written into another slot than the "
                "one being served, so that a crash mid-write leaves it loadable"
            )
        _positive(self.timeout_s, f"{key}.timeout_s")


@dataclass(kw_only=True)
class EvalConfig:
    every_steps: int = opt(
        10, "held-out evaluation every N training steps (0: only at the start and the end)"
    )
    temperature: float = opt(0.0, "sampling temperature of evaluation (0: greedy)")
    num_samples: int = opt(1, "samples per held-out prompt (pass@k for k <= num_samples)")
    max_prompts: int | None = opt(None, "evaluate on at most this many held-out prompts")

    def check(self, key: str) -> None:
        _non_negative(self.every_steps, f"{key}.every_steps")
        _non_negative(self.temperature, f"{key}.temperature")
        _positive(self.num_samples, f"{key}.num_samples")
        if self.max_prompts is not None:
            _positive(self.max_prompts, f"{key}.max_prompts")


@dataclass(kw_only=True)
class LoggingConfig:
    progress: bool = opt(
        True,
        "progress on the console: a live bar on a terminal, a plain "
        "line every progress_every steps otherwise (a log file)",
    )
    progress_every: int = opt(10, "steps between progress lines when the console is not a terminal")
    tensorboard: bool = opt(True, "TensorBoard event files in the run directory")
    wandb_project: str | None = opt(None, "Weights & Biases project (needs wandb installed)")
    level: str = opt("INFO", "log level", ["DEBUG", "INFO", "WARNING", "ERROR"])
    save_batches: bool = opt(
        False,
        "save every trained batch (tokens, behaviour log-probs, "
        "versions, rewards) to <run_dir>/batches/step_<n>.npz",
    )

    def check(self, key: str) -> None:
        _positive(self.progress_every, f"{key}.progress_every")


HEARTBEATS_PER_S = 500
"""The Heartbeats a second the automatic `controller.heartbeat_interval_s` lets the controller
receive. Each costs it several microseconds (decoded, its worker's time noted), whatever
the batch: at 2,080 workers and one a second, 1-2% of a core (docs/history.md, "Heartbeats
at 2,048 accelerators"); at 500 a second about a quarter of that, and a run of up to 500
workers keeps one-second rounds."""


@dataclass(kw_only=True)
class ControllerConfig:
    host: str = opt(
        "127.0.0.1", "address the controller binds (loopback unless remote workers must join)"
    )
    port: int = opt(0, "port of the controller socket; 0 picks a free one")
    heartbeat_interval_s: float | None = opt(
        None,
        "how often each side sends a Heartbeat if it sent the other nothing else (and the "
        "controller checks for lost workers); null: 1 s, longer past "
        f"{HEARTBEATS_PER_S} workers so that the controller hears about "
        f"{HEARTBEATS_PER_S} a second (RunConfig.heartbeat_interval)",
    )
    heartbeat_timeout_s: float = opt(30.0, "a worker silent this long is declared lost")
    secret: str | None = opt(
        None,
        "shared secret workers must present to join; null: a "
        "random one per run, passed to spawned workers privately. Never "
        "written to the run directory (give it again with --resume); "
        "prefer a 0600 config file to the command line, which other "
        "local users can read",
        secret=True,
    )
    max_message_mb: int = opt(2048, "larger incoming messages are refused")
    auth: str = opt(
        "auto",
        "how peers are authenticated: 'curve' (CurveZMQ: only holders of an "
        "authorised client key can connect; traffic encrypted), 'secret' (the "
        "shared secret in Register, plain TCP); auto: curve when the controller "
        "binds a non-loopback address or expects remote workers, else secret",
        ["auto", "curve", "secret"],
    )
    keys_dir: str | None = opt(
        None,
        "CurveZMQ key directory (python -m areal.auth init DIR); "
        "null: a fresh one in <run_dir>/keys",
    )
    remote_kinds: list[str] = opt(
        [],
        "worker kinds the controller does not start; it waits "
        "for rollout.num_workers / reward.num_workers / "
        "trainer.num_ranks of them to join with --connect",
    )
    intake_thread: bool = opt(
        True,
        "decode each received Completions of 32,768 tokens or more, check its parts and "
        "read its tokens (their extremes, which the checks compare) on a thread beside the "
        "controller's event "
        "loop, which decides on the messages before it meanwhile (areal.intake); false: "
        "on the loop, as a baseline to compare against",
    )
    gc_thresholds: list[int] = opt(
        [50000, 1000, 100],
        "the controller process's cyclic "
        "garbage-collector thresholds while a run goes (Python's "
        "gc.set_threshold; with its default 700, 10, 10 full "
        "collections walk every live sample often; these walk a "
        "sample about once: areal.controller.collector); []: leave "
        "them as they are",
    )

    def check(self, key: str) -> None:
        if self.gc_thresholds and (
            len(self.gc_thresholds) != 3
            or not all(type(n) is int and n > 0 for n in self.gc_thresholds)
        ):
            raise ConfigError(
                f"{key}.gc_thresholds={self.gc_thresholds!r}: three positive "
                "integers (generation 0 allocations, then generations 1 and 2 "
                "per collection of the one below), or [] for Python's own"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{key}.port={self.port!r} must be in [0, 65535]")
        _positive(self.heartbeat_timeout_s, f"{key}.heartbeat_timeout_s")
        interval = self.heartbeat_interval_s
        if interval is not None:  # null: automatic, never more than a third of the timeout
            _positive(interval, f"{key}.heartbeat_interval_s")
            # Each side sends a Heartbeat only in an interval in which it sent nothing else,
            # so the other may hear nothing for up to two intervals; the third is slack.
            if not self.heartbeat_timeout_s >= 3 * interval:
                raise ConfigError(
                    f"{key}.heartbeat_timeout_s={self.heartbeat_timeout_s!r} must be at least "
                    f"three times {key}.heartbeat_interval_s={interval!r}"
                )
        _positive(self.max_message_mb, f"{key}.max_message_mb")
        kinds = ("rollout", "reward", "trainer")
        for kind in self.remote_kinds:
            if kind not in kinds:
                raise ConfigError(f"{key}.remote_kinds: {kind!r} is not one of {', '.join(kinds)}")
        if self.remote_kinds and self.auth == "secret" and self.secret is None:
            raise ConfigError(
                f"{key}.remote_kinds={self.remote_kinds} with {key}.auth='secret' needs a "
                f"{key}.secret that the remote workers are given ($AREAL_SECRET); or use "
                f"{key}.auth=curve"
            )

    @property
    def uses_curve(self) -> bool:
        """The resolved `auth`: CurveZMQ unless 'secret', or 'auto' on a loopback-only run."""
        if self.auth != "auto":
            return self.auth == "curve"
        return bool(self.remote_kinds) or not is_loopback(self.host)


@dataclass(kw_only=True)
class RayResources:
    """What Ray reserves for one worker of a kind: one placement-group bundle, on one node."""

    num_cpus: float = opt(1.0, "logical CPUs reserved per worker")
    num_gpus: float = opt(
        0.0,
        "GPUs per worker; a rollout server's GPUs are one bundle, so "
        "they are always on one node (vLLM: rollout.vllm.tensor_parallel_size)",
    )
    memory_gb: float = opt(0.0, "memory reserved per worker (GiB); 0: none reserved")
    resources: dict[str, float] = opt({}, "custom Ray resources per worker, e.g. {gpu_node: 1}")

    def check(self, key: str) -> None:
        _non_negative(self.num_cpus, f"{key}.num_cpus")
        _non_negative(self.num_gpus, f"{key}.num_gpus")
        _non_negative(self.memory_gb, f"{key}.memory_gb")
        for name, amount in self.resources.items():
            _non_negative(amount, f"{key}.resources.{name}")
        if not self.bundle():
            raise ConfigError(
                f"{key} reserves nothing (num_cpus, num_gpus, memory_gb and "
                "resources all 0): Ray places only bundles that hold something"
            )

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one worker (Ray's resource names)."""
        bundle = {
            "CPU": self.num_cpus,
            "GPU": self.num_gpus,
            "memory": self.memory_gb * 2**30,
            **self.resources,
        }
        return {name: amount for name, amount in bundle.items() if amount > 0}


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(kw_only=True)
class RayConfig:
    """launcher=ray: every worker is a Ray actor in a placement group (controller/launch)."""

    address: str | None = opt(
        None,
        "Ray cluster to join: 'auto' (the one `ray start` made "
        "on this node, or $RAY_ADDRESS), 'HOST:PORT', or null to start "
        "a Ray instance on this machine",
    )
    namespace: str = opt("areal", "Ray namespace of the run's actors")
    rollout: RayResources = opt(RayResources(), "per rollout worker")
    reward: RayResources = opt(RayResources(), "per reward worker")
    trainer: RayResources = opt(RayResources(), "per trainer rank")
    trainer_strategy: str = opt(
        "PACK",
        "placement of the trainer ranks' bundles (one placement "
        "group, reserved all at once): PACK on as few nodes as "
        "possible, SPREAD over nodes, STRICT_*: must",
        PLACEMENT_STRATEGIES,
    )
    placement_timeout_s: float = opt(
        120.0,
        "how long a placement may wait for resources; then "
        "the run fails naming the resources missing (at the "
        "start), or the worker counts as failed (a replacement)",
    )
    max_failures_per_node: int = opt(
        2,
        "a worker that failed this many times on one node is "
        "started elsewhere from then on (a node lost is not a "
        "failure of the worker)",
    )
    network_interface: str | None = opt(
        None,
        "interface of the network the nodes share, "
        "e.g. eth0: the controller binds its address, and "
        "workers' gloo/NCCL use it (GLOO_/NCCL_SOCKET_IFNAME); "
        "null: Ray's node address, and gloo/NCCL pick the "
        "interface that routes to the controller",
    )
    env_vars: dict[str, str] = opt(
        {},
        "environment of every worker (Ray runtime environment), "
        "e.g. {PYTHONPATH: /shared/tasks}; never credentials: the "
        "runtime environment is shown on Ray's dashboard",
    )

    def check(self, key: str) -> None:
        for kind in ("rollout", "reward", "trainer"):
            getattr(self, kind).check(f"{key}.{kind}")
        _positive(self.placement_timeout_s, f"{key}.placement_timeout_s")
        _positive(self.max_failures_per_node, f"{key}.max_failures_per_node")
        for name in self.env_vars:
            if name.startswith("AREAL_"):
                raise ConfigError(
                    f"{key}.env_vars.{name}: AREAL_* variables are set by the "
                    "launcher (credentials, parent, log level); remove it"
                )


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or '*': assume reachable from elsewhere


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs; the controller sends it to every worker that joins."""

    launcher: str = opt(
        "local",
        "where the controller starts its workers: 'local' child "
        "processes, or 'ray' actors on a Ray cluster (the ray.* options; "
        "pip install -e '.[ray]')",
        ["local", "ray"],
    )
    worker_start: str = opt(
        "auto",
        "how launcher=local starts a worker: 'preload' forks it from a "
        "server process that has imported torch, transformers and the "
        "workers' code once (seconds of CPU less per worker); 'exec' runs "
        "a fresh `python -m areal.workers.<kind>`; 'auto': preload unless "
        "a worker is placed on a CUDA device (CUDA must not be touched "
        "before a fork)",
        ["auto", "preload", "exec"],
    )
    mode: str = opt(
        "async",
        "async: generation and training overlap (bounded by "
        "staleness.eta); sync: generate a whole batch, then train",
        ["async", "sync"],
    )
    seed: int = opt(1, "seed of data order, sampling and initialisation")
    run_dir: str | None = opt(None, "output directory; null: runs/<timestamp>")
    cache_dir: str = opt(
        "~/.cache/areal",
        "where the warm-started embedded model is kept, and "
        "which tokenizer class a model directory needs (areal.models.tokenizer)",
    )
    model: ModelConfig = opt(ModelConfig(), "policy model")
    task: TaskConfig = opt(TaskConfig(), "prompts, references and reward")
    episode: EpisodeConfig = opt(EpisodeConfig(), "multi-turn episodes with tools")
    agent: AgentConfig = opt(AgentConfig(), "your own agent through an OpenAI-compatible endpoint")
    rollout: RolloutConfig = opt(RolloutConfig(), "generation")
    trainer: TrainerConfig = opt(TrainerConfig(), "optimisation")
    reward: RewardConfig = opt(RewardConfig(), "reward workers")
    staleness: StalenessConfig = opt(StalenessConfig(), "off-policyness bound")
    weight_sync: WeightSyncConfig = opt(WeightSyncConfig(), "weight publishing")
    eval: EvalConfig = opt(EvalConfig(), "held-out evaluation")
    logging: LoggingConfig = opt(LoggingConfig(), "console, JSONL, TensorBoard, W&B")
    controller: ControllerConfig = opt(ControllerConfig(), "controller socket and liveness")
    ray: RayConfig = opt(RayConfig(), "Ray cluster, placement and resources (launcher=ray)")

    def check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value.check(f.name)  # type: ignore[attr-defined]  # every section has check()
        if self.trainer.advantage.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(
                f"trainer.advantage.overlong_buffer={self.trainer.advantage.overlong_buffer} "
                f"exceeds rollout.max_new_tokens={self.rollout.max_new_tokens}: the penalty "
                "zone lies within the completion budget"
            )
        if self.launcher == "ray":
            self._check_ray()
        if self.agent.function is not None and self.episode.environment is not None:
            raise ConfigError(
                f"agent.function={self.agent.function!r} and episode.environment="
                f"{self.episode.environment!r} are both set: an agent talks to its own tools "
                "through the endpoint; set episode.environment=null"
            )
        if self.weight_sync.mode == "shm":
            self._check_shm()
        if self.trainer.batch_size % self.task.group_size:
            raise ConfigError(
                f"trainer.batch_size={self.trainer.batch_size} is not a multiple of "
                f"task.group_size={self.task.group_size}: a batch holds whole prompt groups"
            )

    def run_path(self) -> Path:
        """`run_dir`, once it is set: the controller's set-up picks it (runs/<timestamp>
        when null) before any worker is welcomed."""
        if self.run_dir is None:
            raise ConfigError("run_dir is null: the controller's set-up names the run directory")
        return Path(self.run_dir)

    def heartbeat_interval(self) -> float:
        """`controller.heartbeat_interval_s`, or when null: 1 s, or one Heartbeat from each
        worker every (workers / HEARTBEATS_PER_S) s once there are more than
        HEARTBEATS_PER_S of them, and at most a third of the timeout (what the check
        requires of a set interval). Loss is declared after the timeout either way; a
        longer interval only makes the liveness loop, which finds lost workers (an exited
        local process among them) and retries failed weight loads, look less often."""
        controller = self.controller
        if controller.heartbeat_interval_s is not None:
            return controller.heartbeat_interval_s
        workers = self.rollout.num_workers + self.reward.num_workers + self.trainer.num_ranks
        return min(max(1.0, workers / HEARTBEATS_PER_S), controller.heartbeat_timeout_s / 3)

    def _check_ray(self) -> None:
        tp = self.rollout.vllm.tensor_parallel_size
        gpus = self.ray.rollout.num_gpus
        if self.rollout.engine == "vllm" and gpus and gpus != tp:
            raise ConfigError(
                f"ray.rollout.num_gpus={gpus} but rollout.vllm.tensor_parallel_size={tp}: a "
                "rollout server needs one GPU per tensor-parallel rank, all on one node; set "
                f"ray.rollout.num_gpus={tp}"
            )
        for key in ("rollout", "trainer"):
            if getattr(self, key).cpus:
                raise ConfigError(
                    f"{key}.cpus names this machine's cores; with launcher=ray, "
                    f"Ray assigns them (ray.{key}.num_cpus): remove it"
                )
            for device in getattr(self, key).devices:
                if device not in ("cpu", "cuda:0"):
                    raise ConfigError(
                        f"{key}.devices: {device!r} with launcher=ray; a worker sees only the "
                        f"GPUs Ray gave it (ray.{key}.num_gpus), the first as cuda:0: use "
                        "cuda:0 or cpu, or leave it empty (filled from the resources)"
                    )

    def _check_shm(self) -> None:
        remote = [k for k in self.controller.remote_kinds if k in ("rollout", "trainer")]
        if remote:
            raise ConfigError(
                f"weight_sync.mode='shm' shares memory on one host, but "
                f"controller.remote_kinds={self.controller.remote_kinds} has {remote[0]} "
                "workers join from elsewhere; use 'disk', 'stream' or 'collective'"
            )
        if self.launcher != "local":
            raise ConfigError(
                f"weight_sync.mode='shm' shares memory on one host, but launcher="
                f"{self.launcher!r} may place workers on other nodes; use 'disk', 'stream' "
                "or 'collective'"
            )

    @property
    def eta(self) -> int:
        """The staleness bound in force: 0 in sync mode, else `staleness.eta`."""
        return 0 if self.mode == "sync" else self.staleness.eta


def _check_choices(cfg: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(cfg):
        key = f"{prefix}{f.name}"
        value = getattr(cfg, f.name)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{key}.")


def _to_config(node: Any) -> RunConfig:
    cfg = OmegaConf.to_object(node)
    assert isinstance(cfg, RunConfig)
    _check_choices(cfg)
    cfg.check()
    return cfg


def _wrap(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    first_line = str(err).splitlines()[0]
    if first_line.startswith("Key ") and "not in" in first_line:
        first_line = f"unknown field ({first_line}); run with --help for the list of options"
    return ConfigError(f"{source}: config key {key!r}: {first_line}")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults, then the YAML file at `path`, then `key=value` overrides; validated."""
    node = OmegaConf.structured(RunConfig)
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read config file {str(path)!r}: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        try:
            node = OmegaConf.merge(node, OmegaConf.create(loaded or {}))
        except OmegaConfBaseException as err:
            raise _wrap(err, str(path)) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} is not of the form key=value (e.g. trainer.lr=1e-5)"
            )
        try:
            node = OmegaConf.merge(node, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            raise _wrap(err, f"override {item!r}") from None
    try:
        return _to_config(node)
    except OmegaConfBaseException as err:
        raise _wrap(err, "config") from None


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of `cfg` (YAML- and msgpack-friendly), secret fields set to None."""
    return _redact(cfg, dataclasses.asdict(cfg))


def _redact(cfg: Any, data: dict[str, Any]) -> dict[str, Any]:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("secret"):
            data[f.name] = None
        elif dataclasses.is_dataclass(value):
            _redact(value, data[f.name])
    return data


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild and validate a config sent over the wire or read from a run directory."""
    try:
        return _to_config(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(data)))
    except OmegaConfBaseException as err:
        raise _wrap(err, "config") from None


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def describe_options(cls: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf option, in declaration order."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from describe_options(type(default), f"{key}.")
            continue
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            help_text = f"{help_text} [{'|'.join(choices)}]"
        yield (
            key,
            yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n..."),
            help_text,
        )
