"""Reward workers: score finished trajectories concurrently with generation."""
