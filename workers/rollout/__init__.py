"""Rollout workers: interruptible generation with per-token versions and behaviour log-probs."""
