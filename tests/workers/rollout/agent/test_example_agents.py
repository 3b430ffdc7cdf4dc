"""The shipped agents through the endpoint: the calculator agent (examples/agent_calculator
.yaml) yields token for token the episodes of examples/tool_arithmetic.yaml, and the GPU
recipe's Python-tool agent (examples/gsm8k_qwen2.5_1.5b_agent_vllm.yaml) runs a program in
the sandbox and is scored by the GSM8K task, with a Qwen2.5-style tokenizer in place of the
model and the shipped GSM8K sample in place of the dataset."""

from __future__ import annotations

import json
from pathlib import Path

from agent_helpers import (
    ScriptedEngine,
    build_qwen_style_tokenizer,
    char_ids,
    make_runner,
    qwen_ids,
)

from areal.config import load_config
from areal.messages import EpisodeEnd
from areal.models.tiny import build_char_tokenizer
from areal.tasks import load_task
from areal.tasks.agent import load_agent
from areal.tasks.base import Verdict

REPO = Path(__file__).resolve().parents[4]


async def test_the_calculator_agent_samples_what_the_tool_episodes_do():
    tokenizer = build_char_tokenizer()
    cfg = load_config(REPO / "examples/agent_calculator.yaml")
    task = load_task(cfg.task.name, cfg.task.params)
    prompt = task.eval_prompts()[0]
    a, b = prompt.text.split("=")[0].split("*")
    call, answer = f"[{a}*{b}]", f"#{int(a) * int(b)}"
    engine = ScriptedEngine(
        [qwen_ids(tokenizer, call), qwen_ids(tokenizer, answer) + [tokenizer.eos_token_id]]
    )
    runner, params = await make_runner(
        engine, load_agent(cfg.agent.function), tokenizer=tokenizer, max_new_tokens=48
    )
    runner.task = task
    try:
        episode = await runner.run(
            "r",
            params,
            prompt_id=prompt.prompt_id,
            prompt_text=prompt.text,
            reference=prompt.reference,
        )
    finally:
        await runner.close()
    assert (episode.end, episode.outcome.verdict, episode.num_tool_calls) == (
        EpisodeEnd.AGENT,
        Verdict.OK,
        1,
    )
    (segment,) = episode.segments
    whole = tokenizer.decode(segment.prompt_ids + segment.tokens.token_ids)
    assert whole == f"{prompt.text}{call}={int(a) * int(b)}\n{answer}<|endoftext|>"


async def test_the_gpu_recipes_python_agent_runs_a_program_and_is_scored(tmp_path):
    tokenizer = build_qwen_style_tokenizer()
    tokenizer.save_pretrained(tmp_path / "qwen-style")
    cfg = load_config(
        REPO / "examples/gsm8k_qwen2.5_1.5b_agent_vllm.yaml",
        [
            f"model.path={tmp_path / 'qwen-style'}",
            f"task.params.path={REPO / 'examples/data/gsm8k_train.jsonl'}",
            f"task.params.eval_path={REPO / 'examples/data/gsm8k_test.jsonl'}",
        ],
    )
    task = load_task(cfg.task.name, cfg.task.params)
    task.use_tokenizer(tokenizer)
    prompt = task.eval_prompts()[0]
    assert "<|im_start|>" not in prompt.text and prompt.text.endswith("\\boxed{}.")
    program = json.dumps({"name": "python", "arguments": {"code": f"print({prompt.reference})"}})
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(
        [
            char_ids(tokenizer, f"<tool_call>\n{program}\n</tool_call>") + [im_end],
            qwen_ids(tokenizer, f"So it is \\boxed{{{prompt.reference}}}.") + [im_end],
        ]
    )
    agent = load_agent(cfg.agent.function, cfg.agent.params)
    runner, params = await make_runner(
        engine, agent, tokenizer=tokenizer, overrides=[f"agent.tool_format={cfg.agent.tool_format}"]
    )
    runner.task = task
    try:
        episode = await runner.run(
            "r",
            params,
            prompt_id=prompt.prompt_id,
            prompt_text=prompt.text,
            reference=prompt.reference,
        )
    finally:
        await runner.close()  # stops the agent's sandbox launcher too
    assert (episode.end, episode.outcome.verdict, episode.num_tool_calls) == (
        EpisodeEnd.AGENT,
        Verdict.OK,
        1,
    ), episode.outcome.detail
    rendered = tokenizer.decode(engine.prompts[1][len(engine.prompts[0]) :])
    assert f"<tool_response>\n{prompt.reference}\n</tool_response>" in rendered
    assert '"name": "python"' in tokenizer.decode(engine.prompts[0])  # tools in the template
