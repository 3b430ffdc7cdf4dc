"""Dataset-backed tasks: every format loads from JSONL and Parquet, field mapping, bad rows
named by file and row, held-out splits, and the rewards on the shipped examples."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from areal.config import load_config
from areal.tasks import Verdict, load_task
from areal.tasks.data_files import DataFileError, RowError, read_rows
from areal.tasks.datasets import CodeTask, GSM8KTask, MathTask

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "examples" / "data"
GSM8K_TRAIN, GSM8K_TEST = DATA / "gsm8k_train.jsonl", DATA / "gsm8k_test.jsonl"
MATH_FILE, CODE_FILE = DATA / "math_train.jsonl", DATA / "code_problems.jsonl"


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- each format loads --------------------------------------------------------------------


def test_gsm8k_rows_give_the_number_after_the_hashes_as_reference():
    task = load_task("gsm8k", {"path": str(GSM8K_TRAIN), "eval_path": str(GSM8K_TEST)})
    assert isinstance(task, GSM8KTask)
    held = task.eval_prompts()
    rows = _lines(GSM8K_TEST)
    assert [p.reference for p in held] == [r["answer"].rsplit("####", 1)[1].strip() for r in rows]
    assert [p.prompt_id for p in held] == [f"eval:gsm8k_test.jsonl#{i}" for i in range(len(rows))]
    assert held[0].text.startswith(rows[0]["question"])
    train = list(task.train_prompts(seed=1))
    assert len(train) == len(_lines(GSM8K_TRAIN)) == task.counts["data/train_rows"]
    assert task.counts["data/skipped_rows"] == 0


def test_gsm8k_parquet_loads_like_jsonl_and_strips_thousands_separators(tmp_path):
    rows = _lines(GSM8K_TRAIN)[:6] + [{"question": "How many?", "answer": "So.\n#### 1,234"}]
    path = _parquet(tmp_path / "g.parquet", rows)
    task = GSM8KTask(path=str(path), eval_fraction=0.5, data_seed=3)
    prompts = task.eval_prompts() + list(task.train_prompts(0))
    assert len({p.prompt_id for p in prompts}) == 7
    assert [p.reference for p in prompts if p.text.startswith("How many?")] == ["1234"]


def test_math_rows_take_the_answer_field_or_the_last_boxed_answer_of_the_solution():
    task = MathTask(path=str(MATH_FILE), eval_fraction=0.25)
    prompts = task.eval_prompts() + list(task.train_prompts(0))
    by_id = {p.prompt_id.split(":", 1)[1]: p.reference for p in prompts}
    rows = _lines(MATH_FILE)
    assert len(by_id) == len(rows)
    for i, row in enumerate(rows):
        expected = row.get("answer")
        if expected is None:  # MATH style: only a solution, answer in the last box
            expected = {0: "7", 2: "\\frac{3}{4}", 10: "9\\pi"}.get(i)
        if expected is not None:
            assert by_id[f"math_train.jsonl#{i}"] == expected, i


def test_code_rows_in_canonical_apps_and_livecodebench_layouts_load_with_their_tests():
    task = CodeTask(path=str(CODE_FILE), eval_fraction=0.34)
    prompts = task.eval_prompts() + list(task.train_prompts(0))
    refs = {p.prompt_id.split("#")[1]: p.reference for p in prompts}
    assert set(refs["0"]) == {"tests"} and len(refs["0"]["tests"]) == 3
    assert set(refs["3"]) == {"input_output"}
    assert set(refs["5"]) == {"public_test_cases", "private_test_cases", "metadata"}
    texts = {p.prompt_id.split("#")[1]: p.text for p in prompts}
    assert "`twoSum`" in texts["5"] and "class Solution:" in texts["5"]  # starter code shown
    assert "standard input" in texts["0"]


def test_shipped_code_solutions_pass_their_tests_and_wrong_programs_fail():
    task = CodeTask(path=str(CODE_FILE), eval_fraction=0.34)
    rows = read_rows([str(CODE_FILE)])
    for row in rows:
        reference = task.format.example(row, {}).reference
        good = task.reward(f"Solution:\n```python\n{row.data['solution']}```", reference)
        assert good.verdict is Verdict.OK and good.reward == 1.0, (row.index, good.detail)
        bad = task.reward("```python\nprint('nope')\n```", reference)
        assert bad.verdict is Verdict.WRONG and bad.reward == 0.0, row.index
    assert task.reward("no code here", reference).verdict is Verdict.NO_ANSWER


@pytest.mark.slow
def test_math_reward_checks_the_final_answer_with_math_verify():
    task = MathTask(path=str(MATH_FILE))
    outcome = task.reward("so the answer is \\boxed{\\dfrac{6}{8}}", "\\frac{3}{4}")
    assert outcome.verdict is Verdict.OK
    assert task.reward("\\boxed{5/6}", "\\frac{5}{6}").reward == 1.0
    assert task.reward("\\boxed{7}", "8").verdict is Verdict.WRONG
    assert task.reward("I do not know", "8").verdict is Verdict.NO_ANSWER


def test_jsonl_with_types_arrow_cannot_unify_is_read_line_by_line(tmp_path):
    rows = [
        {"question": "Say hi.", "tests": [{"input": "", "output": "hi\n"}]},
        {
            "question": "Double it.",
            "fn_name": "double",
            "tests": [{"input": [2], "output": 4}, {"input": [2.5], "output": 5.0}],
        },
    ]
    task = CodeTask(path=str(_jsonl(tmp_path / "mixed.jsonl", rows)), eval_fraction=0.5)
    prompts = task.eval_prompts() + list(task.train_prompts(0))
    assert sorted(
        p.reference["tests"][0]["output"] for p in prompts if "fn_name" not in p.reference
    ) == ["hi\n"]
    call = next(p for p in prompts if "fn_name" in p.reference)
    assert call.reference["tests"][0] == {"input": [2], "output": 4}
    assert "`double`" in call.text


# ---- field mapping ------------------------------------------------------------------------


def test_fields_map_roles_to_other_columns(tmp_path):
    rows = [
        {"prompt_text": f"What is {i}+{i}?", "target": str(2 * i), "answer": "decoy"}
        for i in range(5)
    ]
    task = MathTask(
        path=str(_jsonl(tmp_path / "x.jsonl", rows)),
        eval_fraction=0.2,
        fields={"question": "prompt_text", "answer": "target", "solution": None},
    )
    prompts = task.eval_prompts() + list(task.train_prompts(0))
    assert sorted(p.reference for p in prompts) == sorted(str(2 * i) for i in range(5))


def test_verl_style_parquet_with_chat_messages_and_a_nested_ground_truth(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Compute {i}*3."}],
            "reward_model": {"ground_truth": str(3 * i), "style": "rule"},
        }
        for i in range(4)
    ]
    path = _parquet(tmp_path / "verl.parquet", rows)
    task = MathTask(
        path=str(path),
        eval_fraction=0.25,
        system_prompt="Be brief.",
        fields={"question": "prompt", "answer": "reward_model.ground_truth"},
    )
    (held,) = task.eval_prompts()
    i = int(held.reference) // 3
    assert held.text == f"Be brief.\n\nCompute {i}*3.\n"  # data's own turn, no instruction added


def test_unknown_roles_in_fields_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="unknown role.*qestion.*question, answer"):
        GSM8KTask(path=str(GSM8K_TRAIN), fields={"qestion": "q"})


# ---- bad rows -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task_cls, bad_row, reason",
    [
        (GSM8KTask, {"question": "How many?", "answer": "Five, I think."}, "no '#### <number>'"),
        (GSM8KTask, {"question": "", "answer": "#### 3"}, "no question"),
        (
            GSM8KTask,
            {"question": "How many?", "answer": "So.\n#### abc"},
            "is not a number ('abc')",
        ),
        (GSM8KTask, {"question": "How many?", "answer": None}, "no answer"),
        (MathTask, {"problem": "Find x.", "solution": "It is five."}, "no \\\\boxed"),
        (CodeTask, {"question": "Add.", "input_output": "{not json"}, "unusable tests"),
        (CodeTask, {"question": "Add.", "tests": []}, "unusable tests"),
    ],
)
def test_a_malformed_row_is_an_error_naming_the_file_and_row(tmp_path, task_cls, bad_row, reason):
    good = {
        GSM8KTask: {"question": "One plus one?", "answer": "#### 2"},
        MathTask: {"problem": "One plus one?", "answer": "2"},
        CodeTask: {"question": "Echo.", "tests": [{"input": "a\n", "output": "a\n"}]},
    }[task_cls]
    path = _jsonl(tmp_path / "data.jsonl", [good, good, bad_row, good])
    task = task_cls(path=str(path), eval_fraction=0.25)
    with pytest.raises(RowError) as info:
        task.eval_prompts()
    assert (info.value.path, info.value.row) == (str(path), 2)
    message = str(info.value)
    assert message.startswith(f"{path} row 2: ") and "on_bad_row=skip" in message
    assert reason.replace("\\\\", "\\") in message


def test_a_line_that_is_not_json_names_the_file_row_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "a", "answer": "#### 1"}\n\n{"question": "b" "answer": 2}\n')
    with pytest.raises(DataFileError, match=r"broken\.jsonl row 1 \(line 3\): not valid JSON"):
        GSM8KTask(path=str(path), eval_fraction=0.5).eval_prompts()


def test_empty_and_broken_files_are_errors_naming_the_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataFileError, match=r"empty\.jsonl holds no rows"):
        read_rows([str(tmp_path / "empty.jsonl")])
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataFileError, match=r"bad\.parquet: cannot be read as Parquet"):
        read_rows([str(tmp_path / "bad.parquet")])


def test_a_mapped_column_missing_from_the_file_is_a_row_error(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### 1"}] * 3)
    task = GSM8KTask(path=str(path), eval_fraction=0.34, fields={"answer": "label"})
    with pytest.raises(RowError, match=r"d\.jsonl row 0: no column 'label'.*columns: answer"):
        task.eval_prompts()


def test_skipped_rows_are_counted_and_logged_with_file_and_row(tmp_path, caplog):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(8)]
    rows[3]["answer"] = rows[6]["answer"] = "no number"
    path = _jsonl(tmp_path / "s.jsonl", rows)
    task = GSM8KTask(path=str(path), eval_fraction=0.2, on_bad_row="skip")
    with caplog.at_level(logging.WARNING, logger="areal.tasks.data_files"):
        held = task.eval_prompts()
    train = list(task.train_prompts(0))
    assert task.counts["data/skipped_rows"] == 2
    assert len(held) + len(train) == 6
    assert {p.reference for p in held + train} == {str(i) for i in (0, 1, 2, 4, 5, 7)}
    assert "skipped 2 of 8 rows" in caplog.text
    assert f"{path} row 3:" in caplog.text and f"{path} row 6:" in caplog.text


def test_bad_params_are_refused_at_construction():
    with pytest.raises(ValueError, match="on_bad_row='drop' is not one of error, skip"):
        GSM8KTask(path=str(GSM8K_TRAIN), on_bad_row="drop")
    with pytest.raises(ValueError, match="exclusive"):
        GSM8KTask(path=str(GSM8K_TRAIN), eval_path=str(GSM8K_TEST), eval_fraction=0.1)
    with pytest.raises(DataFileError, match="does not exist"):
        GSM8KTask(path="no/such/file.jsonl")
    with pytest.raises(DataFileError, match="unknown file kind '.csv'"):
        GSM8KTask(path="data.csv")
    with pytest.raises(ValueError, match="set task.params.path"):
        GSM8KTask()


# ---- splits and order ---------------------------------------------------------------------


def test_held_out_fraction_is_fixed_by_the_seed_and_disjoint_from_training():
    def split(seed):
        task = MathTask(path=str(MATH_FILE), eval_fraction=0.25, data_seed=seed)
        return (
            {p.prompt_id.split(":")[1] for p in task.eval_prompts()},
            {p.prompt_id.split(":")[1] for p in task.train_prompts(0)},
        )

    held, train = split(0)
    assert len(held) == 6 and len(train) == 18 and not held & train
    assert split(0) == (held, train)
    assert split(1)[0] != held


def test_training_order_is_reshuffled_per_seed_and_covers_every_row_once():
    task = GSM8KTask(path=str(GSM8K_TRAIN), eval_path=str(GSM8K_TEST))
    first, second = ([p.prompt_id for p in task.train_prompts(s)] for s in (0, 1))
    assert first != second and sorted(first) == sorted(second)
    assert len(set(first)) == len(first) == 24
    fixed = GSM8KTask(path=str(GSM8K_TRAIN), eval_path=str(GSM8K_TEST), shuffle=False)
    assert [p.prompt_id for p in fixed.train_prompts(5)] == [
        f"train:gsm8k_train.jsonl#{i}" for i in range(24)
    ]


def test_held_out_questions_are_removed_from_training(tmp_path):
    test_rows = _lines(GSM8K_TEST)
    train = _jsonl(tmp_path / "train.jsonl", _lines(GSM8K_TRAIN) + test_rows[:2])
    task = GSM8KTask(path=str(train), eval_path=str(GSM8K_TEST))
    held_texts = {p.text for p in task.eval_prompts()}
    assert not held_texts & {p.text for p in task.train_prompts(0)}
    assert task.counts["data/eval_overlap_dropped"] == 2


def test_an_eval_only_task_evaluates_but_has_no_training_prompts():
    task = GSM8KTask(eval_path=str(GSM8K_TEST))
    assert len(task.eval_prompts()) == 8
    with pytest.raises(ValueError, match="no training file"):
        next(task.train_prompts(0))


# ---- example configs ----------------------------------------------------------------------


@pytest.mark.parametrize("name, num_eval", [("gsm8k", 8), ("math", 6), ("code", 2)])
def test_example_configs_load_and_build_their_tasks(monkeypatch, tiny_model_dir, name, num_eval):
    monkeypatch.chdir(REPO)  # the examples name their data relative to the repository root
    cfg = load_config(REPO / "examples" / f"{name}.yaml", [f"model.path={tiny_model_dir}"])
    assert cfg.task.params["tokenizer_path"] == tiny_model_dir  # ${model.path} resolved
    task = load_task(cfg.task.name, cfg.task.params)
    assert len(task.eval_prompts()) == num_eval
    assert next(task.train_prompts(cfg.seed)).reference


def test_gpu_example_config_is_valid(monkeypatch, tiny_model_dir):
    cfg = load_config(
        REPO / "examples" / "gsm8k_qwen2.5_1.5b_vllm.yaml", [f"model.path={tiny_model_dir}"]
    )
    assert cfg.rollout.engine == "vllm" and cfg.task.name == "gsm8k"
    assert cfg.trainer.batch_size % cfg.task.group_size == 0
