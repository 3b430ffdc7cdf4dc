"""Math reward: extract the final answer of a completion and check it against the reference
with `math-verify` (numbers, fractions, LaTeX, expressions, intervals, sets, matrices).

    math_reward(completion, reference) -> RewardOutcome      # safe from any thread

Extraction, in order: the last `\\boxed{...}`/`\\fbox{...}` (nested braces balanced), the last
"the (final) answer is ...", the last number. Equivalence runs in `MathVerifier` worker
processes, not in the caller: math-verify's own timeouts use SIGALRM, which only works in
a process's main thread, and sympy can spin or allocate without bound on a pathological
expression. A worker handles one check at a time in its main thread (math-verify's own
SIGALRM timeout armed as a backstop); the caller waits at most `timeout_s` and otherwise kills and
replaces the worker, so a check costs at most its timeout whatever the input. Identical or
numerically equal answers are settled in the caller without a worker. Only math-verify's
LaTeX extractor is used (answers are wrapped in a box anyway); its plain-expression
extractor feeds sympy's eval-based `parse_expr`. math-verify restricts that input to digits
and operators, so this is defence in depth, not the fix of a known hole.

Verdicts: OK/WRONG are judgements; NO_ANSWER when nothing could be extracted; TIMEOUT when
the worker ran out of time; ERROR when the reference itself cannot be parsed or a worker
failed (the reward could not be computed, which is not a wrong answer).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from areal.tasks.base import RewardOutcome, Verdict

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS_RE = re.compile(r"(?:final answer|the answer)\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_WORKER_BOOT = "from areal.sandbox.math_reward import _worker_main; _worker_main()"


@dataclass(frozen=True)
class Extraction:
    answer: str
    method: str
    """boxed, answer_is or last_number."""


def extract_answer(text: str) -> Extraction | None:
    """The final answer of a solution text, or None if it states none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return Extraction(boxed, "boxed")
    matches = _ANSWER_IS_RE.findall(text)
    if matches:
        answer = _tidy(matches[-1].splitlines()[0])
        if answer:
            return Extraction(answer, "answer_is")
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return Extraction(numbers[-1].replace(" ", ""), "last_number")
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (braces balanced) or `\\boxed x`, else None."""
    for match in reversed(list(_BOX_RE.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1 : i].strip()
            continue  # unbalanced (truncated completion): try an earlier box
        token = re.match(r"[^\s$]+", text[start:])
        if token:
            return token.group(0)
    return None


def _tidy(answer: str) -> str:
    answer = answer.strip().strip("*").strip()
    answer = re.sub(r"^\$+|\$+$", "", answer.rstrip(".").strip()).strip()
    boxed = last_boxed(answer)
    return boxed if boxed is not None else answer.rstrip(".").strip()


def _normalise(answer: str) -> str:
    answer = re.sub(r"\\[,!;: ]|\\left|\\right|\$|\s", "", answer)
    return answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")


def _as_number(answer: str) -> Fraction | None:
    text = (
        answer.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", answer) else answer
    )
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def quick_equal(answer: str, reference: str) -> bool:
    """Cheap, exact-only test: True means equal for sure; False means 'ask math-verify'."""
    a, r = _normalise(answer), _normalise(reference)
    if a == r:
        return True
    a_num, r_num = _as_number(a), _as_number(r)
    return a_num is not None and a_num == r_num


class MathVerifier:
    """A small pool of math-verify worker processes with a hard per-check timeout.

    Thread-safe: each check borrows an idle worker. Workers start on first use (importing
    math-verify takes about a second) and are replaced when killed for a timeout.
    """

    def __init__(
        self, *, num_workers: int = 2, memory_bytes: int = 4 << 30, startup_timeout_s: float = 120.0
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"MathVerifier num_workers={num_workers} must be >= 1")
        self.memory_bytes = memory_bytes
        self.startup_timeout_s = startup_timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(None)  # a slot whose worker is started on demand

    def check(self, answer: str, reference: str, *, timeout_s: float = 5.0) -> tuple[str, str]:
        """('equal'|'different'|'timeout'|'error', reason)."""
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive():
                worker = _Worker.start(self.memory_bytes, self.startup_timeout_s)
            status, reason = worker.ask(answer, reference, timeout_s)
            if status in ("timeout", "error") and not worker.alive():
                worker = None
            return status, reason
        except (OSError, ValueError) as exc:  # worker failed to start or broke the protocol
            if worker is not None:
                worker.kill()
            worker = None
            return "error", f"math worker failed: {exc}"
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


class _Worker:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @classmethod
    def start(cls, memory_bytes: int, startup_timeout_s: float) -> _Worker:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        worker = cls(proc)
        if worker._read_line(startup_timeout_s) != {"ready": True}:
            worker.kill()
            raise OSError(f"math worker did not start within {startup_timeout_s} s")
        return worker

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, answer: str, reference: str, timeout_s: float) -> tuple[str, str]:
        # math-verify's own SIGALRM timeout is only a backstop (3x): the caller's deadline
        # acts first, so a slow check is reported as a timeout, not as a wrong answer.
        request = {"answer": answer, "reference": reference, "timeout": int(3 * timeout_s) + 1}
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both PIPE
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read_line(timeout_s)
        if reply is None:
            self.kill()
            return "timeout", f"math-verify took longer than {timeout_s:g} s"
        return reply["status"], reply.get("reason", "")

    def _read_line(self, timeout_s: float) -> dict | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise OSError(f"math worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()


def _worker_main() -> None:
    """Worker loop: one JSON request per line on stdin, one reply per line on stdout."""
    import resource

    memory = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    from math_verify import LatexExtractionConfig, parse, verify

    # LaTeX extraction only: answers arrive boxed, and the plain-expression extractor would
    # hand (regex-restricted) model text to sympy's eval-based parse_expr. Defence in depth.
    latex_only = [LatexExtractionConfig()]
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        timeout = request["timeout"]
        try:
            gold = parse(f"\\boxed{{{request['reference']}}}", latex_only, parsing_timeout=timeout)
            pred = parse(f"\\boxed{{{request['answer']}}}", latex_only, parsing_timeout=timeout)
            if not gold:
                reply = {
                    "status": "error",
                    "reason": f"reference {request['reference']!r} does not parse",
                }
            elif not pred:
                reply = {"status": "different", "reason": "answer does not parse"}
            elif verify(gold, pred, timeout_seconds=timeout):
                reply = {"status": "equal"}
            else:
                reply = {"status": "different", "reason": f"{pred[-1]} != {gold[-1]}"}
        except Exception as exc:  # fault boundary: a sympy failure is this check's error
            reply = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier (two workers), created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
            atexit.register(_default.close)
        return _default


def math_reward(
    completion: str, reference: Any, *, timeout_s: float = 5.0, verifier: MathVerifier | None = None
) -> RewardOutcome:
    """1.0 if the completion's final answer equals `reference` (str or number), else 0.0."""
    reference_text = str(reference)
    boxed_reference = last_boxed(reference_text)
    reference_text = boxed_reference if boxed_reference is not None else reference_text
    if not reference_text.strip():
        return RewardOutcome(
            reward=0.0, verdict=Verdict.ERROR, detail="the reference answer is empty"
        )
    extraction = extract_answer(completion)
    if extraction is None:
        return RewardOutcome(reward=0.0, verdict=Verdict.NO_ANSWER, detail="no final answer found")
    said = f"{extraction.method} answer {extraction.answer[:200]!r}"
    if quick_equal(extraction.answer, reference_text):
        return RewardOutcome(reward=1.0, verdict=Verdict.OK, detail=said)
    status, reason = (verifier or default_verifier()).check(
        extraction.answer, reference_text, timeout_s=timeout_s
    )
    verdict = {"equal": Verdict.OK, "different": Verdict.WRONG, "timeout": Verdict.TIMEOUT}.get(
        status, Verdict.ERROR
    )
    detail = f"{said} vs reference {reference_text[:200]!r}" + (f": {reason}" if reason else "")
    return RewardOutcome(
        reward=1.0 if verdict is Verdict.OK else 0.0, verdict=verdict, detail=detail
    )
