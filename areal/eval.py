"""`python -m areal.eval --model DIR [--config FILE] [key=value ...]`: held-out pass@k of a
saved checkpoint, standalone (no controller, no worker processes).

    python -m areal.eval --model runs/x/final_model --config runs/x/config.yaml \\
        --num-samples 8 --temperature 0.6 --k 1,8 --run-dir runs/x

The run config (file, then key=value overrides, then the flags here) names the task and its
held-out split (`task.params.eval_path`, ...), the engine (`rollout.engine`: the built-in
torch engine by default, vLLM when configured; `rollout.max_new_tokens`, devices, ...) and
the sampling (`eval.temperature`, `eval.num_samples`, `eval.max_prompts`). Every held-out
prompt is sampled `num_samples` times in this process with the project's engine
(`areal.workers.rollout.factory.make_engine`) and scored with the task's reward in a
`CheckerPool` (bounded threads, `reward.timeout_s`), as the reward workers do. pass@k uses
the unbiased estimator (`areal.evaluation`). The result is printed as a table and appended
as one `kind: eval` record (`source: areal.eval`) to `<run-dir>/metrics.jsonl` or to
`--output`; `--save-samples` writes every completion with its verdict.

This is a command-line tool: it imports the engines and the sandbox, which the core
library (`areal.*` outside this module) never does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from areal.config import ConfigError, RunConfig, load_config
from areal.evaluation import pass_at_k, summarize
from areal.seeds import eval_sample_seed
from areal.tasks.base import Verdict

log = logging.getLogger("areal.eval")


@dataclass(kw_only=True)
class Sample:
    prompt_id: str
    completion: str
    num_tokens: int
    finish_reason: str
    reward: float = 0.0
    verdict: Verdict = Verdict.ERROR
    detail: str = ""
    episode: dict[str, Any] = field(default_factory=dict)
    """Episodes only: 'turns', 'tool_calls', 'tool_errors', 'end'."""


@dataclass(kw_only=True)
class EvalResult:
    record: dict[str, Any]
    """The metrics record (as appended to metrics.jsonl)."""
    samples: list[list[Sample]] = field(default_factory=list)
    """[problem][sample]."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal.eval",
        description="pass@1 and pass@k of a saved checkpoint on the task's held-out split.",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="Hugging Face model directory, e.g. <run_dir>/final_model",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="run config YAML (e.g. <run_dir>/config.yaml or examples/*.yaml)",
    )
    parser.add_argument("--num-samples", type=int, help="samples per prompt (eval.num_samples)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (eval.temperature)")
    parser.add_argument("--max-prompts", type=int, help="evaluate the first N held-out prompts")
    parser.add_argument(
        "--k",
        default="",
        metavar="K,K",
        help="pass@k values to report besides 1, 2, 4, ... (each <= num-samples)",
    )
    parser.add_argument("--run-dir", metavar="DIR", help="append the result to DIR/metrics.jsonl")
    parser.add_argument("--output", metavar="FILE", help="append the result to this JSONL file")
    parser.add_argument(
        "--step",
        type=int,
        help="training step to file the result under "
        "(default: the run's final version when --model is <run-dir>/final_model)",
    )
    parser.add_argument(
        "--save-samples", metavar="FILE", help="write every completion, verdict and reward as JSONL"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides (e.g. task.params.eval_path=test.jsonl)",
    )
    return parser.parse_intermixed_args(argv)


def build_config(args: argparse.Namespace) -> RunConfig:
    flags = [f"model.path={args.model}"]
    for key, value in (
        ("eval.num_samples", args.num_samples),
        ("eval.temperature", args.temperature),
        ("eval.max_prompts", args.max_prompts),
    ):
        if value is not None:
            flags.append(f"{key}={value}")
    return load_config(args.config, [*args.overrides, *flags])


def requested_ks(text: str, num_samples: int) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise ConfigError(f"--k={text!r} must be comma-separated integers, e.g. 1,8") from None
    bad = [k for k in ks if not 1 <= k <= num_samples]
    if bad:
        raise ConfigError(
            f"--k={text!r}: k={bad[0]} is outside [1, num_samples={num_samples}]; "
            "raise --num-samples"
        )
    return ks


# ---- running ------------------------------------------------------------------------------


