"""Console progress: a redrawn bar on a terminal, plain lines every N steps in a log."""

from __future__ import annotations

from areal.controller.metrics import ConsoleProgress


def test_a_log_gets_a_plain_line_every_n_steps_and_at_the_last(capsys):
    progress = ConsoleProgress(25, enabled=True, every=10, interactive=False)
    for step in range(1, 26):
        progress.update(step, {"reward_mean": 0.5, "loss": 0.012345})
        if step == 12:
            progress.write("evaluation: pass@1 0.42")
    progress.close()
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("train step")] == [
        "10/25",
        "20/25",
        "25/25",
    ]
    assert "evaluation: pass@1 0.42" in lines
    assert "reward_mean 0.5  loss 0.0123" in lines[0]
    assert "\r" not in out + err and "it/s" not in err  # no bar drawn, none repeated
    assert err == ""


def test_a_terminal_gets_the_bar_and_no_plain_lines(capsys):
    progress = ConsoleProgress(5, enabled=True, every=1, interactive=True)
    for step in range(1, 6):
        progress.update(step, {"loss": 1.0})
    progress.write("a line")
    progress.close()
    out, err = capsys.readouterr()
    assert "train step" not in out
    assert "a line" in out
    assert "5/5" in err  # tqdm's bar, on stderr


def test_progress_off_prints_only_the_lines_it_is_given(capsys):
    progress = ConsoleProgress(5, enabled=False, every=1, interactive=False)
    for step in range(1, 6):
        progress.update(step, {"loss": 1.0})
    progress.write("run finished")
    progress.close()
    out, err = capsys.readouterr()
    assert out == "run finished\n" and err == ""
