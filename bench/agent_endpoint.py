"""What the agent endpoint costs: the calculator agent through HTTP and the `openai` client
against the in-process episode loop, on the same engine, task and prompts, in one run.

    python bench/agent_endpoint.py [--episodes 256] [--concurrency 1 32] [--repeats 2]
                                   [--engine torch|vllm] [--quick] [--out DIR]

Both sides run the tool-arithmetic task with the calculator on one engine of the warm-started
embedded model (examples/agent_calculator.yaml; built once and cached, like a run's):

    in-process  EpisodeRunner + ToolEnvironment (examples/tool_arithmetic.yaml's episodes):
                a turn is one `generate` call on the generator
    endpoint    AgentRunner + areal.tasks.agents.calculator: a turn is one chat call of the
                agent over loopback HTTP, rendered, sampled and parsed by the endpoint

Decoding is greedy, so both sides sample the same tokens (checked: the model-token totals
must match) and the difference is the endpoint's own work: HTTP, JSON, rendering with the
chat template, tokenizing, parsing, the agent's client. Each concurrency runs `--episodes`
episodes at most `c` at a time, the two sides alternating `--repeats` times. Printed per
side: episodes, calls, model tokens, wall seconds, model tokens/s, per-call latency (mean,
p50, p90: a `generate` call in-process, a chat call as the agent's client sees it) and the
process's CPU time per call (the engine's included: the difference between the sides is
what the endpoint and the agent's `openai` client cost); then the ratios endpoint /
in-process. The task's greedy episodes are short (one call of ~7 tokens when the model
answers at once), so the fixed cost per call weighs more here than with long completions. Full runs write docs/results/agent_endpoint.{json,md};
`--quick` (a random tiny model, 16 episodes, concurrency 4, one repeat) checks the
pipeline and publishes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from results_page import publish, write_results  # noqa: E402

from areal.config import RunConfig, load_config  # noqa: E402
from areal.workers.rollout.engine import SamplingParams  # noqa: E402
from areal.workers.rollout.interruptible import InterruptibleGenerator  # noqa: E402

CONFIG = REPO / "examples" / "agent_calculator.yaml"


class TimedGenerator(InterruptibleGenerator):
    """Records the seconds of each `generate` call (the in-process loop's turns)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.call_s: list[float] = []

    async def generate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return await super().generate(*args, **kwargs)
        finally:
            self.call_s.append(time.perf_counter() - start)


class _TimedCompletions:
    def __init__(self, completions: Any, call_s: list[float]) -> None:
        self._completions, self._call_s = completions, call_s

    async def create(self, **kwargs):
        start = time.perf_counter()
        try:
            return await self._completions.create(**kwargs)
        finally:
            self._call_s.append(time.perf_counter() - start)


class TimedClient:
    """An OpenAI client whose chat calls are timed as the agent sees them."""

    def __init__(self, client: Any, call_s: list[float]) -> None:
        self.chat = type(
            "Chat", (), {"completions": _TimedCompletions(client.chat.completions, call_s)}
        )()


def build_config(args: argparse.Namespace) -> RunConfig:
    cfg = load_config(
        CONFIG, [f"rollout.engine={args.engine}", "rollout.max_concurrent=256", *args.overrides]
    )
    if args.quick:
        from areal.models.tiny import save_tiny_model

        path = save_tiny_model(Path(tempfile.mkdtemp(prefix="agent-bench-")), seed=0)
    else:
        from areal.models.warmstart import ensure_warm_model

        path = ensure_warm_model(cfg)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path)))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from areal.models.tokenizer import load_tokenizer
    from areal.tasks import load_task
    from areal.tasks.tool_env import ToolEnvironment
    from areal.tasks.agents import calculator
    from areal.workers.rollout.agent.runner import start_agents
    from areal.workers.rollout.episode import EpisodeLimits, EpisodeRunner
    from areal.workers.rollout.factory import make_engine

    cfg = build_config(args)
    engine = await make_engine(cfg)
    generator = TimedGenerator(engine)
    tokenizer = load_tokenizer(cfg.model.path, cache_dir=cfg.cache_dir)
    task = load_task(cfg.task.name, cfg.task.params)
    environment = ToolEnvironment(
        task=task, tokenizer=tokenizer, tools=["calculator"], format="bracket"
    )
    episodes = EpisodeRunner(
        generator, environment, tokenizer, EpisodeLimits(max_turns=cfg.agent.max_calls)
    )
    agent_calls: list[float] = []

    async def timed_agent(client, sample):
        return await calculator.run(TimedClient(client, agent_calls), sample)

    agents = await start_agents(
        cfg, generator, rank=0, context_len=getattr(engine, "max_seq_len", None)
    )
    agents.agent = timed_agent
    prompts = task.eval_prompts()[: args.episodes]
    ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    eos = [tokenizer.eos_token_id]
    bracket = tokenizer("]", add_special_tokens=False)["input_ids"]
    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, stop_token_ids=eos + bracket
    )
    agent_params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, stop_token_ids=eos
    )

    async def in_process(i: int) -> int:
        result = await episodes.run(
            f"e{i}", ids[i], params, prompt_id=prompts[i].prompt_id, reference=prompts[i].reference
        )
        return sum(result.loss_mask)

    async def endpoint(i: int) -> int:
        result = await agents.run(
            f"a{i}",
            agent_params,
            prompt_id=prompts[i].prompt_id,
            prompt_text=prompts[i].text,
            reference=prompts[i].reference,
        )
        return result.num_model_tokens

    rows: list[dict[str, Any]] = []
    try:
        await environment.start()
        await in_process(0)  # warm both paths up (engine session, HTTP connections)
        await endpoint(0)
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                for side, run, calls in (
                    ("in-process", in_process, generator.call_s),
                    ("endpoint", endpoint, agent_calls),
                ):
                    calls.clear()
                    rows.append(
                        {
                            "concurrency": concurrency,
                            "repeat": repeat,
                            "side": side,
                            **await timed(run, len(prompts), concurrency, calls),
                        }
                    )
    finally:
        await agents.close()
        await episodes.close()
        await engine.close()
    return {"rows": rows, "engine": args.engine, "episodes": len(prompts)}