def load_prompts(cfg: RunConfig) -> tuple[Any, Any, list[tuple[Any, list[int]]], list[int]]:
    """(task, tokenizer, [(prompt, token ids)], stop token ids): the controller's setup."""
    from areal.controller.setup import episode_environment, stop_token_ids
    from areal.models.tokenizer import load_tokenizer
    from areal.tasks import load_task

    task = load_task(cfg.task.name, cfg.task.params)
    tokenizer = load_tokenizer(
        cfg.model.tokenizer_dir(),
        trust_remote_code=cfg.model.trust_remote_code,
        cache_dir=cfg.cache_dir,
    )
    if hasattr(task, "use_tokenizer"):
        task.use_tokenizer(tokenizer)
    environment = episode_environment(cfg, task, tokenizer)  # its tools reach the prompts
    prompts = task.eval_prompts()[: cfg.eval.max_prompts]
    if not prompts:
        raise ValueError(f"task {task.name!r} has no held-out prompts")
    tokenized = []
    for prompt in prompts:
        ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {prompt.prompt_id!r} tokenizes to nothing")
        tokenized.append((prompt, ids))
    return task, tokenizer, tokenized, stop_token_ids(task, tokenizer, environment)


async def sample_and_score(
    cfg: RunConfig,
    task: Any,
    tokenizer: Any,
    prompts: list[tuple[Any, list[int]]],
    stop_ids: list[int],
) -> list[list[Sample]]:
    """Every prompt `eval.num_samples` times through the engine, each completion scored."""
    from areal.sandbox.pool import CheckerPool
    from areal.workers.rollout.engine import SamplingParams
    from areal.workers.rollout.episode import start_episodes
    from areal.workers.rollout.factory import make_engine
    from areal.workers.rollout.interruptible import InterruptibleGenerator

    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature,
        top_p=1.0,
        stop_token_ids=stop_ids,
    )
    engine = await make_engine(cfg)
    episodes = await start_episodes(cfg, InterruptibleGenerator(engine))
    pool = CheckerPool(max_concurrency=cfg.reward.max_concurrency, timeout_s=cfg.reward.timeout_s)
    slots = asyncio.Semaphore(cfg.rollout.max_concurrent)

    async def one(prompt: Any, ids: list[int], index: int) -> Sample:
        # The stream the controller's evaluations give this sample (areal.seeds): a saved
        # version evaluated here samples what an in-run evaluation of it sampled.
        sample_params = dataclasses.replace(
            params, seed=eval_sample_seed(cfg.seed, prompt.prompt_id, index)
        )
        if episodes is not None:
            async with slots:
                episode = await episodes.run(
                    f"{prompt.prompt_id}/{index}",
                    ids,
                    sample_params,
                    prompt_id=prompt.prompt_id,
                    reference=prompt.reference,
                )
            return episode_sample(prompt.prompt_id, episode, tokenizer)
        async with slots:
            out = await engine.generate(f"{prompt.prompt_id}/{index}", ids, sample_params)
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        outcome = await pool.check(task.reward, text, prompt.reference)
        return Sample(
            prompt_id=prompt.prompt_id,
            completion=text,
            num_tokens=len(out.token_ids),
            finish_reason=out.finish_reason.value,
            reward=float(outcome.reward),
            verdict=outcome.verdict,
            detail=outcome.detail,
        )

    try:
        n = cfg.eval.num_samples
        flat = await asyncio.gather(*(one(p, ids, j) for p, ids in prompts for j in range(n)))
    finally:
        if episodes is not None:
            await episodes.close()
        await engine.close()
        pool.close()
    return [list(flat[i * n : (i + 1) * n]) for i in range(len(prompts))]


def episode_sample(prompt_id: str, episode: Any, tokenizer: Any) -> Sample:
    """A finished episode (its whole text after the prompt, observations included) and the
    reward its environment gave."""
    text = tokenizer.decode(episode.token_ids, skip_special_tokens=True)
    return Sample(
        prompt_id=prompt_id,
        completion=text,
        num_tokens=len(episode.token_ids),
        finish_reason=episode.finish_reason.value,
        reward=float(episode.outcome.reward),
        verdict=episode.outcome.verdict,
        detail=episode.outcome.detail,
        episode={
            "turns": episode.num_turns,
            "tool_calls": episode.num_tool_calls,
            "tool_errors": episode.num_tool_errors,
            "end": episode.end.value,
        },
    )


def make_record(
    cfg: RunConfig, samples: list[list[Sample]], ks: list[int], seconds: float, step: int | None
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "source": "areal.eval",
        "model": cfg.model.path,
        "task": cfg.task.name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "temperature": cfg.eval.temperature,
        "max_new_tokens": cfg.rollout.max_new_tokens,
    }
    if step is not None:
        record["version"] = step
    record.update(
        summarize(
            [[s.verdict for s in group] for group in samples],
            [[s.reward for s in group] for group in samples],
        )
    )
    for k in ks:
        scores = [pass_at_k(len(g), sum(s.verdict is Verdict.OK for s in g), k) for g in samples]
        record[f"eval/pass@{k}"] = sum(scores) / len(scores)
    flat = [s for group in samples for s in group]
    record["eval/completion_len_mean"] = sum(s.num_tokens for s in flat) / len(flat)
    record["eval/truncated_fraction"] = sum(s.finish_reason == "length" for s in flat) / len(flat)
    verdicts: dict[str, int] = {}
    for s in flat:
        verdicts[s.verdict.value] = verdicts.get(s.verdict.value, 0) + 1
    record["eval/verdicts"] = dict(sorted(verdicts.items()))
    episodes = [s.episode for s in flat if s.episode]
    if episodes:
        record["eval/turns_mean"] = sum(e["turns"] for e in episodes) / len(episodes)
        record["eval/tool_calls_mean"] = sum(e["tool_calls"] for e in episodes) / len(episodes)
        record["eval/tool_use_fraction"] = sum(e["tool_calls"] > 0 for e in episodes) / len(
            episodes
        )
        record["eval/tool_errors"] = sum(e["tool_errors"] for e in episodes)
    record["eval/seconds"] = seconds
    return record


