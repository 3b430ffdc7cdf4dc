"""A test agent (tests/controller/test_agent_run.py): two chat calls per episode, the
second a new conversation (so a second training segment), rewards per completion id."""

from __future__ import annotations


async def run(client, sample):
    first = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": sample.prompt}], max_tokens=6
    )
    second = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": sample.prompt + "again\n"}],
        max_tokens=6,
    )
    text = second.choices[0].message.content or ""
    return {first.id: 0.5, second.id: float(len(text) % 2)}