async def timed(run, num: int, concurrency: int, calls: list[float]) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            return await run(i)

    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(num))))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    ordered = sorted(calls)
    return {
        "episodes": num,
        "calls": len(calls),
        "model_tokens": tokens,
        "wall_s": wall,
        "cpu_ms_per_call": 1000 * cpu / len(calls),
        "tokens_per_s": tokens / wall,
        "call_ms_mean": 1000 * statistics.fmean(calls),
        "call_ms_p50": 1000 * ordered[len(ordered) // 2],
        "call_ms_p90": 1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def summarize(data: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The table: per concurrency and side, means over repeats; then the ratios."""
    keys = (
        "calls",
        "model_tokens",
        "wall_s",
        "tokens_per_s",
        "call_ms_mean",
        "call_ms_p50",
        "call_ms_p90",
        "cpu_ms_per_call",
    )
    head = (
        f"{'conc':>4} {'side':>10} {'episodes':>8} {'calls':>6} {'model tok':>9} "
        f"{'wall s':>7} {'tok/s':>7} {'call ms mean':>12} {'p50':>7} {'p90':>7} "
        f"{'CPU ms/call':>11}"
    )
    lines, ratios = [head, "-" * len(head)], []
    for concurrency in sorted({r["concurrency"] for r in data["rows"]}):
        mean = {}
        for side in ("in-process", "endpoint"):
            rows = [
                r for r in data["rows"] if r["concurrency"] == concurrency and r["side"] == side
            ]
            mean[side] = {k: statistics.fmean(r[k] for r in rows) for k in keys}
            m = mean[side]
            lines.append(
                f"{concurrency:>4} {side:>10} {data['episodes']:>8} {m['calls']:>6.0f} "
                f"{m['model_tokens']:>9.0f} {m['wall_s']:>7.2f} "
                f"{m['tokens_per_s']:>7.0f} {m['call_ms_mean']:>12.1f} "
                f"{m['call_ms_p50']:>7.1f} {m['call_ms_p90']:>7.1f} "
                f"{m['cpu_ms_per_call']:>11.1f}"
            )
        a, b = mean["endpoint"], mean["in-process"]
        ratio = {
            "concurrency": concurrency,
            "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
            "call_ms_mean": a["call_ms_mean"] / b["call_ms_mean"],
            "cpu_ms_per_call_added": a["cpu_ms_per_call"] - b["cpu_ms_per_call"],
            "same_tokens": a["model_tokens"] == b["model_tokens"],
        }
        ratios.append(ratio)
    lines.append("")
    for r in ratios:
        lines.append(
            f"concurrency {r['concurrency']}: endpoint / in-process tokens/s "
            f"{r['tokens_per_s']:.2f}x, per-call latency {r['call_ms_mean']:.2f}x; "
            f"+{r['cpu_ms_per_call_added']:.1f} ms of process CPU per call"
            + ("" if r["same_tokens"] else "  (model tokens differ between sides!)")
        )
    return "\n".join(lines), ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write results.json there instead of publishing the page",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.concurrency, args.repeats = 16, [4], 1
    data = asyncio.run(measure(args))
    table, ratios = summarize(data)
    print(table)
    data["ratios"] = ratios
    if args.out is not None:
        import json

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(data, indent=1))
    if publish(args.quick, args.out):
        path = write_results(
            "agent_endpoint",
            title="Agent endpoint overhead",
            command=" ".join(sys.argv),
            table=table,
            data=data,
            notes="Greedy decoding on both sides, so both sample the same tokens; the "
            "difference is the endpoint's own work (HTTP, JSON, chat template, "
            "tokenizing, parsing, the agent's client) on the rollout worker's event "
            "loop and tokenizer thread.",
        )
        print(f"results page: {path}")


if __name__ == "__main__":
    main()