def evaluate(cfg: RunConfig, ks: Sequence[int] = (), step: int | None = None) -> EvalResult:
    """Sample and score the held-out prompts of `cfg` with `cfg.model.path`; blocking."""
    import torch

    torch.set_num_threads(cfg.rollout.threads)
    start = time.monotonic()
    task, tokenizer, prompts, stop_ids = load_prompts(cfg)
    if cfg.eval.temperature == 0 and cfg.eval.num_samples > 1:
        log.warning(
            "eval.temperature=0 (greedy) with %d samples per prompt: the samples are "
            "alike, so pass@k for k > 1 says little; set --temperature",
            cfg.eval.num_samples,
        )
    samples = asyncio.run(sample_and_score(cfg, task, tokenizer, prompts, stop_ids))
    return EvalResult(
        record=make_record(cfg, samples, list(ks), time.monotonic() - start, step), samples=samples
    )


# ---- reporting ----------------------------------------------------------------------------


def format_table(record: dict[str, Any]) -> str:
    """The scalar results as an aligned two-column table."""
    rows = [
        ("model", str(record["model"])),
        ("task", str(record["task"])),
        ("temperature", f"{record['temperature']:g}"),
    ]
    pass_keys = sorted(
        (k for k in record if k.startswith("eval/pass@")), key=lambda k: int(k.rsplit("@", 1)[1])
    )
    for key in [
        *pass_keys,
        "eval/reward_mean",
        "eval/unjudged_fraction",
        "eval/completion_len_mean",
        "eval/truncated_fraction",
    ]:
        rows.append((key.removeprefix("eval/"), f"{record[key]:.4f}"))
    rows += [
        ("problems", f"{int(record['eval/num_problems'])}"),
        ("samples/problem", f"{int(record['eval/num_samples'])}"),
        ("verdicts", ", ".join(f"{k} {v}" for k, v in record["eval/verdicts"].items())),
        ("seconds", f"{record['eval/seconds']:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    return "\n".join([rule, *(f"{name:<{width}}  {value}" for name, value in rows), rule])


def default_step(args: argparse.Namespace) -> int | None:
    """--step, else the run's final version when --model is <run-dir>/final_model."""
    if args.step is not None or not args.run_dir:
        return args.step
    summary = Path(args.run_dir) / "summary.json"
    if (
        Path(args.model).resolve() == (Path(args.run_dir) / "final_model").resolve()
        and summary.is_file()
    ):
        return json.loads(summary.read_text()).get("final_version")
    return None


def append_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "kind": "eval",
                    **({"step": record["version"]} if "version" in record else {}),
                    **record,
                }
            )
            + "\n"
        )


def save_samples(path: Path, samples: list[list[Sample]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for group in samples:
            for s in group:
                f.write(
                    json.dumps(
                        {
                            "prompt_id": s.prompt_id,
                            "completion": s.completion,
                            "reward": s.reward,
                            "verdict": s.verdict.value,
                            "detail": s.detail,
                            "num_tokens": s.num_tokens,
                            "finish_reason": s.finish_reason,
                            **({"episode": s.episode} if s.episode else {}),
                        }
                    )
                    + "\n"
                )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_dir and args.output:
        print("error: give --run-dir or --output, not both", file=sys.stderr)
        return 2
    try:
        cfg = build_config(args)
        ks = requested_ks(args.k, cfg.eval.num_samples)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.logging.level,
        stream=sys.stderr,
        format="%(asctime)s eval %(levelname)s %(name)s: %(message)s",
    )
    result = evaluate(cfg, ks, default_step(args))
    print(format_table(result.record))
    out = (
        Path(args.output)
        if args.output
        else Path(args.run_dir) / "metrics.jsonl"
        if args.run_dir
        else None
    )
    if out is not None:
        append_record(out, result.record)
        print(f"appended to {out}")
    else:
        print("not saved: give --run-dir DIR or --output FILE to append the result")
    if args.save_samples:
        save_samples(Path(args.save_samples), result.samples)
        print(f"completions in {args.save_samples}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
