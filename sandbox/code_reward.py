"""Code reward: take the program out of a completion and run it against the problem's tests
in the sandbox, one sandboxed run per test.

    code_reward(completion, reference) -> RewardOutcome              # blocking, any thread
    await code_reward_async(completion, reference) -> RewardOutcome  # on an event loop

`reference` is any format `code_problems.parse_problem` accepts. The program is the last
fenced code block tagged with one of the language's tags, else the last untagged block.
Reward: 1.0 when every test passes, else 0.0; with `partial_credit` the fraction passed.
Verdicts: OK (all passed), WRONG (some test failed: wrong output, runtime error, time,
memory or output limit of the *program*: those are judgements about the program), NO_ANSWER
(no code block), ERROR (the reference is malformed or the sandbox itself failed: the
reward could not be computed). `detail` names the first failing test and why.
"""

from __future__ import annotations

import atexit
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from areal.sandbox.client import Sandbox
from areal.sandbox.code_problems import (
    CALL_DRIVER,
    CodeProblem,
    ProblemFormatError,
    TestCase,
    parse_problem,
    stdout_matches,
    values_match,
)
from areal.sandbox.result import ExecResult, ExecStatus
from areal.sandbox.spec import PYTHON, Language, Limits
from areal.tasks.base import RewardOutcome, Verdict

_FENCE_RE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
LANGUAGE_TAGS = {
    "python": ("python", "python3", "py"),
    "python-exec": ("python", "python3", "py"),
    "cpp": ("cpp", "c++", "cc", "cxx"),
}


@dataclass(frozen=True, kw_only=True)
class CodeRewardConfig:
    language: Language = PYTHON
    """How programs run; call-style tests need a Python language."""
    time_limit_s: float = 4.0
    """Wall-clock (and CPU) seconds per test, unless the problem gives its own."""
    memory_bytes: int = 1 << 30
    """Address-space limit per test run."""
    partial_credit: bool = False
    """Reward the fraction of tests passed instead of all-or-nothing."""
    stop_on_first_failure: bool = True
    """Skip the remaining tests after a failure (they count as failed)."""
    float_tolerance: float | None = None
    """Compare numeric tokens within this absolute/relative tolerance (None: exact text)."""
    max_tests: int | None = None
    """Run at most this many tests (the first ones); None runs all."""


def extract_code(completion: str, tags: tuple[str, ...] = LANGUAGE_TAGS["python"]) -> str | None:
    """The last fenced block tagged with one of `tags`, else the last untagged block."""
    blocks = [(m.group(1).strip().lower(), m.group(2)) for m in _FENCE_RE.finditer(completion)]
    for wanted in (lambda tag: tag in tags, lambda tag: tag == ""):
        chosen = [code for tag, code in blocks if wanted(tag)]
        if chosen and chosen[-1].strip():
            return chosen[-1]
    return None


@dataclass(frozen=True)
class _Prepared:
    problem: CodeProblem
    code: str
    tests: tuple[TestCase, ...]
    limits: Limits


def _prepare(
    completion: str, reference: Any, config: CodeRewardConfig
) -> _Prepared | RewardOutcome:
    try:
        problem = parse_problem(reference)
    except (ProblemFormatError, KeyError, TypeError) as exc:
        return RewardOutcome(reward=0.0, verdict=Verdict.ERROR, detail=f"bad code reference: {exc}")
    if problem.fn_name and not config.language.name.startswith("python"):
        return RewardOutcome(
            reward=0.0,
            verdict=Verdict.ERROR,
            detail=f"call-style tests need Python, not {config.language.name}",
        )
    code = extract_code(
        completion, LANGUAGE_TAGS.get(config.language.name, (config.language.name,))
    )
    if code is None:
        return RewardOutcome(reward=0.0, verdict=Verdict.NO_ANSWER, detail="no fenced code block")
    wall = problem.time_limit_s or config.time_limit_s
    limits = Limits(wall_s=wall, cpu_s=wall, memory_bytes=config.memory_bytes)
    tests = problem.tests[: config.max_tests] if config.max_tests else problem.tests
    return _Prepared(problem=problem, code=code, tests=tests, limits=limits)


def _run_args(prep: _Prepared, test: TestCase, config: CodeRewardConfig) -> dict[str, Any]:
    if prep.problem.fn_name:
        return dict(
            source=CALL_DRIVER,
            stdin=json.dumps(test.input),
            argv=(prep.problem.fn_name,),
            files={"solution.py": prep.code.encode()},
            limits=prep.limits,
            language=config.language,
        )
    return dict(
        source=prep.code, stdin=str(test.input), limits=prep.limits, language=config.language
    )


