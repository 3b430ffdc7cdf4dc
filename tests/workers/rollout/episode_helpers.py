"""Helpers of the episode tests, written once and run on each engine: a scripted
environment, the token runs of an episode, and the check of a weight update in the middle
of the second turn."""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_helpers import assert_close, random_prompts, recompute_logprobs

from areal.messages import EpisodeEnd
from areal.tasks.base import RewardOutcome, Verdict
from areal.tasks.environment import Environment, Episode, Observation, TurnRole
from areal.types import PROMPT_VERSION
from areal.workers.rollout.engine import DiskWeights, SamplingParams
from areal.workers.rollout.episode import OBSERVATION_LOGPROB, EpisodeResult, EpisodeRunner

DONE = RewardOutcome(reward=1.0, verdict=Verdict.OK)
ATOL = 1e-4


class ScriptedEnvironment(Environment):
    """Answers model turn i with `script[i]`: observation text, a RewardOutcome, an
    exception (raised), or a number (seconds to sleep). Records the episodes it saw."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__(task=None, tokenizer=None)
        self.script = script
        self.seen: list[Episode] = []
        self.was_last_turn: list[bool] = []
        self.answered = asyncio.Event()

    async def step(self, episode: Episode) -> Observation | RewardOutcome:
        self.seen.append(episode)
        self.was_last_turn.append(episode.is_last_turn)
        item = self.script[min(episode.num_model_turns, len(self.script)) - 1]
        self.answered.set()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, float):
            await asyncio.sleep(item)
        if isinstance(item, str):
            return Observation(text=item, num_tool_calls=1, num_tool_errors=item == "err\n")
        return item


def segments(result: EpisodeResult) -> list[tuple[bool, int]]:
    """(is model text, length) of each run of tokens with one loss-mask value."""
    out: list[tuple[bool, int]] = []
    for sampled in result.loss_mask:
        if out and out[-1][0] == sampled:
            out[-1] = (sampled, out[-1][1] + 1)
        else:
            out.append((sampled, 1))
    return out


async def check_update_in_turn_two(
    runner: EpisodeRunner,
    env: ScriptedEnvironment,
    new_weights,
    models,
    *,
    temperature: float = 1.0,
) -> None:
    """`env` scripted ["obs one\\n", "obs two\\n", DONE], turns of 60 tokens: weights v1
    arrive while turn 2 runs. Turn 1 is all v0, turn 2 switches from v0 to v1 inside, turn 3
    is all v1; observations are version -1, log-prob 0, loss mask False; every model
    token's log-prob is its own version's over prompt + turns + observations."""
    prompt = random_prompts(1, min_len=10, max_len=10, seed=5)[0]
    params = SamplingParams(max_new_tokens=300, temperature=temperature)
    episode = asyncio.create_task(runner.run("e0", prompt, params, prompt_id="p0", reference=7))
    await env.answered.wait()  # turn 1 is done; turn 2 is submitted next
    for _ in range(2000):
        if runner.generator.num_in_engine:
            break
        await asyncio.sleep(0.005)
    probe = await runner.generator.generate("probe", prompt, SamplingParams(max_new_tokens=6))
    assert len(probe.token_ids) == 6  # decoded in the same batches as turn 2
    assert await runner.generator.update_weights(DiskWeights(new_weights), 1) == 1
    result = await episode

    assert (result.end, result.outcome, result.num_turns) == (EpisodeEnd.ENVIRONMENT, DONE, 3)
    assert (result.num_tool_calls, result.num_interruptions) == (2, 1)
    obs_one = runner.tokenizer("obs one\n", add_special_tokens=False)["input_ids"]
    obs_two = runner.tokenizer("obs two\n", add_special_tokens=False)["input_ids"]
    assert segments(result) == [
        (True, 60),
        (False, len(obs_one)),
        (True, 60),
        (False, len(obs_two)),
        (True, 60),
    ]
    turn1, turn2, turn3 = (
        slice(0, 60),
        slice(60 + len(obs_one), 120 + len(obs_one)),
        slice(len(result.token_ids) - 60, None),
    )
    assert result.token_ids[60 : 60 + len(obs_one)] == obs_one
    assert result.versions[turn1] == [0] * 60 and result.versions[turn3] == [1] * 60
    switch = result.versions[turn2].index(1)
    assert switch > 0 and result.versions[turn2] == [0] * switch + [1] * (60 - switch)
    observed = [i for i, sampled in enumerate(result.loss_mask) if not sampled]
    assert {result.versions[i] for i in observed} == {PROMPT_VERSION}
    assert {result.logprobs[i] for i in observed} == {OBSERVATION_LOGPROB}
    for version, model in enumerate(models):
        positions = [i for i, v in enumerate(result.versions) if v == version]
        recomputed = recompute_logprobs(model, prompt, result.token_ids, temperature=temperature)
        assert_close(
            [result.logprobs[i] for i in positions],
            recomputed[positions],
            atol=ATOL,
            what=f"log-probs of version-{version} model tokens",
        )
    # The environment saw the turns as text, the prompt and the reference.
    last = env.seen[-1]
    assert [t.role for t in last.turns] == [TurnRole.MODEL, TurnRole.OBSERVATION] * 2 + [
        TurnRole.MODEL
    ]
    assert last.turns[1].text == "obs one\n" and last.reference == 7 and last.prompt_id == "p0"
    assert last.turns[2].token_ids == result.token_ids[turn2]
