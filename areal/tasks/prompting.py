"""Turning a question into the prompt text the model sees: the tokenizer's chat template when
it has one, a plain template otherwise.

    style = PromptStyle(system_prompt="...", instruction="put the final answer in \\boxed{}")
    text = render(style, example, default_instruction, tokenizer)

The user turn is `template` with {question} and {instruction} filled in (and any value of
the example's context, e.g. {fn_name}, {starter_code}); only these names are replaced, so
literal braces such as `\\boxed{}` need no escaping. With a chat template the conversation
is [system (if any), user] rendered with `add_generation_prompt=True`; without one it is
`plain_template` with {system} (the system prompt and a blank line, or nothing) and {user}.
A question given as chat messages is used as the conversation itself (the system prompt is
prepended if it has none; the instruction is not added: such data carries its own).

`chat_template`: None uses the chat template iff the tokenizer has one; True requires one;
False never uses it. The rendered text already holds the template's special tokens, so it
is tokenized with `add_special_tokens=False` (as the controller does). Nothing here loads a
tokenizer or reads data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal.tasks.formats import Example

DEFAULT_TEMPLATE = "{question}\n\n{instruction}"
DEFAULT_PLAIN_TEMPLATE = "{system}{user}\n"


@dataclass(frozen=True, kw_only=True)
class PromptStyle:
    system_prompt: str = ""
    """System message (chat) or preamble (plain); empty: none."""
    instruction: str | None = None
    """Answer-format instruction; None: the format's default; '': none."""
    template: str = DEFAULT_TEMPLATE
    """The user turn, with {question}, {instruction} and the example's context names."""
    plain_template: str = DEFAULT_PLAIN_TEMPLATE
    """The whole prompt without a chat template, with {system} and {user}."""
    chat_template: bool | None = None
    """None: use the tokenizer's chat template if it has one; True: require it; False: never."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (e.g. {'enable_thinking': False} for Qwen3)."""

    def __post_init__(self) -> None:
        if self.chat_template not in (None, True, False):
            raise ValueError(
                f"task.params.chat_template={self.chat_template!r} must be true, "
                "false or null (null: use it when the tokenizer has one)"
            )
        if "{question}" not in self.template:
            raise ValueError(f"task.params.template={self.template!r} has no {{question}}")
        if "{user}" not in self.plain_template:
            raise ValueError(f"task.params.plain_template={self.plain_template!r} has no {{user}}")


def fill(template: str, **values: str) -> str:
    """Replace each {name} of `values` in `template`; every other brace stays as it is."""
    for name, value in values.items():
        template = template.replace("{" + name + "}", value)
    return template


def uses_chat_template(style: PromptStyle, tokenizer: Any | None) -> bool:
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if style.chat_template is True and not has_template:
        raise ValueError(
            "task.params.chat_template=true but the tokenizer has no chat "
            "template"
            + (
                ""
                if tokenizer is not None
                else " (no tokenizer is known to the task: set task.params.tokenizer_path)"
            )
        )
    return has_template if style.chat_template is None else style.chat_template


def messages(style: PromptStyle, example: Example, default_instruction: str) -> list[dict]:
    """The conversation: [system?, user] or the example's own messages."""
    if isinstance(example.question, list):
        convo = [dict(m) for m in example.question]
        if style.system_prompt and convo[0]["role"] != "system":
            convo.insert(0, {"role": "system", "content": style.system_prompt})
        return convo
    instruction = default_instruction if style.instruction is None else style.instruction
    instruction = fill(instruction, **example.context)
    user = fill(
        style.template, question=example.question, instruction=instruction, **example.context
    ).strip()
    convo = [{"role": "system", "content": style.system_prompt}] if style.system_prompt else []
    return convo + [{"role": "user", "content": user}]


def render(
    style: PromptStyle, example: Example, default_instruction: str, tokenizer: Any | None
) -> str:
    """The prompt text for `example` (see the module docstring)."""
    convo = messages(style, example, default_instruction)
    if uses_chat_template(style, tokenizer):
        assert tokenizer is not None  # a chat template needs one
        text = tokenizer.apply_chat_template(
            convo, tokenize=False, add_generation_prompt=True, **style.chat_template_kwargs
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
        return text
    system = "\n\n".join(m["content"] for m in convo if m["role"] == "system")
    user = "\n\n".join(m["content"] for m in convo if m["role"] != "system")
    return fill(style.plain_template, system=f"{system}\n\n" if system else "", user=user)