def _judge(prep: _Prepared, test: TestCase, result: ExecResult, config: CodeRewardConfig) -> str:
    """'' if the test passed, else why it failed."""
    if result.status is not ExecStatus.OK:
        tail = result.stderr_text.strip().splitlines()[-1:] or [""]
        return f"{result.status.value} ({result.detail}) {tail[0][:200]}".strip()
    if prep.problem.fn_name:
        try:
            value = json.loads(result.stdout_text)
        except ValueError:
            return (
                f"{ExecStatus.WRONG_ANSWER.value}: result is not JSON: {result.stdout_text[:100]!r}"
            )
        if values_match(
            value,
            test.output,
            float_tolerance=config.float_tolerance,
            singleton_wrapped=prep.problem.singleton_wrapped,
        ):
            return ""
        return f"{ExecStatus.WRONG_ANSWER.value}: returned {_short(value)}, expected {_short(test.output)}"
    if stdout_matches(result.stdout_text, str(test.output), config.float_tolerance):
        return ""
    return (
        f"{ExecStatus.WRONG_ANSWER.value}: printed {_short(result.stdout_text)}, "
        f"expected {_short(test.output)}"
    )


def _short(value: Any, size: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return repr(text[:size] + ("..." if len(text) > size else ""))


@dataclass
class _Tally:
    prep: _Prepared
    config: CodeRewardConfig
    num_passed: int = 0
    first_failure: str = ""

    def record(self, index: int, test: TestCase, result: ExecResult) -> bool:
        """Count one test; False when the remaining tests should be skipped."""
        if result.status.is_error():
            raise _SandboxFailed(f"test {index + 1}: {result.detail}")
        why = _judge(self.prep, test, result, self.config)
        if not why:
            self.num_passed += 1
            return True
        if not self.first_failure:
            self.first_failure = (
                f"test {index + 1}/{len(self.prep.tests)} failed: {why}; input {_short(test.input)}"
            )
        return not self.config.stop_on_first_failure

    def outcome(self) -> RewardOutcome:
        total = len(self.prep.tests)
        if self.num_passed == total:
            return RewardOutcome(
                reward=1.0, verdict=Verdict.OK, detail=f"passed {total}/{total} tests"
            )
        reward = self.num_passed / total if self.config.partial_credit else 0.0
        return RewardOutcome(
            reward=reward,
            verdict=Verdict.WRONG,
            detail=f"passed {self.num_passed}/{total}; {self.first_failure}",
        )


class _SandboxFailed(RuntimeError):
    pass


def code_reward(
    completion: str,
    reference: Any,
    *,
    config: CodeRewardConfig | None = None,
    sandbox: Sandbox | None = None,
) -> RewardOutcome:
    config = config or CodeRewardConfig()
    prep = _prepare(completion, reference, config)
    if isinstance(prep, RewardOutcome):
        return prep
    sandbox = sandbox or default_sandbox()
    tally = _Tally(prep, config)
    try:
        for index, test in enumerate(prep.tests):
            if not tally.record(index, test, sandbox.run(**_run_args(prep, test, config))):
                break
    except _SandboxFailed as exc:
        return RewardOutcome(reward=0.0, verdict=Verdict.ERROR, detail=f"sandbox failed: {exc}")
    return tally.outcome()


async def code_reward_async(
    completion: str,
    reference: Any,
    *,
    config: CodeRewardConfig | None = None,
    sandbox: Sandbox | None = None,
) -> RewardOutcome:
    config = config or CodeRewardConfig()
    prep = _prepare(completion, reference, config)
    if isinstance(prep, RewardOutcome):
        return prep
    sandbox = sandbox or default_sandbox()
    tally = _Tally(prep, config)
    try:
        for index, test in enumerate(prep.tests):
            if not tally.record(
                index, test, await sandbox.run_async(**_run_args(prep, test, config))
            ):
                break
    except _SandboxFailed as exc:
        return RewardOutcome(reward=0.0, verdict=Verdict.ERROR, detail=f"sandbox failed: {exc}")
    return tally.outcome()


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox (default config), started on first use, closed at exit."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
            _default.start()
            atexit.register(_default.close)
        return _default
