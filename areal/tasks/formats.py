"""Row formats: how a row of a GSM8K, MATH/DeepScaleR or code data file becomes a question,
a reference answer and the values its prompt template may use.

A format names *roles* (question, answer, solution, tests, ...) and, for each, the column
names that common data sets use for it; the first column present in a row (and not null)
fills the role. `fields` (task.params.fields) maps a role to another column, a dotted path
into nested values (`reward_model.ground_truth`), or null to ignore the role::

    gsm8k   question <- question          answer <- answer ("... #### 72", or a bare number)
    math    question <- problem|question  answer <- answer, else the last \\boxed{} of solution
    code    question <- question_content|question|problem|prompt|description
            tests    <- tests | input_output (APPS/TACO) | public_test_cases, private_test_cases,
                        test_cases, metadata (LiveCodeBench); fn_name, time_limit_s, starter_code

A question may also be a list of chat messages ({"role", "content"} dicts, as in verl-style
Parquet files). A row without a usable question or reference raises `RowError` (file and
row named); the task applies the bad-row policy. Code references are kept in the data's own
layout (any layout `areal.sandbox.code_problems.parse_problem` accepts) and validated with
it here, so a malformed test spec is a bad row at load time, not a failed reward later.
Nothing here reads files, renders prompts or runs a check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping

from areal.tasks.data_files import Row, RowError

Question = str | list[dict[str, str]]
"""Question text, or chat messages."""

_NUMBER_RE = re.compile(r"\s*[-+]?\$?\s*[\d,]*\.?\d+\s*")
_MISSING = object()


class _Bad(Exception):
    """A row-level problem; turned into a RowError naming the file and row."""


@dataclass(frozen=True, kw_only=True)
class Example:
    question: Question
    reference: Any
    """Plain data (str for math, a dict of test specs for code)."""
    context: dict[str, str] = field(default_factory=dict)
    """Extra template values, e.g. {'fn_name': ..., 'starter_code': ...}."""
    kind: str = ""
    """Selects the default instruction when a format has several (code: 'stdin'|'call')."""


@dataclass(frozen=True, kw_only=True)
class RowFormat:
    name: str
    roles: dict[str, tuple[str, ...]]
    """Role -> candidate columns, first match wins."""
    instructions: dict[str, str]
    """Default answer-format instruction per example kind ('' is the only kind of most)."""
    build: Callable[[dict[str, Any]], Example]
    """Values of the filled roles -> the example (raises _Bad)."""

    def check_fields(self, fields: Mapping[str, Any]) -> None:
        unknown = sorted(set(fields) - set(self.roles))
        if unknown:
            raise ValueError(
                f"task.params.fields: unknown role(s) {', '.join(unknown)} for the "
                f"{self.name} format; its roles are {', '.join(self.roles)}"
            )
        for role, column in fields.items():
            if column is not None and not (isinstance(column, str) and column):
                raise ValueError(
                    f"task.params.fields.{role}={column!r} must be a column name, "
                    "a dotted path or null"
                )

    def example(self, row: Row, fields: Mapping[str, str | None]) -> Example:
        """The row as an example, or RowError naming the file, the row and the reason."""
        values: dict[str, Any] = {}
        for role, candidates in self.roles.items():
            if role in fields:
                column = fields[role]
                if column is None:
                    continue
                value = lookup(row.data, column)
                if value is _MISSING:
                    raise RowError(
                        row.path,
                        row.index,
                        f"no column {column!r} (task.params."
                        f"fields.{role}); columns: {', '.join(sorted(row.data))}",
                    )
            else:
                value = next(
                    (
                        v
                        for c in candidates
                        if (v := lookup(row.data, c)) is not _MISSING and v is not None
                    ),
                    None,
                )
            if value is not None:
                values[role] = value
        try:
            return self.build(values)
        except _Bad as bad:
            raise RowError(row.path, row.index, str(bad)) from None


def lookup(data: Mapping[str, Any], path: str) -> Any:
    """data[path], else the dotted path into nested mappings, else _MISSING."""
    if path in data:
        return data[path]
    value: Any = data
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _question(values: dict[str, Any]) -> Question:
    question = values.get("question")
    if (
        isinstance(question, list)
        and question
        and all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) and m.get("role")
            for m in question
        )
    ):
        return [{"role": str(m["role"]), "content": m["content"]} for m in question]
    if not isinstance(question, str) or not question.strip():
        raise _Bad(f"no question (got {_short(question)})")
    return question.strip()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- GSM8K ------------------------------------------------------------------------------


def gsm8k_answer(answer: Any) -> str:
    """The number after the last '####' ('#### 1,234' -> '1234'), or a bare number."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    if not isinstance(answer, str):
        raise _Bad(f"no answer (got {_short(answer)})")
    if "####" in answer:
        tail = answer.rsplit("####", 1)[1]
    elif _NUMBER_RE.fullmatch(answer):
        tail = answer
    else:
        raise _Bad(f"answer has no '#### <number>' line: {_short(answer)}")
    final = tail.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if not final:
        raise _Bad(f"nothing after '####' in the answer: {_short(answer)}")
    if not _NUMBER_RE.fullmatch(final):
        raise _Bad(
            f"the final answer after '####' is not a number ({_short(final)}): {_short(answer)}"
        )
    return final.replace(" ", "")


