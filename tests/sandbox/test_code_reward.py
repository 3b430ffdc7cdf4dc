"""Code reward: program extraction, data formats, correct and wrong solutions, limits,
partial credit and early exit, and sandbox failures that are not the program's fault."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal.sandbox import CPP, ExecResult, ExecStatus
from areal.sandbox.code_problems import parse_problem, stdout_matches, values_match
from areal.sandbox.code_reward import CodeRewardConfig, code_reward, code_reward_async, extract_code
from areal.tasks.base import Verdict


def fenced(code: str, tag: str = "python") -> str:
    return f"Let me think step by step.\n\n```{tag}\n{code}\n```\nThis should work."


A_PLUS_B = {
    "tests": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "-5 5\n", "output": "0"},
        {"input": "100000000000 1\n", "output": "100000000001\n"},
    ]
}
REVERSE_LINES = {
    "input_output": json.dumps(
        {"inputs": ["3\na\nb\nc\n", ["2", "x", "y"]], "outputs": ["c\nb\na\n", ["y", "x"]]}
    )
}
WORD_COUNT = {
    "public_test_cases": json.dumps(
        [
            {"input": "hello world\n", "output": "2\n", "testtype": "stdin"},
            {"input": "  a  b   c \n", "output": "3\n", "testtype": "stdin"},
        ]
    ),
    "private_test_cases": "[]",
}
TWO_SUM_LCB = {
    "public_test_cases": json.dumps(
        [
            {"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
            {"input": "[3,2,4]\n6", "output": "[1, 2]", "testtype": "functional"},
        ]
    ),
    "metadata": json.dumps({"func_name": "twoSum"}),
}
SQUARE_TACO = {
    "input_output": {"fn_name": "square", "inputs": [[3], [-4], [0]], "outputs": [[9], [16], [0]]}
}

CORRECT = {
    "a_plus_b": (A_PLUS_B, "a, b = map(int, input().split())\nprint(a + b)"),
    "reverse_lines": (
        REVERSE_LINES,
        "n = int(input())\nrows = [input() for _ in range(n)]\nprint('\\n'.join(reversed(rows)))",
    ),
    "word_count": (WORD_COUNT, "import sys\nprint(len(sys.stdin.read().split()))"),
    "two_sum": (
        TWO_SUM_LCB,
        """class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i""",
    ),
    "square": (
        SQUARE_TACO,
        "def square(x):\n    print('debug output is ignored')\n    return x * x",
    ),
}
WRONG = {
    "a_plus_b": (
        A_PLUS_B,
        "a, b = map(int, input().split())\nprint(a - b)",
        "test 1/3 failed: wrong_answer",
    ),
    "reverse_lines": (
        REVERSE_LINES,
        "n = int(input())\nprint(input())",
        "wrong_answer: printed 'a",
    ),
    "word_count": (WORD_COUNT, "print(len(input().split(' ')))", "test 2/2 failed"),
    "two_sum": (
        TWO_SUM_LCB,
        "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]",
        "test 2/2",
    ),
    "square": (SQUARE_TACO, "def square(x):\n    return x + x", "returned '6', expected '[9]'"),
}


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_solution_gets_reward_one(sandbox, name):
    reference, code = CORRECT[name]
    outcome = code_reward(fenced(code), reference, sandbox=sandbox)
    assert (outcome.reward, outcome.verdict) == (1.0, Verdict.OK), outcome.detail


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_solution_gets_reward_zero_and_names_the_failing_test(sandbox, name):
    reference, code, why = WRONG[name]
    outcome = code_reward(fenced(code), reference, sandbox=sandbox)
    assert (outcome.reward, outcome.verdict) == (0.0, Verdict.WRONG)
    assert why in outcome.detail, outcome.detail


def test_program_failures_are_wrong_answers_with_the_reason(sandbox):
    crash = code_reward(fenced("raise ValueError('boom')"), A_PLUS_B, sandbox=sandbox)
    assert (
        crash.verdict is Verdict.WRONG
        and "runtime_error" in crash.detail
        and "ValueError: boom" in crash.detail
    )
    slow = {**A_PLUS_B, "time_limit_s": 0.5}
    loop = code_reward(fenced("while True:\n    pass"), slow, sandbox=sandbox)
    assert loop.verdict is Verdict.WRONG and loop.reward == 0.0 and "timeout" in loop.detail
    missing = code_reward(fenced("def cube(x):\n    return x ** 3"), SQUARE_TACO, sandbox=sandbox)
    assert (
        missing.verdict is Verdict.WRONG
        and "no function or Solution method named 'square'" in missing.detail
    )


def test_partial_credit_and_early_exit(sandbox):
    half = "n = int(input().split()[0])\nprint(3 if n == 1 else 0)"  # passes tests 1 and 2 only
    early = code_reward(
        fenced(half), A_PLUS_B, sandbox=sandbox, config=CodeRewardConfig(partial_credit=True)
    )
    assert early.reward == pytest.approx(2 / 3) and early.verdict is Verdict.WRONG
    sequence = {"tests": [{"input": "", "output": str(i)} for i in range(4)]}
    counting = CountingSandbox(sandbox)
    first_fails = code_reward(fenced("print(1)"), sequence, sandbox=counting)
    assert first_fails.reward == 0.0 and counting.calls == 1
    counting.calls = 0
    full = code_reward(
        fenced("print(1)"),
        sequence,
        sandbox=counting,
        config=CodeRewardConfig(partial_credit=True, stop_on_first_failure=False),
    )
    assert full.reward == 0.25 and counting.calls == 4 and "passed 1/4" in full.detail


def test_no_code_bad_reference_and_sandbox_failure_are_not_wrong_answers(sandbox):
    assert (
        code_reward("I would loop over the input.", A_PLUS_B, sandbox=sandbox).verdict
        is Verdict.NO_ANSWER
    )
    bad = code_reward(fenced("print(1)"), {"problem": "no tests"}, sandbox=sandbox)
    assert bad.verdict is Verdict.ERROR and "bad code reference" in bad.detail
    pickled = {"public_test_cases": "[]", "private_test_cases": "eJzT0yMAAGTvBe8="}
    assert "never unpickles" in code_reward(fenced("print(1)"), pickled, sandbox=sandbox).detail
    broken = code_reward(fenced("print(3)"), A_PLUS_B, sandbox=BrokenSandbox())
    assert (
        broken.verdict is Verdict.ERROR
        and broken.reward == 0.0
        and "launcher gone" in broken.detail
    )


def test_async_variant_agrees(sandbox):
    async def both():
        return await asyncio.gather(
            code_reward_async(fenced(CORRECT["two_sum"][1]), TWO_SUM_LCB, sandbox=sandbox),
            code_reward_async(fenced(WRONG["a_plus_b"][1]), A_PLUS_B, sandbox=sandbox),
        )

    right, wrong = asyncio.run(both())
    assert (right.verdict, wrong.verdict) == (Verdict.OK, Verdict.WRONG)


@pytest.mark.slow
def test_cpp_solution_through_the_language_spec(sandbox):
    code = '#include <iostream>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a+b<<"\\n";}'
    outcome = code_reward(
        fenced(code, "cpp"), A_PLUS_B, sandbox=sandbox, config=CodeRewardConfig(language=CPP)
    )
    assert outcome.verdict is Verdict.OK, outcome.detail


def test_code_extraction_prefers_the_last_block_in_the_language():
    text = "```python\nold()\n```\ntext\n```py\nnew()\n```\n```\nsample output\n```"
    assert extract_code(text) == "new()\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```cpp\nint main(){}\n```", ("cpp",)) == "int main(){}\n"
    assert extract_code("no code, just ```inline``` words") is None
    assert extract_code("```python\nunterminated") is None


def test_output_comparison_is_tolerant_only_where_asked():
    assert stdout_matches("1 2  \n3\n\n\n", "1 2\n3")
    assert not stdout_matches("1 2\n3", "1  2\n3")
    assert not stdout_matches("0.3333333", "0.333333")
    assert stdout_matches("0.3333333 x", "0.333333 x", float_tolerance=1e-5)
    assert not stdout_matches("0.34 x", "0.333333 x", float_tolerance=1e-5)
    assert values_match([1, [2.0000001]], [1, [2]], float_tolerance=1e-6)
    assert not values_match(True, 1) and not values_match([1, 2], [2, 1])
    assert values_match(9, [9], singleton_wrapped=True) and not values_match(9, [9])


def test_problem_formats_parse_to_the_same_shape():
    assert len(parse_problem(json.dumps(A_PLUS_B)).tests) == 3
    reverse = parse_problem(REVERSE_LINES)
    assert reverse.tests[1].input == "2\nx\ny\n" and reverse.fn_name is None
    two_sum = parse_problem(TWO_SUM_LCB)
    assert two_sum.fn_name == "twoSum" and two_sum.tests[0].input == [[2, 7, 11, 15], 9]
    assert parse_problem(SQUARE_TACO).singleton_wrapped


class CountingSandbox:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def run(self, *args, **kwargs) -> ExecResult:
        self.calls += 1
        return self.inner.run(*args, **kwargs)


class BrokenSandbox:
    def run(self, *args, **kwargs) -> ExecResult:
        return ExecResult(status=ExecStatus.SANDBOX_ERROR, detail="launcher gone")
