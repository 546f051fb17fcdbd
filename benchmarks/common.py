"""Shared helpers of the benchmarks: pinning, provenance, JSON + Markdown output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "results"


def pin(cpus: set[int], num_threads: int) -> str:
    """Pin this process to `cpus` with `num_threads` torch threads; describe it."""
    import torch

    available = os.sched_getaffinity(0)
    use = cpus & available or available
    os.sched_setaffinity(0, use)
    torch.set_num_threads(num_threads)
    return f"pid {os.getpid()} on cpus {sorted(use)}, torch threads {num_threads}"


def provenance() -> dict[str, Any]:
    """Command line, git commit and machine of this run."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": commit,
        "machine": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_results(name: str, data: dict[str, Any], table: str) -> Path:
    """Write results/<name>.json and results/<name>.md; return the JSON path."""
    RESULTS.mkdir(exist_ok=True)
    data = {"provenance": provenance(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    (RESULTS / f"{name}.md").write_text(table + "\n")
    return path


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
