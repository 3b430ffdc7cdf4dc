"""Tools a model can call in an episode: a calculator and Python code in the sandbox.

A tool takes the arguments of one call (a dict, as parsed from the model's tool call) and
returns a `ToolResult`: the text the model will read and whether the call failed. A tool
never raises for anything the model wrote: a malformed call, an error in the code, a
timeout or a crash come back as a failed result whose text says so (the episode goes on,
and the model can read the error). Each tool has a JSON-schema definition for chat
templates (`definition()`, the `tools=` of `apply_chat_template`).

- `calculator`: one arithmetic expression (integers and decimals; + - * / // % ** and
  parentheses), evaluated exactly in-process by walking its syntax tree. No code runs:
  only those operators on number literals are accepted, and powers and results are
  bounded, so the tool cannot be made to spin or exhaust memory.
- `python`: a program run in `areal.sandbox` with its limits (wall and CPU time, memory,
  processes, no network, an empty working directory); stdout, stderr and the run's status
  become the result.

Not here: finding tool calls in the model's text (tool_calls.py), the episode loop.
"""

from __future__ import annotations

import ast
import operator
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    text: str
    failed: bool = False
    """The call did not do its job (bad arguments, error, timeout): counted in the metrics."""
    seconds: float = 0.0


class Tool(ABC):
    name: str
    description: str
    argument: str
    """The one required string argument (the whole call in the bracket format)."""
    argument_help: str = ""

    def definition(self) -> dict[str, Any]:
        """The tool as a chat template expects it (OpenAI function-call schema)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "required": [self.argument],
                    "properties": {
                        self.argument: {"type": "string", "description": self.argument_help}
                    },
                },
            },
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run one call; never raises for what the model wrote."""
        start = time.monotonic()
        value = arguments.get(self.argument)
        if not isinstance(value, str) or set(arguments) - {self.argument}:
            result = ToolResult(
                text=f"error: {self.name} takes one string argument "
                f"{self.argument!r}, got {sorted(arguments)}",
                failed=True,
            )
        else:
            result = await self.run(value)
        return ToolResult(text=result.text, failed=result.failed, seconds=time.monotonic() - start)

    @abstractmethod
    async def run(self, value: str) -> ToolResult:
        """Run the call with its argument's value."""

    async def start(self) -> None:
        """Acquire resources (a sandbox launcher); called once before the first call."""

    async def close(self) -> None:
        """Release them; idempotent."""


# ---- calculator ---------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_RESULT_DIGITS = 60

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not one the calculator evaluates; the text says why."""


def evaluate_expression(text: str) -> int | float:
    """The value of an arithmetic expression over number literals. Raises CalculatorError."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {text.strip()[:60]!r}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and type(node.value) is not bool
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is beyond +-{MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(value, int) and abs(value) >= 10**MAX_RESULT_DIGITS:
            raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
        return value
    raise CalculatorError(
        f"unsupported element {type(node).__name__}: only numbers, + - * / // % ** and parentheses"
    )


def format_number(value: int | float) -> str:
    """Integers exactly; floats that are whole as integers, others to 12 significant digits."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate one arithmetic expression exactly."
    argument = "expression"
    argument_help = "numbers with + - * / // % ** and parentheses, e.g. 4821*37"

    async def run(self, value: str) -> ToolResult:
        try:
            return ToolResult(text=format_number(evaluate_expression(value)))
        except CalculatorError as err:
            return ToolResult(text=f"error: {err}", failed=True)


# ---- python in the sandbox ----------------------------------------------------------------


class PythonTool(Tool):
    """Python code run in `areal.sandbox` (one launcher per process, started by `start`)."""

    name = "python"
    description = (
        "Run a Python program in a sandbox (no network, no files kept) and "
        "return its standard output and errors. Print what you need to see."
    )
    argument = "code"
    argument_help = "a complete Python program"

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_chars: int = 1000,
        max_concurrency: int = 16,
        allow_unisolated: bool = False,
    ) -> None:
        """timeout_s: wall and CPU seconds per run; memory_mb: address space per process;
        max_output_chars: kept of stdout (its start) and of stderr (its end) each;
        max_concurrency: runs at once (more wait); allow_unisolated: run even where no
        namespace isolation is possible (areal.sandbox refuses by default)."""
        if not timeout_s > 0 or memory_mb < 16 or max_output_chars < 1 or max_concurrency < 1:
            raise ValueError(
                f"python tool: timeout_s={timeout_s!r} must be > 0, memory_mb={memory_mb!r} "
                f">= 16, max_output_chars={max_output_chars!r} and max_concurrency="
                f"{max_concurrency!r} >= 1"
            )
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_output_chars, self.max_concurrency = max_output_chars, max_concurrency
        self.allow_unisolated = allow_unisolated
        self._sandbox: Any = None

    async def start(self) -> None:
        import asyncio

        from areal.sandbox import Limits, Sandbox, SandboxConfig

        self._limits = Limits(
            wall_s=self.timeout_s,
            cpu_s=self.timeout_s,
            memory_bytes=self.memory_mb << 20,
            run_memory_bytes=2 * self.memory_mb << 20,
        )
        self._sandbox = Sandbox(
            SandboxConfig(
                limits=self._limits,
                max_concurrency=self.max_concurrency,
                allow_unisolated=self.allow_unisolated,
            )
        )
        await asyncio.to_thread(self._sandbox.start)  # IsolationError: reported at setup

    async def run(self, value: str) -> ToolResult:
        from areal.sandbox import ExecStatus

        if self._sandbox is None:
            raise RuntimeError("PythonTool.start() was not awaited before the first call")
        result = await self._sandbox.run_async(value, limits=self._limits)
        limit = self.max_output_chars
        parts = []
        if result.stdout:  # its beginning: what the program printed first
            out = result.stdout_text.rstrip("\n")
            parts.append(out if len(out) <= limit else out[:limit] + "\n...(output truncated)")
        if result.stderr:  # its end: where the traceback names the error
            err = result.stderr_text.rstrip("\n")
            parts.append(
                "stderr:\n" + (err if len(err) <= limit else "(truncated)...\n" + err[-limit:])
            )
        if result.status is not ExecStatus.OK:
            parts.append(
                f"status: {result.status.value}" + (f" ({result.detail})" if result.detail else "")
            )
        return ToolResult(
            text="\n".join(parts) or "(no output)", failed=result.status is not ExecStatus.OK
        )

    async def close(self) -> None:
        import asyncio

        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await asyncio.to_thread(sandbox.close)


def make_tool(name: str, options: dict[str, Any]) -> Tool:
    """A built-in tool by name ('calculator', 'python') with its options."""
    if name == "calculator":
        if options:
            raise ValueError(
                f"episode.params.tool_options.calculator takes no options, got {sorted(options)}"
            )
        return Calculator()
    if name == "python":
        try:
            return PythonTool(**options)
        except TypeError as err:
            raise ValueError(f"episode.params.tool_options.python: {err}") from None
    raise ValueError(f"episode.params.tools: {name!r} is not a built-in tool (calculator, python)")
