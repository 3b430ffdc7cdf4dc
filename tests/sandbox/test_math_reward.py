"""Math reward: answer extraction, equivalence on known pairs, timeouts, thread safety."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from areal.sandbox.math_reward import MathVerifier, extract_answer, last_boxed, math_reward
from areal.tasks.base import Verdict


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(num_workers=2)
    yield v
    v.close()


def test_boxed_extraction_balances_nested_braces_and_takes_the_last():
    assert (
        last_boxed(r"first \boxed{1} then \boxed{\frac{a^{2}}{\sqrt{b}}} done")
        == r"\frac{a^{2}}{\sqrt{b}}"
    )
    assert last_boxed(r"\fbox{ 7 }") == "7"
    assert last_boxed(r"so $\boxed 5$.") == "5"
    assert last_boxed(r"\boxed{2} and a truncated \boxed{\frac{1}{") == "2"
    assert last_boxed("no box here") is None


@pytest.mark.parametrize(
    "text, answer, method",
    [
        (r"... therefore $\boxed{\{1, 2\}}$", r"\{1, 2\}", "boxed"),
        ("The answer is $\\frac{3}{4}$.", r"\frac{3}{4}", "answer_is"),
        ("**Final Answer:** 12", "12", "answer_is"),
        ("Thus the final answer is: (0, 1].\nCheck: fine.", "(0, 1]", "answer_is"),
        ("We get 3 apples, then 1,234 pears and finally -7.5", "-7.5", "last_number"),
        ("ratio 3 / 4", "3/4", "last_number"),
    ],
)
def test_answer_extraction_methods(text, answer, method):
    extraction = extract_answer(text)
    assert extraction is not None and (extraction.answer, extraction.method) == (answer, method)


def test_no_answer_is_its_own_verdict(verifier):
    outcome = math_reward("I am not sure how to proceed.", "4", verifier=verifier)
    assert outcome.verdict is Verdict.NO_ANSWER and outcome.reward == 0.0


EQUIVALENT = [
    ("4", "4"),
    ("4.0", "4"),
    ("\\frac{1}{2}", "0.5"),
    ("1/2", "\\frac12"),
    ("\\dfrac{3}{4}", "0.75"),
    ("-\\frac{2}{3}", "\\frac{-2}{3}"),
    ("1,000", "1000"),
    ("10\\%", "0.1"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("(x+1)^2", "x^2+2x+1"),
    ("a+b", "b+a"),
    ("x=3", "3"),
    ("3", "x = 3"),
    ("(0, 1]", "(0,1]"),
    ("[-1, 2)", "[-1,2)"),
    ("\\{1,2,3\\}", "\\{3,2,1\\}"),
    ("1,2", "\\{1, 2\\}"),
    ("\\pi", "3.14159265"),
    ("\\infty", "\\infty"),
    ("5 \\text{ cm}", "5"),
    ("\\$5", "5"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("e^{2}", "e^2"),
    ("\\frac{\\pi}{3}", "\\pi/3"),
    ("2^{10}", "1024"),
    ("0.333333", "\\frac{1}{3}"),
    ("\\left(2, 3\\right)", "(2,3)"),
    ("-0", "0"),
    ("\\text{(B)}", "B"),
]
DIFFERENT = [
    ("3", "4"),
    ("-3", "3"),
    ("0.5", "\\frac{1}{3}"),
    ("(0,1]", "[0,1]"),
    ("[1,2]", "[1, 2)"),
    ("\\{1,2\\}", "\\{1,2,3\\}"),
    ("x^2", "2x"),
    ("\\sqrt{2}", "2"),
    ("e^{i\\pi}", "1"),
    ("2\\pi", "\\pi"),
    ("1001", "1000"),
    ("\\frac{2}{3}", "0.67"),
    ("x+1", "x-1"),
    ("10", "100"),
    ("\\infty", "-\\infty"),
    ("12", "21"),
    ("0.1", "1"),
    ("\\sqrt{3}", "\\sqrt{2}"),
    ("B", "C"),
    ("2^{10}", "1000"),
]


@pytest.mark.parametrize("answer, reference", EQUIVALENT)
def test_equivalent_answers_get_reward_one(verifier, answer, reference):
    outcome = math_reward(
        f"Reasoning... so the result is $\\boxed{{{answer}}}$.", reference, verifier=verifier
    )
    assert (outcome.verdict, outcome.reward) == (Verdict.OK, 1.0), outcome.detail


@pytest.mark.parametrize("answer, reference", DIFFERENT)
def test_different_answers_get_reward_zero(verifier, answer, reference):
    outcome = math_reward(
        f"Reasoning... so the result is $\\boxed{{{answer}}}$.", reference, verifier=verifier
    )
    assert (outcome.verdict, outcome.reward) == (Verdict.WRONG, 0.0), outcome.detail


def test_boxed_answer_found_at_the_end_of_long_reasoning(verifier):
    steps = "\n".join(
        f"Step {i}: consider \\boxed{{{i}}} as a candidate, 3 + {i} = {3 + i}." for i in range(400)
    )
    text = f"{steps}\nPutting it together, the area is $\\boxed{{\\frac{{7}}{{2}}}}$ square units."
    assert len(text) > 20000
    assert math_reward(text, "3.5", verifier=verifier).verdict is Verdict.OK
    assert math_reward(text, "399", verifier=verifier).verdict is Verdict.WRONG


def test_reference_given_as_number_or_boxed_solution(verifier):
    assert math_reward("\\boxed{42}", 42, verifier=verifier).reward == 1.0
    assert (
        math_reward(
            "\\boxed{0.25}", r"Solution: ... hence \boxed{\frac14}.", verifier=verifier
        ).reward
        == 1.0
    )


def test_unusable_reference_is_an_error_not_a_wrong_answer(verifier):
    for reference in ("", "  ", "$$"):
        outcome = math_reward("\\boxed{\\frac{1}{2}}", reference, verifier=verifier)
        assert (
            outcome.verdict is Verdict.ERROR
            and outcome.reward == 0.0
            and "reference" in outcome.detail
        )


def test_answers_are_parsed_as_latex_never_evaluated_as_python(verifier, tmp_path):
    marker = tmp_path / "evaluated"
    payload = f"__import__('os').system('touch {marker}')"
    for text in (f"\\boxed{{{payload}}}", f"The answer is {payload}"):
        outcome = math_reward(text, "0", verifier=verifier)
        assert outcome.reward == 0.0 and outcome.verdict in (Verdict.WRONG, Verdict.ERROR)
    assert not marker.exists()


@pytest.mark.slow
def test_pathological_expression_times_out_and_the_verifier_recovers(verifier):
    outcome = math_reward("\\boxed{9^{9^{9^{9}}}-1}", "2", timeout_s=1.0, verifier=verifier)
    assert outcome.verdict is Verdict.TIMEOUT and outcome.reward == 0.0
    assert "longer than 1 s" in outcome.detail
    assert math_reward("\\boxed{\\frac{6}{4}}", "1.5", verifier=verifier).verdict is Verdict.OK


def test_checks_from_many_threads_agree(verifier):
    cases = [(f"\\boxed{{\\frac{{{n}}}{{2}}}}", str(n / 2), Verdict.OK) for n in range(1, 13)]
    cases += [(f"\\boxed{{{n}x}}", f"{n + 1}x", Verdict.WRONG) for n in range(1, 13)]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda c: math_reward(c[0], c[1], verifier=verifier), cases))
    assert [o.verdict for o in outcomes] == [c[2] for c in cases]
