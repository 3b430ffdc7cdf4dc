"""Which checkpoint a resume starts from, the prompt stream drawn again from it, and what the
resumed run clears from the run directory first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal.controller.resume import (
    STATE,
    ResumeState,
    clear_after,
    find_state,
    kept_dropped_groups,
    previous_run,
    write_state,
)
from areal.controller.weight_retry import newest_on_disk
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
        write_state(
            ResumeState(step=step, version=step, drawn=3 * step, untrained=[step], path=str(path))
        )
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


def test_a_previous_run_is_its_records_weights_or_checkpoints(tmp_path):
    assert previous_run(tmp_path / "absent") == []
    (tmp_path / "config.yaml").write_text("seed: 1\n")  # a run that failed at set-up
    (tmp_path / "weights").mkdir()  # made, nothing published
    assert previous_run(tmp_path) == []
    _checkpoint(tmp_path, 2)
    assert previous_run(tmp_path) == ["checkpoints/"]
    (tmp_path / "weights" / "v000001").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    assert previous_run(tmp_path) == ["metrics.jsonl", "weights/", "checkpoints/"]


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no complete checkpoint to resume from"):
        find_state(tmp_path)


class CountingTask:
    name = "counting"

    def train_prompts(self, seed):
        for i in range(5):  # a finite split: cycled, one epoch per seed
            yield Prompt(prompt_id=f"s{seed}-{i}", text=str(i), reference=str(i))


def _setup() -> RunSetup:
    setup = RunSetup(
        cfg=None,
        run_dir=None,
        task=CountingTask(),
        tokenizer=None,
        eval_prompts=[],
        stop_token_ids=[],
    )
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


def test_a_prompt_being_drawn_is_not_counted_until_it_is_drawn():
    # A resume state written while the draw runs in its thread must still find the
    # position in the re-queued list or beyond num_drawn (it was lost on resume before).
    import asyncio
    import threading

    setup = _setup()
    setup.redraw(drawn=2, untrained=[1])
    release, entered = threading.Event(), threading.Event()
    tokenize = setup.tokenize

    def slow_tokenize(prompt):
        entered.set()
        release.wait(10)
        return tokenize(prompt)

    setup.tokenize = slow_tokenize

    async def main():
        seen = []
        for _ in range(2):  # the re-queued position 1, then the new position 2
            entered.clear()
            draw = asyncio.create_task(setup.next_train_prompt())
            await asyncio.to_thread(entered.wait, 10)
            seen.append((setup.num_drawn, setup.requeued_positions()))
            release.set()
            position, _, _ = await draw
            release.clear()
            seen.append((position, setup.num_drawn, setup.requeued_positions()))
        return seen

    assert asyncio.run(main()) == [(2, [1]), (1, 2, []), (2, []), (2, 3, [])]


def test_the_summary_of_a_resumed_run_names_the_steps_it_trained():
    from areal.controller.report import summary_lines

    summary = {
        "eval_pass@1_before": 0.25,
        "eval_pass@1_after": 0.5,
        "steps": 6,
        "wall_time_s": 12.4,
        "mode": "async",
        "run_dir": "runs/x",
        "trained_tokens": 10,
        "trained_tokens_per_s": 2.0,
        "interruptions_total": 0,
    }
    assert "run finished: 6 steps in 12 s" in summary_lines(summary)[1]
    summary["resumed_after_step"] = 4
    assert "run finished: steps 5-6 (resumed) in 12 s" in summary_lines(summary)[1]


def _versions(run_dir, *versions):
    for version in versions:
        (run_dir / "weights" / f"v{version:06d}").mkdir(parents=True)
        (run_dir / "weights" / f"v{version:06d}" / "model.safetensors").write_text("")


def test_a_resume_removes_what_the_stopped_run_wrote_after_its_checkpoint(tmp_path):
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 8, controller=False)  # complete for the trainer, never resumable
    _versions(tmp_path, 3, 4, 6, 7)
    state = find_state(tmp_path)
    removed = clear_after(tmp_path, state)
    assert sorted(Path(p).name for p in removed) == ["step_000008", "v000006", "v000007"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000003", "v000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004"]
    assert clear_after(tmp_path, state) == []


def test_the_dropped_groups_a_resume_keeps_are_those_up_to_its_step(tmp_path):
    lines = [
        {"kind": "step", "step": s, "rollout/dropped_groups/reward_error": 1} for s in (1, 2, 3)
    ]
    lines += [
        {"kind": "event", "event": "resumed", "step": 1, "version": 1},
        {"kind": "step", "step": 2, "rollout/dropped_groups/stale": 2},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    state = ResumeState(step=2, version=2, drawn=0)
    assert kept_dropped_groups(tmp_path, state) == {"reward_error": 1, "stale": 2}
    assert kept_dropped_groups(tmp_path / "nowhere", state) == {}


def test_a_worker_gets_the_newest_weights_there_are(tmp_path):
    _versions(tmp_path, 3, 4, 9)
    latest = tmp_path / "weights" / "v000005"  # published, then deleted
    assert newest_on_disk(tmp_path, str(latest), 5) == (4, str(tmp_path / "weights/v000004"))
    (tmp_path / "weights" / "v000004" / "model.safetensors").unlink()  # a file deleted
    assert newest_on_disk(tmp_path, str(latest), 5)[0] == 3
    latest.mkdir()  # there again, but empty (its file deleted)
    assert newest_on_disk(tmp_path, str(latest), 5)[0] == 3
    (latest / "model.safetensors").write_text("")
    assert newest_on_disk(tmp_path, str(latest), 5) == (5, str(latest))
    assert newest_on_disk(tmp_path, str(latest), 5, below=5)[0] == 3  # 5 failed to load
    assert newest_on_disk(tmp_path / "nowhere", None, 5) is None
