"""MkDocs hooks of this site (mkdocs.yml `hooks:`).

1. The API pages: the package maps the top-level folders controller/, workers/, sandbox/ and
   sim/ into `areal.*` (pyproject.toml's package-dir), which mkdocstrings cannot follow from
   the source tree. So, when this module is loaded (before mkdocstrings looks for sources),
   build/api-src/areal/ is laid out as that package: links to areal/'s files and to the
   four folders.
2. The results pages: the benches write docs/results/<name>.md (bench/results_page.py) when
   they are run in full, so which pages exist depends on what was run. The marker
   `<!-- results-table -->` in a page becomes a table of every bench page: a link where the
   page exists, otherwise the command that writes it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
API_SOURCE = ROOT / "build" / "api-src" / "areal"
RESULTS = ROOT / "docs" / "results"

PAGES = [
    ("speedup", "Synchronous vs asynchronous training", "python bench/speedup.py --seeds 3"),
    (
        "ablation",
        "Staleness ablation: naive PPO vs decoupled PPO",
        "python bench/ablation.py --parallel 2",
    ),
    *[
        (f"cluster-{t}", f"Cluster simulation, table ({t})", "python bench/cluster.py")
        for t in "abcdef"
    ],
    (
        "cluster-g",
        "Cluster simulation, table (g): calibration against this machine",
        "python bench/cluster.py --calibrate",
    ),
    (
        "cluster-r",
        "Cluster simulation, table (r): the controller alone",
        "python bench/cluster.py --only r",
    ),
    (
        "cluster-s",
        "Cluster simulation, table (s): what staleness.strict costs",
        "python bench/cluster.py --only s",
    ),
    (
        "cluster-t",
        "Cluster simulation, table (t): the controller alone against completion length",
        "python bench/cluster.py --only t",
    ),
    (
        "cluster-q",
        "Cluster simulation, table (q): the controller alone against rollout.max_queued",
        "python bench/cluster.py --only q",
    ),
    (
        "cold_caches",
        "The controller's calls with cold caches",
        "python bench/cold_caches.py",
    ),
    ("chaos", "Faults injected into one run", "python bench/chaos.py"),
    ("soak", "Memory and open files over a long run", "python bench/soak.py --minutes 60"),
    ("sandbox", "Sandbox against a bare subprocess", "python bench/sandbox.py"),
    ("engines", "Inference engines on CPU", "python bench/engines.py"),
    ("engines-gpu", "Inference engines on a GPU", "python bench/engines.py --device cuda"),
    ("weight_sync", "Weight publication", "python bench/weight_sync.py"),
    (
        "agent_endpoint",
        "Agent endpoint against the in-process episode loop",
        "python bench/agent_endpoint.py",
    ),
    ("lora", "LoRA against full fine-tuning: publication and trainer", "python bench/lora.py"),
    (
        "lora_learning",
        "LoRA vs full fine-tuning on the default task",
        "python bench/lora_learning.py",
    ),
]
"""(page name, what it shows, the command that writes it)."""


def _lay_out_api_source() -> None:
    if API_SOURCE.exists():
        shutil.rmtree(API_SOURCE)
    API_SOURCE.mkdir(parents=True)
    for item in (ROOT / "areal").iterdir():
        if item.name != "__pycache__":
            (API_SOURCE / item.name).symlink_to(item)
    for name in ("controller", "workers", "sandbox", "sim"):
        (API_SOURCE / name).symlink_to(ROOT / name)


def results_table(base: str) -> str:
    """The markdown table of bench pages; links relative to the page at `base`."""
    rows = ["| results | page |", "|---|---|"]
    for name, what, command in PAGES:
        if (RESULTS / f"{name}.md").is_file():
            rows.append(f"| {what} | [{name}]({base}results/{name}.md) |")
        else:
            rows.append(f"| {what} | not run yet: `{command}` |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if "<!-- results-table -->" not in markdown:
        return markdown
    depth = page.file.src_uri.count("/")
    return markdown.replace("<!-- results-table -->", results_table("../" * depth))


_lay_out_api_source()
