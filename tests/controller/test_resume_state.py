"""Which checkpoint a resume starts from, and the prompt stream drawn again from it."""

from __future__ import annotations

import json
import pytest

from areal.controller.resume import STATE, ResumeState, find_state, write_state
from areal.controller.setup import RunSetup, _endless
from areal.tasks.base import Prompt
from areal.workers.trainer.checkpoint import META, checkpoint_dir


def _checkpoint(run_dir, step, *, trainer=True, controller=True, weights=True):
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    if trainer:
        (path / META).write_text(json.dumps({"step": step, "version": step}))
    if weights:
        (path / "weights").mkdir()
    if controller:
        write_state(ResumeState(step=step, version=step, drawn=3 * step, untrained=[step],
                                path=str(path)))
    return path


def test_the_newest_checkpoint_with_every_part_is_chosen(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 6, controller=False)  # the controller died before writing its part
    _checkpoint(tmp_path, 8, trainer=False)  # the trainer died while saving
    state = find_state(tmp_path)
    assert (state.step, state.drawn, state.untrained) == (4, 12, [4])
    assert state.weights == checkpoint_dir(tmp_path, 4).resolve() / "weights"
    assert (checkpoint_dir(tmp_path, 4) / STATE).is_file()
    assert not list(tmp_path.glob("checkpoints/*/*.tmp"))  # written atomically


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no complete checkpoint to resume from"):
        find_state(tmp_path)


class CountingTask:
    name = "counting"

    def train_prompts(self, seed):
        for i in range(5):  # a finite split: cycled, one epoch per seed
            yield Prompt(prompt_id=f"s{seed}-{i}", text=str(i), reference=str(i))


def _setup() -> RunSetup:
    setup = RunSetup(cfg=None, run_dir=None, task=CountingTask(), tokenizer=None,
                     eval_prompts=[], stop_token_ids=[])
    setup.tokenize = lambda prompt: [int(prompt.text)]
    setup._train_iter = _endless(setup.task, seed=0)
    return setup


def test_redraw_gives_untrained_prompts_first_then_continues_the_stream():
    original = _setup()
    drawn = [original._next_train_prompt_sync()[:2] for _ in range(12)]
    resumed = _setup()
    resumed.redraw(drawn=8, untrained=[3, 6, 7])
    assert resumed.requeued_positions() == [3, 6, 7]
    again = [resumed._next_train_prompt_sync()[:2] for _ in range(7)]
    assert again == [drawn[3], drawn[6], drawn[7], *drawn[8:12]]
    assert resumed.num_drawn == 12 and resumed.requeued_positions() == []


def test_the_summary_of_a_resumed_run_names_the_steps_it_trained():
    from areal.controller.report import summary_lines

    summary = {"eval_pass@1_before": 0.25, "eval_pass@1_after": 0.5, "steps": 6,
               "wall_time_s": 12.4, "mode": "async", "run_dir": "runs/x", "trained_tokens": 10,
               "trained_tokens_per_s": 2.0, "interruptions_total": 0}
    assert "run finished: 6 steps in 12 s" in summary_lines(summary)[1]
    summary["resumed_after_step"] = 4
    assert "run finished: steps 5-6 (resumed) in 12 s" in summary_lines(summary)[1]
