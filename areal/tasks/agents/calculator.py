"""The tool-arithmetic task as an agent: plain `openai` client code with a calculator tool
(examples/agent_calculator.yaml).

    messages = [user: "482*37=?\\n"]  --chat-->  tool call calculator(expression="482*37")
    the calculator runs here, in the agent   -->  a tool message "17834"
    --chat-->  "#17834"  -->  the run's task scores it (exact product after '#')

Nothing in it knows about training: it is what an agent written for any OpenAI-compatible
server looks like. On the embedded model (no chat template) the endpoint renders these
messages in the bracket format the model was warm-started on (areal.tasks.chat_render), so
the tokens are those of examples/tool_arithmetic.yaml's episodes.
"""

from __future__ import annotations

import json
from typing import Any

from areal.tasks.agent import AgentSample
from areal.tasks.base import RewardOutcome
from areal.tasks.tools import Calculator

CALCULATOR = Calculator()
MAX_CALLS = 3
"""Chat calls per problem: a tool call, then the answer, and one to spare."""


async def run(client: Any, sample: AgentSample) -> RewardOutcome:
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample.prompt}]
    answer = ""
    for _ in range(MAX_CALLS):
        completion = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR.definition()]
        )
        message = completion.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": await calculate(call.function.arguments),
                }
            )
    return await sample.score(answer)


async def calculate(arguments: str) -> str:
    """The calculator's answer to one call (an error text for arguments it cannot read)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return f"error: the arguments are not JSON: {arguments[:60]!r}"
    if not isinstance(parsed, dict):
        return "error: the arguments must be an object"
    return (await CALCULATOR.call(parsed)).text
