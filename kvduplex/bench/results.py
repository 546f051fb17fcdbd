"""Where a benchmark's results go: JSON with provenance, Markdown, optional PNG."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
            cwd=Path(__file__).resolve().parent, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def provenance() -> dict[str, Any]:
    """Command line, git commit and machine facts, now (call it when the run starts)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": _git_commit(),
        "machine": platform.platform(),
        "processor": _cpu_model(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "mem_total_gib": _mem_total_gib(),
        "load_avg": load,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_results(directory: Path, name: str, data: dict[str, Any], table: str) -> Path:
    """Write <directory>/<name>.json and .md; return the JSON path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    (directory / f"{name}.md").write_text(table + "\n")
    return path
