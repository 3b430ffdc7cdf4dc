"""A tokenizer with a Qwen2.5-style chat template and tool-call format, built locally.

The tool protocol is Qwen2.5's (as its Hugging Face chat template renders it): the tools
listed as JSON inside <tools></tools> in the system turn, each call in the assistant's
turn as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, the results in a
user turn as <tool_response>\\n...\\n</tool_response> blocks, turns framed by
<|im_start|>role\\n ... <|im_end|>\\n. The template text is written here (not copied);
the vocabulary is the embedded model's characters plus the special and tool tokens.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from areal.models.tiny import build_char_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' "
    "else 'You are a helpful assistant.' -%}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nFunctions you can call, one JSON signature per line:\\n<tools>' }}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments "
    'between tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content -%}{{- '\\n' + message.content }}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' '
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' }}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_qwen_style_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.add_tokens(TOOL_TOKENS)  # not special: kept when decoding, as in Qwen2.5
    tokenizer.eos_token = IM_END
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
