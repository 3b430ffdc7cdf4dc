"""ToolEnvironment: a turn with tool calls gets their results, a turn without is scored; a
malformed call, an unknown tool or a failing program is an observation that says so. Also
the environment loader's errors and the tool_arithmetic task's warm-start episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qwen_style import IM_END, build_qwen_style_tokenizer

from areal.models.tiny import build_char_tokenizer
from areal.tasks import load_task
from areal.tasks.base import RewardOutcome, Verdict
from areal.tasks.environment import (
    Environment,
    Episode,
    Observation,
    SFTEpisode,
    Turn,
    TurnRole,
    load_environment,
)
from areal.tasks.tool_env import ToolEnvironment


def _episode(
    text: str, *, tokenizer, stopped: bool = True, max_turns: int = 3, reference=17834
) -> Episode:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    turn = Turn(
        role=TurnRole.MODEL,
        text=tokenizer.decode(ids, skip_special_tokens=True),
        token_ids=ids,
        stopped=stopped,
    )
    return Episode(
        prompt_id="p", prompt="482*37=?\n", reference=reference, turns=[turn], max_turns=max_turns
    )


def _bracket_env(**params) -> ToolEnvironment:
    tokenizer = build_char_tokenizer()
    return load_environment(
        "tools",
        {"format": "bracket", **params},
        task=load_task("tool_arithmetic"),
        tokenizer=tokenizer,
    )


async def test_bracket_call_gets_the_result_and_an_answer_gets_the_reward():
    env = _bracket_env()
    assert env.stop_strings() == ["]"] and env.tools() == []
    tokenizer = env.tokenizer
    observation = await env.step(_episode("[482*37]", tokenizer=tokenizer))
    assert observation == Observation(text="=17834\n", num_tool_calls=1, num_tool_errors=0)
    answer = await env.step(_episode("#17834<|endoftext|>", tokenizer=tokenizer))
    assert answer == RewardOutcome(reward=1.0, verdict=Verdict.OK)
    wrong = await env.step(_episode("#17835", tokenizer=tokenizer))
    assert wrong.verdict is Verdict.WRONG and wrong.reward == 0.0


async def test_a_bad_call_is_an_observation_and_a_cut_turn_is_scored_as_it_is():
    env = _bracket_env()
    observation = await env.step(_episode("[482*]", tokenizer=env.tokenizer))
    assert observation.num_tool_errors == 1
    assert observation.text.startswith("=error: not an arithmetic expression")
    # A turn cut by its token budget holds no call, even if it looks like one: it is scored.
    cut = await env.step(_episode("[482*37]", tokenizer=env.tokenizer, stopped=False))
    assert cut.verdict is Verdict.NO_ANSWER


async def test_on_the_last_turn_calls_are_not_run():
    env = _bracket_env()
    episode = _episode("[482*37]", tokenizer=env.tokenizer, max_turns=1)
    assert await env.step(episode) == Observation(text="")


async def test_chat_calls_run_and_errors_are_reported_per_call():
    tokenizer = build_qwen_style_tokenizer()
    env = load_environment(
        "tools", {"tools": ["calculator"]}, task=load_task("tool_arithmetic"), tokenizer=tokenizer
    )
    assert env.format == "chat" and env.stop_strings() == []
    assert [t["function"]["name"] for t in env.tools()] == ["calculator"]
    calls = "".join(
        f"<tool_call>{json.dumps(c)}</tool_call>"
        for c in (
            {"name": "calculator", "arguments": {"expression": "482*37"}},
            {"name": "search", "arguments": {"query": "x"}},
            {"name": "calculator", "arguments": {"expression": "1/0"}},
        )
    )
    observation = await env.step(_episode(calls + IM_END, tokenizer=tokenizer))
    assert (observation.num_tool_calls, observation.num_tool_errors) == (3, 2)
    assert observation.text == (
        "\n<|im_start|>user\n<tool_response>\n17834\n</tool_response>\n<tool_response>\n"
        "error: unknown tool 'search'; the tools are calculator\n</tool_response>\n"
        "<tool_response>\nerror: division by zero\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_calls_beyond_the_limit_per_turn_are_refused():
    tokenizer = build_qwen_style_tokenizer()
    env = load_environment(
        "tools", {"max_calls_per_turn": 1}, task=load_task("tool_arithmetic"), tokenizer=tokenizer
    )
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    observation = await env.step(_episode(call * 2 + IM_END, tokenizer=tokenizer))
    assert observation.num_tool_errors == 1 and "at most 1 tool calls per turn" in observation.text


@pytest.mark.slow
async def test_a_failing_program_is_an_observation_with_its_error():
    env = _bracket_env(
        tools=["python"],
        tool_options={"python": {"timeout_s": 1.0}},
        observation_template="<{result}>",
    )
    await env.start()
    try:
        crashed = await env.step(_episode("[raise ValueError('no')]", tokenizer=env.tokenizer))
        assert crashed.num_tool_errors == 1 and "ValueError: no" in crashed.text
        assert crashed.text.endswith("status: runtime_error (exit status 1)>")
        fine = await env.step(_episode("[print(6*7)]", tokenizer=env.tokenizer))
        assert fine == Observation(text="<42>", num_tool_calls=1, num_tool_errors=0)
    finally:
        await env.close()


@pytest.mark.parametrize(
    "params, error",
    [
        ({"tools": []}, "must name one or more distinct tools"),
        ({"tools": ["calculator"], "tool_options": {"python": {}}}, "names tools not in"),
        ({"format": "xml"}, "format='xml' is not one of auto, chat, bracket"),
        ({"format": "chat"}, "the tokenizer has no chat template"),
        ({"observation_template": "="}, "has no {result}"),
        ({"max_calls_per_turn": 0}, "max_calls_per_turn=0 must be >= 1"),
        ({"retries": 2}, "episode.params for 'tools' do not fit ToolEnvironment"),
    ],
)
def test_bad_params_are_refused_with_the_field(params, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        load_environment(
            "tools", params, task=load_task("tool_arithmetic"), tokenizer=build_char_tokenizer()
        )


def test_an_environment_path_must_name_an_environment_class():
    task, tokenizer = load_task("tool_arithmetic"), build_char_tokenizer()
    with pytest.raises(ValueError, match="neither a built-in environment"):
        load_environment("calculator", {}, task=task, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_environment("no_such_module:Env", {}, task=task, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="is not a subclass of .*Environment"):
        load_environment("areal.tasks.tools:Calculator", {}, task=task, tokenizer=tokenizer)
    assert issubclass(
        type(load_environment("tools", {}, task=task, tokenizer=tokenizer)), Environment
    )


async def test_warm_start_episodes_show_what_the_environment_answers():
    task = load_task("tool_arithmetic", {"sft_direct_fraction": 0.5})
    env = _bracket_env()
    examples = task.sft_examples(0, 200)
    assert all(isinstance(e, SFTEpisode) for e in examples)
    with_tool = [e for e in examples if len(e.segments) == 3]
    assert 60 < len(with_tool) < 140  # about half
    held_out = {p.text for p in task.eval_prompts()}
    for example in with_tool[:20]:
        (call, _), (observed, trained), (answer, _) = example.segments
        assert not trained and example.prompt.text not in held_out
        got = await env.step(_episode(call, tokenizer=env.tokenizer))
        assert got.text == observed  # the warm start sees the environment's own answers
        outcome = task.reward(answer, example.prompt.reference)
        assert outcome.verdict is Verdict.OK


def test_the_gpu_recipe_renders_gsm8k_prompts_with_the_python_tool(tmp_path):
    """examples/gsm8k_qwen2.5_1.5b_python_tool_vllm.yaml, with a Qwen2.5-style tokenizer in
    place of the model and the shipped GSM8K sample in place of the dataset."""
    from areal.config import load_config
    from areal.controller.setup import episode_environment, stop_token_ids
    from areal.models.tokenizer import load_tokenizer

    repo = Path(__file__).resolve().parents[3]
    build_qwen_style_tokenizer().save_pretrained(tmp_path / "qwen-style")
    data = repo / "examples/data/gsm8k_train.jsonl"
    cfg = load_config(
        repo / "examples/gsm8k_qwen2.5_1.5b_python_tool_vllm.yaml",
        [
            f"model.path={tmp_path / 'qwen-style'}",
            f"task.params.path={data}",
            f"task.params.eval_path={repo / 'examples/data/gsm8k_test.jsonl'}",
        ],
    )
    tokenizer = load_tokenizer(cfg.model.path)
    task = load_task(cfg.task.name, cfg.task.params)
    task.use_tokenizer(tokenizer)
    env = episode_environment(cfg, task, tokenizer)
    assert isinstance(env, ToolEnvironment) and env.format == "chat"
    prompt = task.eval_prompts()[0].text
    assert '"name": "python"' in prompt and "<tool_call>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and "\\boxed{}" in prompt
    assert stop_token_ids(task, tokenizer, env) == sorted(
        tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    )


async def test_a_chat_turn_that_did_not_end_at_eos_is_the_answer():
    tokenizer = build_qwen_style_tokenizer()
    env = load_environment("tools", {}, task=load_task("tool_arithmetic"), tokenizer=tokenizer)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    cut = await env.step(_episode(call, tokenizer=tokenizer, stopped=False))
    assert isinstance(cut, RewardOutcome) and cut.verdict is Verdict.NO_ANSWER


async def test_the_episodes_guide_environment_example_runs():
    readme = (Path(__file__).resolve().parents[3] / "docs/guides/episodes.md").read_text()
    source = (
        readme.split("class GuessTheNumber(Environment):")[0].rsplit("```python", 1)[1]
        + "class GuessTheNumber(Environment):"
        + readme.split("class GuessTheNumber(Environment):")[1].split("```")[0]
    )
    namespace: dict = {}
    exec(compile(source, "docs/guides/episodes.md", "exec"), namespace)
    tokenizer = build_char_tokenizer()
    env = namespace["GuessTheNumber"](task=None, tokenizer=tokenizer, hint="higher")
    assert env.stop_strings() == ["\n"]
    assert await env.step(_episode("41\n", tokenizer=tokenizer, reference=42)) == Observation(
        text="higher\n"
    )
    assert (await env.step(_episode("42\n", tokenizer=tokenizer, reference=42))).reward == 1.0
    last = await env.step(_episode("7\n", tokenizer=tokenizer, reference=42, max_turns=1))
    assert last.verdict is Verdict.WRONG
