"""The built-in tools: the calculator evaluates exactly and refuses anything but arithmetic;
the Python tool runs in the real sandbox and reports errors, crashes and timeouts as
failed results whose text says so (never an exception)."""

from __future__ import annotations

import asyncio

import pytest

from areal.tasks.tools import (
    Calculator,
    CalculatorError,
    PythonTool,
    evaluate_expression,
    format_number,
    make_tool,
)


@pytest.mark.parametrize(
    "text, value",
    [
        ("482*37", 17834),
        ("  2 + 3*(4 - 1) ", 11),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2**10", 1024),
        ("1/4", 0.25),
        ("123456789*987654321", 121932631112635269),
    ],
)
def test_calculator_evaluates_exactly(text, value):
    assert evaluate_expression(text) == value


@pytest.mark.parametrize(
    "text, reason",
    [
        ("__import__('os')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("'a' * 3", "unsupported element Constant"),
        ("1 +", "not an arithmetic expression"),
        ("1/0", "division by zero"),
        ("2**100000", "exponent 100000 is beyond"),
        ("(10**59)**2", "more than 60 digits"),
        ("(-8)**0.5", "not a real number"),
        ("1" * 201, "longer than 200 characters"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(text, reason):
    with pytest.raises(CalculatorError, match=reason.replace("(", r"\(").replace("*", r"\*")):
        evaluate_expression(text)


def test_numbers_are_formatted_for_reading():
    assert [format_number(v) for v in (17834, 2.0, 0.1 + 0.2, 1 / 3)] == [
        "17834",
        "2",
        "0.3",
        "0.333333333333",
    ]


async def test_a_bad_call_is_a_failed_result_that_says_why():
    calculator = Calculator()
    ok = await calculator.call({"expression": "6*7"})
    assert (ok.text, ok.failed) == ("42", False)
    bad = await calculator.call({"expression": "6*"})
    assert bad.failed and bad.text.startswith("error: not an arithmetic expression")
    wrong_args = await calculator.call({"expr": "6*7"})
    assert wrong_args.failed and "takes one string argument 'expression'" in wrong_args.text


def test_tools_are_made_by_name_with_checked_options():
    assert isinstance(make_tool("python", {"timeout_s": 2.0}), PythonTool)
    with pytest.raises(ValueError, match="'shell' is not a built-in tool"):
        make_tool("shell", {})
    with pytest.raises(ValueError, match="calculator takes no options"):
        make_tool("calculator", {"digits": 3})
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        make_tool("python", {"timeout_s": 0})


@pytest.fixture(scope="module")
def python_tool():
    """One sandbox launcher for the module (it serves any event loop: one connection per run)."""
    tool = PythonTool(timeout_s=1.0, memory_mb=256, max_output_chars=200)
    asyncio.run(tool.start())
    yield tool
    asyncio.run(tool.close())


@pytest.mark.slow
@pytest.mark.parametrize(
    "code, failed, expected",
    [
        ("print(482*37)", False, "17834"),
        ("import sys; print('x'); print('warn', file=sys.stderr)", False, "x\nstderr:\nwarn"),
        ("1/0", True, "ZeroDivisionError: division by zero\nstatus: runtime_error"),
        ("while True: pass", True, "status: timeout"),
        ("print('y' * 5000)", False, "...(output truncated)"),
        (
            "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)",
            True,
            "status: runtime_error",
        ),
        ("print(", True, "SyntaxError"),
    ],
)
async def test_python_runs_in_the_sandbox_and_failures_become_results(
    python_tool, code, failed, expected
):
    result = await python_tool.call({"code": code})
    assert result.failed is failed, result.text
    assert expected in result.text
    assert len(result.text) <= 2 * 200 + 200  # stdout and stderr clipped, status line
