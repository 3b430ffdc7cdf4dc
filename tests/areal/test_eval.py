"""`python -m areal.eval`: the record and table it produces from scored samples, its argument
checks, and a real run of the CLI on the tiny random checkpoint (engine + reward in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal.config import ConfigError, load_config
from areal.eval import Sample, append_record, format_table, main, make_record, requested_ks
from areal.tasks.base import Verdict

REPO = Path(__file__).resolve().parents[2]


def _samples(correct: list[list[bool]]) -> list[list[Sample]]:
    return [
        [
            Sample(
                prompt_id=f"p{i}",
                completion="x",
                num_tokens=3 + j,
                finish_reason="stop" if ok else "length",
                reward=float(ok),
                verdict=Verdict.OK if ok else Verdict.WRONG,
            )
            for j, ok in enumerate(group)
        ]
        for i, group in enumerate(correct)
    ]


def test_record_has_unbiased_pass_at_k_for_requested_and_power_of_two_k(tiny_model_dir):
    cfg = load_config(overrides=[f"model.path={tiny_model_dir}", "eval.temperature=0.7"])
    samples = _samples([[True, False, False], [False, False, False], [True, True, True]])
    record = make_record(cfg, samples, ks=[3], seconds=1.5, step=7)
    assert record["version"] == 7 and record["temperature"] == 0.7
    assert record["eval/pass@1"] == pytest.approx((1 / 3 + 0 + 1) / 3)
    assert record["eval/pass@2"] == pytest.approx((2 / 3 + 0 + 1) / 3)  # 1 - C(2,2)/C(3,2)
    assert record["eval/pass@3"] == pytest.approx((1 + 0 + 1) / 3)
    assert record["eval/verdicts"] == {"ok": 4, "wrong": 5}
    assert record["eval/truncated_fraction"] == pytest.approx(5 / 9)
    table = format_table(record)
    assert "pass@3" in table and "0.6667" in table and "ok 4, wrong 5" in table


def test_appended_record_is_an_eval_record_filed_under_its_step(tmp_path, tiny_model_dir):
    cfg = load_config(overrides=[f"model.path={tiny_model_dir}"])
    out = tmp_path / "run" / "metrics.jsonl"
    out.parent.mkdir()
    out.write_text(json.dumps({"kind": "step", "step": 1}) + "\n")
    append_record(out, make_record(cfg, _samples([[True]]), [], 0.1, step=4))
    append_record(out, make_record(cfg, _samples([[False]]), [], 0.1, step=None))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["kind"], r.get("step")) for r in lines] == [("step", 1), ("eval", 4), ("eval", None)]
    assert lines[1]["source"] == "areal.eval" and lines[1]["eval/pass@1"] == 1.0


def test_k_must_fit_the_number_of_samples():
    assert requested_ks("1, 4,4", 4) == [1, 4]
    with pytest.raises(ConfigError, match="k=5 is outside .1, num_samples=4.*--num-samples"):
        requested_ks("5", 4)
    with pytest.raises(ConfigError, match="comma-separated integers"):
        requested_ks("a", 4)


def test_cli_refuses_bad_arguments_with_status_2(tiny_model_dir, capsys):
    assert main(["--model", tiny_model_dir, "--run-dir", "a", "--output", "b"]) == 2
    assert main(["--model", tiny_model_dir, "--num-samples", "2", "--k", "3"]) == 2
    assert main(["--model", tiny_model_dir, "rollout.engine=vlm"]) == 2
    err = capsys.readouterr().err
    assert "not both" in err and "k=3" in err and "rollout.engine='vlm'" in err


@pytest.mark.slow
def test_cli_evaluates_a_tiny_checkpoint_on_a_held_out_fraction(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    monkeypatch.chdir(REPO)
    out, saved = tmp_path / "eval.jsonl", tmp_path / "samples.jsonl"
    rc = main(
        [
            "--model",
            tiny_model_dir,
            "--config",
            "examples/math.yaml",
            "--num-samples",
            "2",
            "--temperature",
            "1.0",
            "--output",
            str(out),
            "--save-samples",
            str(saved),
            "rollout.max_new_tokens=12",
            "eval.max_prompts=3",
        ]
    )
    assert rc == 0
    assert "pass@1" in capsys.readouterr().out
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert record["kind"] == "eval" and "step" not in record
    assert record["task"] == "math" and record["eval/num_problems"] == 3
    completions = [json.loads(x) for x in saved.read_text().splitlines()]
    assert len(completions) == 6
    assert all(
        c["num_tokens"] <= 12 and c["verdict"] in {v.value for v in Verdict} for c in completions
    )
    assert sum(c["verdict"] == "ok" for c in completions) / 6 == pytest.approx(
        record["eval/pass@1"]
    )


@pytest.mark.slow
def test_cli_runs_episodes_with_their_environment(tmp_path, tiny_model_dir, monkeypatch):
    """The environment answers every first turn with a program run in the sandbox
    (tests/controller/episode_env.py); the reward is the environment's."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "controller"))
    out, saved = tmp_path / "eval.jsonl", tmp_path / "samples.jsonl"
    rc = main(
        [
            "--model",
            tiny_model_dir,
            "--output",
            str(out),
            "--save-samples",
            str(saved),
            "task.name=letter_task:LetterTask",
            "task.params.num_eval=5",
            "episode.environment=episode_env:SandboxScriptEnvironment",
            "episode.max_turns=2",
            "episode.max_turn_tokens=8",
            "rollout.max_new_tokens=300",
        ]
    )
    assert rc == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    samples = {s["prompt_id"]: s for s in map(json.loads, saved.read_text().splitlines())}
    assert samples["eval-3"]["episode"]["end"] == "error"  # the scripted failure
    assert samples["eval-3"]["verdict"] == "error"
    assert samples["eval-4"]["episode"]["end"] == "turn_limit"
    assert "\n>42\n" in samples["eval-0"]["completion"]  # the sandbox's answer, in context
    assert samples["eval-1"]["episode"]["tool_errors"] == 1
    assert record["eval/tool_use_fraction"] == pytest.approx(4 / 5)
    assert record["eval/turns_mean"] > 1
