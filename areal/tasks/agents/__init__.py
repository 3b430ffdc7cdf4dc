"""Agents shipped as examples of `agent.function` (areal.tasks.agent): plain `openai` client
code, trained through the rollout workers' endpoint (docs/guides/agents.md)."""
