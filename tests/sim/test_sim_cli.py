"""python -m areal.sim: options in --help (the plan's too), a bad option named, one run reported."""

from __future__ import annotations

import os

import pytest

from areal.sim.__main__ import main


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("num_accelerators=128", "accelerator=h800", "eta=4", "gen_fraction=0.75"):
        assert name in out


def test_plan_help_shows_a_list_default_as_a_list(capsys):
    """A list option's default comes from a factory: the help shows the list, not the
    dataclass's placeholder for a missing default."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "rollout_tp=[]" in out and "eta_min=1" in out and "jobs=null" in out
    assert "MISSING" not in out


def test_a_bad_option_is_an_error_that_names_it(capsys):
    assert main(["num_accelerators=0"]) == 2
    assert "num_accelerators=0 must be >= 1" in capsys.readouterr().err


def test_a_small_question_gets_an_answer(capsys):
    assert (
        main(
            [
                "num_accelerators=8",
                "num_prompts=4",
                "group_size=2",
                "max_new_tokens=1024",
                "steps=3",
                "measure_from=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "8 x h800, model 1.5b, async" in out and "trained tokens/s" in out


def test_an_unknown_model_is_an_error_not_a_traceback(capsys):
    assert main(["model=70b"]) == 2
    assert "'70b' is not in models of the cost file" in capsys.readouterr().err
    assert main(["plan", "accelerator=tpu"]) == 2
    assert "'tpu' is not in accelerators of the cost file" in capsys.readouterr().err


def test_a_plan_that_could_not_be_written_fails_before_the_search(tmp_path, capsys):
    """out= is tried before minutes of simulations: a directory, or a place no file can be
    created in, is an error at once; a file created to find out is removed again."""
    assert main(["plan", f"out={tmp_path}"]) == 2
    assert "is a directory; give the file to write" in capsys.readouterr().err
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["plan", f"out={blocker / 'plan.yaml'}"]) == 2
    assert "cannot be written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_plan_to_a_fifo_is_refused_without_waiting_for_a_reader(tmp_path, capsys):
    """Opening a FIFO to write waits until something reads it: the check would hang."""
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    assert main(["plan", f"out={fifo}"]) == 2
    assert "is not a regular file; give the file to write" in capsys.readouterr().err
