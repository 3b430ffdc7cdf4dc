"""The calculator agent (calculator.py) written with the OpenAI Agents SDK (`pip install
openai-agents`): the same task, a framework's agent loop, trained through the same endpoint.

    agent.function: areal.tasks.agents.calculator_sdk:run

The SDK is handed the episode's client (`OpenAIChatCompletionsModel`), so every model call
of its loop is a chat call of this episode; its tracing, which would send spans to OpenAI,
is turned off. The agent has no instructions: a system message would change the prompt the
embedded model was warm-started on (give it some for a chat model).
"""

from __future__ import annotations

from typing import Any

from areal.tasks.agent import AgentSample
from areal.tasks.base import RewardOutcome
from areal.tasks.tools import CalculatorError, evaluate_expression, format_number

MAX_TURNS = 3


def calculator(expression: str) -> str:
    """Evaluate one arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. 4821*37
    """
    try:
        return format_number(evaluate_expression(expression))
    except CalculatorError as err:
        return f"error: {err}"


async def run(client: Any, sample: AgentSample) -> RewardOutcome:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)
    agent = Agent(
        name="calculator",
        tools=[function_tool(calculator)],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    try:
        result = await Runner.run(agent, input=sample.prompt, max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        return await sample.score("")
    return await sample.score(str(result.final_output or ""))
