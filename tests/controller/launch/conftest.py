"""The launcher tests use the controller tests' helpers (cli_runs.py, letter_task.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
