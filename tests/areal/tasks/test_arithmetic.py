"""The embedded arithmetic task: determinism, split hygiene, exact reward, length tail."""

from __future__ import annotations

import itertools
import string

import msgpack
import numpy as np
import pytest

from areal.models.tiny import build_char_tokenizer
from areal.tasks import Verdict, load_task
from areal.tasks.arithmetic import ArithmeticTask, Problem


def _texts(prompts) -> list[str]:
    return [p.text for p in prompts]


def test_same_params_give_the_same_prompts_and_examples():
    a, b = ArithmeticTask(), ArithmeticTask()
    assert _texts(a.eval_prompts()) == _texts(b.eval_prompts())
    assert _texts(itertools.islice(a.train_prompts(3), 500)) == _texts(
        itertools.islice(b.train_prompts(3), 500)
    )
    assert a.sft_examples(3, 300) == b.sft_examples(3, 300)


def test_run_seed_changes_the_training_stream_but_not_the_held_out_split():
    task = ArithmeticTask()
    first = _texts(itertools.islice(task.train_prompts(1), 200))
    second = _texts(itertools.islice(task.train_prompts(2), 200))
    assert first != second
    assert _texts(ArithmeticTask(data_seed=0).eval_prompts()) == _texts(task.eval_prompts())
    assert _texts(ArithmeticTask(data_seed=1).eval_prompts()) != _texts(task.eval_prompts())


def test_golden_values_under_fixed_seeds():
    task = ArithmeticTask()
    first_eval = task.eval_prompts()[0]
    assert (first_eval.prompt_id, first_eval.text, first_eval.reference) == (
        "eval-0",
        "32+9*2=?\n",
        50,
    )
    assert Problem(17, 8, 5).trace() == "25+8*4\n33+8*3\n41+8*2\n49+8*1\n#57"
    assert Problem(3, 2, 1).trace() == "#5"


def test_held_out_prompts_are_distinct_and_never_trained_on():
    task = ArithmeticTask()
    held_out = set(_texts(task.eval_prompts()))
    assert len(held_out) == task.num_eval
    assert held_out.isdisjoint(_texts(itertools.islice(task.train_prompts(1), 20_000)))
    assert held_out.isdisjoint(ex.prompt.text for ex in task.sft_examples(1, 20_000))


def test_a_setting_too_small_for_its_held_out_split_is_refused():
    tiny_space = ArithmeticTask(min_k=2, max_k=2, max_a=1, max_d=1, num_eval=3)
    with pytest.raises(ValueError, match="num_eval=3"):
        tiny_space.eval_prompts()
    whole_space = ArithmeticTask(min_k=2, max_k=2, max_a=1, max_d=1, num_eval=2)
    with pytest.raises(ValueError, match="held-out split covers"):
        next(whole_space.train_prompts(0))


@pytest.mark.parametrize(
    "completion, verdict, reward",
    [
        ("25+8*4\n33+8*3\n41+8*2\n49+8*1\n#57", Verdict.OK, 1.0),
        ("#57", Verdict.OK, 1.0),
        ("49+8*1\n#57<|endoftext|>", Verdict.OK, 1.0),
        ("#57\n", Verdict.OK, 1.0),
        ("#057", Verdict.OK, 1.0),
        ("#58", Verdict.WRONG, 0.0),
        ("#-57", Verdict.WRONG, 0.0),
        ("25+8*4\n33+8*3", Verdict.NO_ANSWER, 0.0),
        ("", Verdict.NO_ANSWER, 0.0),
        ("#", Verdict.NO_ANSWER, 0.0),
        ("#5x", Verdict.NO_ANSWER, 0.0),
        ("#5#57", Verdict.NO_ANSWER, 0.0),
        ("#57 58", Verdict.NO_ANSWER, 0.0),
    ],
)
def test_reward_is_exact(completion, verdict, reward):
    outcome = ArithmeticTask().reward(completion, 57)
    assert (outcome.verdict, outcome.reward) == (verdict, reward), outcome.detail
    assert not outcome.verdict.is_error()


def test_every_sft_target_earns_reward_one():
    for task in (ArithmeticTask(), ArithmeticTask.long_tail()):
        examples = task.sft_examples(5, 2000)
        rewards = [task.reward(ex.completion, ex.prompt.reference) for ex in examples]
        assert all(r.verdict is Verdict.OK and r.reward == 1.0 for r in rewards)


def test_sft_direct_fraction_sets_the_share_of_bare_answers():
    for fraction in (0.0, 0.5, 1.0):
        examples = ArithmeticTask(sft_direct_fraction=fraction).sft_examples(0, 4000)
        bare = np.mean(
            [
                ex.completion.startswith("#") and ex.prompt.text.split("*")[1] != "1=?\n"
                for ex in examples
            ]
        )
        assert bare == pytest.approx(fraction, abs=0.03)
    # the problems do not depend on the fraction, only their completions
    assert [e.prompt for e in ArithmeticTask(sft_direct_fraction=0.0).sft_examples(0, 50)] == [
        e.prompt for e in ArithmeticTask(sft_direct_fraction=1.0).sft_examples(0, 50)
    ]


def test_texts_are_printable_ascii_and_one_token_per_character():
    tokenizer = build_char_tokenizer()
    allowed = set(string.printable) - set("\r\x0b\x0c")
    task = ArithmeticTask.long_tail()
    for ex in task.sft_examples(0, 200):
        text = ex.prompt.text + ex.completion
        assert set(text) <= allowed
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and tokenizer.unk_token_id not in ids


def test_references_are_plain_data():
    prompts = ArithmeticTask().eval_prompts()
    assert all(type(p.reference) is int for p in prompts)
    assert msgpack.unpackb(msgpack.packb([p.reference for p in prompts])) == [
        p.reference for p in prompts
    ]


def _completion_lengths(task: ArithmeticTask) -> np.ndarray:
    """Tokens of the reasoning completion (trace + EOS) of each training example."""
    examples = ArithmeticTask(**{**task.params(), "sft_direct_fraction": 0.0}).sft_examples(0, 5000)
    return np.array([len(ex.completion) + 1 for ex in examples])


def test_long_tail_setting_has_a_long_tail_of_completion_lengths():
    lengths = _completion_lengths(ArithmeticTask.long_tail())
    median, p90, p99 = np.percentile(lengths, [50, 90, 99])
    mean, std = lengths.mean(), lengths.std()
    skew = np.mean(((lengths - mean) / std) ** 3)
    print(f"long tail: median {median}, p90 {p90}, p99 {p99}, max {lengths.max()}, skew {skew:.2f}")
    assert p90 >= 4 * median and p99 >= 10 * median
    assert lengths.max() >= 300 and skew > 1.5
    # and the default setting is short and bounded, for the quick demo
    default = _completion_lengths(ArithmeticTask())
    assert default.max() <= 48 and np.percentile(default, 90) < 2 * np.median(default)


def test_load_task_builds_it_from_config_params_and_rejects_bad_ones():
    task = load_task("arithmetic", {"max_k": 9, "k_alpha": 1.0})
    assert isinstance(task, ArithmeticTask) and task.params()["max_k"] == 9
    with pytest.raises(ValueError, match="do not fit"):
        load_task("arithmetic", {"num_terms": 3})
    with pytest.raises(ValueError, match="min_k"):
        ArithmeticTask(min_k=5, max_k=2)
    with pytest.raises(ValueError, match="sft_direct_fraction"):
        ArithmeticTask(sft_direct_fraction=1.5)
