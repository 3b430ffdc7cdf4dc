"""Code problems in the usual RL data formats, reduced to one shape: `CodeProblem`.

Accepted references (a dict, or its JSON text):
- canonical: `{"tests": [{"input": ..., "output": ...}], "fn_name": "f"?, "time_limit_s": 2?}`
- APPS / TACO: `{"input_output": {"inputs": [...], "outputs": [...], "fn_name"?: ...}}` (also
  as a JSON string, or the inner dict alone). Stdin tests are strings (or lists of lines);
  call tests list the arguments, and TACO wraps expected values in a one-element list.
- LiveCodeBench: `{"public_test_cases": [...], "private_test_cases": [...], "metadata":
  {"func_name": ...}}`, each case `{"input", "output", "testtype": "stdin"|"functional"}`;
  functional inputs are one JSON value per line. LiveCodeBench ships private cases
  pickled and compressed: they are refused (no unpickling of data), decode them offline.

Also here: how outputs are compared (`stdout_matches`, `values_match`), and the driver
program that calls a function for call-style tests. This module runs nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


class ProblemFormatError(ValueError):
    """A reference is not a code problem in any supported format."""


@dataclass(frozen=True, kw_only=True)
class TestCase:
    input: Any
    """Stdin text (stdin tests) or the list of arguments (call tests)."""
    output: Any
    """Expected stdout text (stdin tests) or the expected return value (call tests)."""


@dataclass(frozen=True, kw_only=True)
class CodeProblem:
    tests: tuple[TestCase, ...]
    fn_name: str | None = None
    """Function (or `Solution` method) to call; None means stdin/stdout tests."""
    singleton_wrapped: bool = False
    """TACO/APPS call tests: an expected `[v]` also accepts a return value `v`."""
    time_limit_s: float | None = None
    """Per-test wall-clock limit given by the data, if any."""


def parse_problem(reference: Any) -> CodeProblem:
    data = _json(reference, "reference")
    if not isinstance(data, dict):
        raise ProblemFormatError(
            f"code reference must be a dict or JSON object, got {type(data).__name__}"
        )
    limit = data.get("time_limit_s")
    if "tests" in data:
        tests = tuple(TestCase(input=t["input"], output=t["output"]) for t in data["tests"])
        problem = CodeProblem(tests=tests, fn_name=data.get("fn_name"), time_limit_s=limit)
    elif "input_output" in data or "inputs" in data:
        problem = _apps(_json(data.get("input_output", data), "input_output"), limit)
    elif "public_test_cases" in data or "private_test_cases" in data or "test_cases" in data:
        problem = _livecodebench(data, limit)
    else:
        raise ProblemFormatError(
            f"code reference has none of the keys tests, input_output, inputs, public_test_cases "
            f"(got {sorted(data)[:8]})"
        )
    if not problem.tests:
        raise ProblemFormatError("code reference has no test cases")
    return problem


def _json(value: Any, what: str) -> Any:
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ProblemFormatError(f"{what} is text but not JSON: {exc}") from exc
    return value


def _lines(value: Any) -> str:
    return "\n".join(str(v) for v in value) + "\n" if isinstance(value, list) else str(value)


def _apps(io: dict, limit: float | None) -> CodeProblem:
    inputs, outputs, fn_name = io.get("inputs", []), io.get("outputs", []), io.get("fn_name")
    if len(inputs) != len(outputs):
        raise ProblemFormatError(
            f"input_output has {len(inputs)} inputs but {len(outputs)} outputs"
        )
    if fn_name:
        tests = tuple(
            TestCase(input=list(i) if isinstance(i, list) else [i], output=o)
            for i, o in zip(inputs, outputs, strict=True)
        )
        return CodeProblem(tests=tests, fn_name=fn_name, singleton_wrapped=True, time_limit_s=limit)
    tests = tuple(
        TestCase(input=_lines(i), output=_lines(o)) for i, o in zip(inputs, outputs, strict=True)
    )
    return CodeProblem(tests=tests, time_limit_s=limit)


def _livecodebench(data: dict, limit: float | None) -> CodeProblem:
    cases: list[dict] = []
    for key in ("public_test_cases", "test_cases", "private_test_cases"):
        raw = data.get(key)
        if raw in (None, "", []):
            continue
        try:
            cases.extend(_json(raw, key))
        except ProblemFormatError as exc:
            raise ProblemFormatError(
                f"{key} is not JSON (LiveCodeBench private tests are pickled+zlib+base64; "
                "decode them to a JSON list offline, this loader never unpickles)"
            ) from exc
    metadata = _json(data.get("metadata") or {}, "metadata")
    fn_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    functional = [c.get("testtype") == "functional" for c in cases]
    if any(functional) and not fn_name:
        raise ProblemFormatError("functional test cases need metadata.func_name")
    if fn_name and all(functional):
        tests = tuple(
            TestCase(
                input=[json.loads(line) for line in c["input"].split("\n") if line.strip()],
                output=json.loads(c["output"]),
            )
            for c in cases
        )
        return CodeProblem(tests=tests, fn_name=fn_name, time_limit_s=limit)
    if any(functional):
        raise ProblemFormatError("mixed stdin and functional test cases in one problem")
    return CodeProblem(
        tests=tuple(TestCase(input=c["input"], output=c["output"]) for c in cases),
        time_limit_s=limit,
    )


def stdout_matches(actual: str, expected: str, float_tolerance: float | None = None) -> bool:
    """Line by line, ignoring trailing whitespace on each line and trailing blank lines;
    with a tolerance, whitespace-separated tokens that parse as numbers compare within it
    (absolute or relative)."""
    got, want = _clean_lines(actual), _clean_lines(expected)
    if got == want:
        return True
    if float_tolerance is None or len(got) != len(want):
        return False
    for got_line, want_line in zip(got, want, strict=True):
        got_tokens, want_tokens = got_line.split(), want_line.split()
        if len(got_tokens) != len(want_tokens):
            return False
        for g, w in zip(got_tokens, want_tokens, strict=True):
            if g != w and not _close(g, w, float_tolerance):
                return False
    return True


def _clean_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(a: Any, b: Any, tol: float) -> bool:
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return False
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def values_match(
    actual: Any,
    expected: Any,
    *,
    float_tolerance: float | None = None,
    singleton_wrapped: bool = False,
) -> bool:
    """Deep equality of JSON values; tuples are lists; floats within the tolerance."""
    if _equal(actual, expected, float_tolerance):
        return True
    return (
        singleton_wrapped
        and isinstance(expected, list)
        and len(expected) == 1
        and _equal(actual, expected[0], float_tolerance)
    )


def _equal(a: Any, b: Any, tol: float | None) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y, tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], tol) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):  # true is not 1
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (tol is not None and math.isclose(a, b, rel_tol=tol, abs_tol=tol))
    return a == b


CALL_DRIVER = '''\
"""Calls the solution's function with the JSON arguments on stdin; prints the JSON result."""
import json, sys
result_out = sys.stdout
sys.stdout = sys.stderr  # the solution's own prints must not corrupt the result line
namespace = {"__name__": "solution"}
exec("from typing import *\\nimport collections, heapq, math, itertools, functools, bisect, string, re\\n"
     "from collections import *\\nfrom heapq import *\\nfrom itertools import *\\n"
     "from functools import *\\nfrom bisect import *", namespace)
with open("solution.py") as f:
    exec(compile(f.read(), "solution.py", "exec"), namespace)
name = sys.argv[1]
holder = namespace.get("Solution")
if holder is not None and hasattr(holder, name):
    target = getattr(holder(), name)
elif callable(namespace.get(name)):
    target = namespace[name]
else:
    sys.exit(f"no function or Solution method named {name!r}")
value = target(*json.loads(sys.stdin.read()))
result_out.write(json.dumps(value, default=repr))
result_out.flush()
'''
