"""Worker processes (rollout, trainer, reward): stateless and replaceable; they join a controller."""