def _build_gsm8k(values: dict[str, Any]) -> Example:
    return Example(question=_question(values), reference=gsm8k_answer(values.get("answer")))


# ---- MATH / DeepScaleR ------------------------------------------------------------------


def _build_math(values: dict[str, Any]) -> Example:
    question = _question(values)
    answer = values.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return Example(question=question, reference=str(answer))
    if isinstance(answer, str) and answer.strip():
        return Example(question=question, reference=answer.strip())
    solution = values.get("solution")
    if isinstance(solution, str):
        from areal.sandbox.math_reward import last_boxed  # stdlib-only module, no workers

        boxed = last_boxed(solution)
        if boxed:
            return Example(question=question, reference=boxed)
        raise _Bad("no answer field and no \\boxed{...} in the solution")
    raise _Bad("no answer and no solution field")


# ---- code -------------------------------------------------------------------------------

CODE_REFERENCE_ROLES = (
    "tests",
    "input_output",
    "public_test_cases",
    "private_test_cases",
    "test_cases",
    "metadata",
    "fn_name",
    "time_limit_s",
)
"""Roles copied into a code reference, under these keys (parse_problem's)."""


def _build_code(values: dict[str, Any]) -> Example:
    from areal.sandbox.code_problems import ProblemFormatError, parse_problem

    question = _question(values)
    reference = {role: values[role] for role in CODE_REFERENCE_ROLES if role in values}
    if not reference:
        raise _Bad("no test cases (none of the fields " + ", ".join(CODE_REFERENCE_ROLES[:6]) + ")")
    try:
        problem = parse_problem(reference)
    except (ProblemFormatError, KeyError, TypeError, ValueError) as err:
        raise _Bad(f"unusable tests: {type(err).__name__}: {err}") from None
    starter = values.get("starter_code")
    starter = starter.strip("\n") if isinstance(starter, str) else ""
    context = {"fn_name": problem.fn_name or "", "starter_code": starter}
    kind = "stdin" if not problem.fn_name else "call" if starter else "function"
    return Example(question=question, reference=reference, context=context, kind=kind)


MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

GSM8K = RowFormat(
    name="gsm8k",
    roles={"question": ("question",), "answer": ("answer",)},
    instructions={"": MATH_INSTRUCTION},
    build=_build_gsm8k,
)
MATH = RowFormat(
    name="math",
    roles={"question": ("problem", "question"), "answer": ("answer",), "solution": ("solution",)},
    instructions={"": MATH_INSTRUCTION},
    build=_build_math,
)
CODE = RowFormat(
    name="code",
    roles={
        "question": ("question_content", "question", "problem", "prompt", "description"),
        "starter_code": ("starter_code",),
        **{role: (role,) for role in CODE_REFERENCE_ROLES},
    },
    instructions={
        "stdin": "Write a Python 3 program that reads the input from standard input and "
        "prints the answer to standard output. Put the whole program in one "
        "```python code block.",
        "call": "Complete the function `{fn_name}` in the starter code below and put the "
        "whole solution in one ```python code block.\n```python\n{starter_code}\n```",
        "function": "Write a Python 3 function `{fn_name}` that solves the problem. Put the "
        "whole solution in one ```python code block.",
    },
    build=_build_code,
)
