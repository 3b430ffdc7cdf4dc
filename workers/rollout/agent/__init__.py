"""Bring your own agent: an OpenAI-compatible endpoint in each rollout worker (docs/design.md
section 11). `runner.py` runs the agents, `endpoint.py` serves HTTP, `session.py` turns
chat calls into training segments token for token, `protocol.py` is OpenAI's wire format."""
