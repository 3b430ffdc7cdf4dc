"""Trainer workers: the decoupled PPO update and weight publishing."""
