"""AReaL-py: fully asynchronous RL for language models on verifiable reasoning tasks.

`areal` is the dependency-light core (config, data types, messages, algorithms, models,
tasks). It starts no processes. The process roles live in `areal.controller`,
`areal.workers` and `areal.sandbox`, which are separate top-level folders of the source
tree mapped into this namespace at install time (see pyproject.toml).
"""

__version__ = "0.1.0"
