"""Prompt rendering: plain template, system prompt and instruction, the tokenizer's chat
template (when it has one, or never, or required), and how a task learns its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal.models.tiny import build_char_tokenizer
from areal.tasks.datasets import GSM8KTask
from areal.tasks.formats import MATH_INSTRUCTION, Example
from areal.tasks.prompting import PromptStyle, render

DATA = Path(__file__).resolve().parents[3] / "examples" / "data"
CHAT = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if think %}<think>{% endif %}{% endif %}"
)
EXAMPLE = Example(question="What is 2+3?", reference="5")


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT
    return tokenizer


def test_plain_template_is_question_then_instruction():
    text = render(PromptStyle(), EXAMPLE, MATH_INSTRUCTION, tokenizer=None)
    assert (
        text == "What is 2+3?\n\nPlease reason step by step, and put your final answer "
        "within \\boxed{}.\n"
    )


def test_system_prompt_instruction_and_templates_are_configurable():
    style = PromptStyle(
        system_prompt="You are terse.",
        instruction="Answer in \\boxed{}.",
        template="Q: {question}\n{instruction}",
        plain_template="{system}{user}\nA:",
    )
    assert (
        render(style, EXAMPLE, MATH_INSTRUCTION, None)
        == "You are terse.\n\nQ: What is 2+3?\nAnswer in \\boxed{}.\nA:"
    )
    assert render(PromptStyle(instruction=""), EXAMPLE, MATH_INSTRUCTION, None) == "What is 2+3?\n"


def test_context_values_fill_the_instruction_and_the_template():
    example = Example(
        question="Sum a list.", reference={}, context={"fn_name": "total"}, kind="function"
    )
    style = PromptStyle(instruction="Define `{fn_name}` and wrap {it} in ```python.")
    assert (
        render(style, example, "", None)
        == "Sum a list.\n\nDefine `total` and wrap {it} in ```python.\n"
    )


def test_the_chat_template_is_used_when_the_tokenizer_has_one(chat_tokenizer):
    style = PromptStyle(system_prompt="Be brief.")
    text = render(style, EXAMPLE, "Box it.", chat_tokenizer)
    assert text == "<|system|>Be brief.\n<|user|>What is 2+3?\n\nBox it.\n<|assistant|>"
    plain = render(
        PromptStyle(system_prompt="Be brief.", chat_template=False),
        EXAMPLE,
        "Box it.",
        chat_tokenizer,
    )
    assert plain == "Be brief.\n\nWhat is 2+3?\n\nBox it.\n"
    thinking = render(
        PromptStyle(chat_template_kwargs={"think": True}), EXAMPLE, "", chat_tokenizer
    )
    assert thinking.endswith("<|assistant|><think>")


def test_a_tokenizer_without_chat_template_gets_the_plain_template_unless_one_is_required():
    tokenizer = build_char_tokenizer()
    assert render(PromptStyle(), EXAMPLE, "Box it.", tokenizer) == "What is 2+3?\n\nBox it.\n"
    with pytest.raises(ValueError, match="chat_template=true but the tokenizer has no chat"):
        render(PromptStyle(chat_template=True), EXAMPLE, "", tokenizer)


def test_style_is_checked_when_built():
    with pytest.raises(ValueError, match="template=.*has no {question}"):
        PromptStyle(template="{instruction}")
    with pytest.raises(ValueError, match="chat_template='yes'"):
        PromptStyle(chat_template="yes")


def test_use_tokenizer_switches_the_task_to_the_chat_template(chat_tokenizer):
    task = GSM8KTask(path=str(DATA / "gsm8k_train.jsonl"), eval_path=str(DATA / "gsm8k_test.jsonl"))
    plain = task.eval_prompts()[0].text
    task.use_tokenizer(chat_tokenizer)
    chat = task.eval_prompts()[0].text
    assert not plain.startswith("<|user|>") and chat.startswith("<|user|>")
    assert chat.endswith("<|assistant|>")
    assert next(task.train_prompts(0)).text.startswith("<|user|>")
    ids = chat_tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert chat_tokenizer.decode(ids) == chat


def test_tokenizer_path_loads_the_tokenizer_and_wins_over_use_tokenizer(tmp_path, chat_tokenizer):
    chat_tokenizer.save_pretrained(tmp_path)
    task = GSM8KTask(
        path=str(DATA / "gsm8k_train.jsonl"),
        eval_path=str(DATA / "gsm8k_test.jsonl"),
        tokenizer_path=str(tmp_path),
        system_prompt="S",
    )
    task.use_tokenizer(build_char_tokenizer())  # ignored: the param names the tokenizer
    assert task.eval_prompts()[0].text.startswith("<|system|>S\n<|user|>")
