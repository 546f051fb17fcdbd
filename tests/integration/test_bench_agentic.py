"""The multi-turn agentic benchmark's quick workload against a real tiny instance (``--url``)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvduplex.server.cluster import LocalCluster
from kvduplex.server.cluster import Process
from kvduplex.server.cluster import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def instance(cluster: LocalCluster) -> Process:
    args = ["serve", "--model", "tiny", "--num-blocks", "256", "--block-size", "16"]
    proc = cluster.start("instance", [*args, "--log-level", "warning"], free_port())
    cluster.wait_healthy(timeout_s=120)
    return proc


def test_quick_workload_against_an_endpoint(instance: Process, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvduplex", "bench", "--workload", "agentic", "--quick",
           "--url", instance.url, "--metrics-url", instance.url, "--no-progress",
           "--results-dir", str(tmp_path), "--name", "smoke"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert "Per turn index" in (tmp_path / "smoke.md").read_text()

    records = result["records"]
    assert len(records) == 2 * 2 * 3  # shapes x sessions x turns
    assert all(r["result"]["ok"] for r in records), [r["result"]["error"] for r in records]
    assert result["disaggregated"] == {"endpoint": False}
    for shape in ("agentic", "reasoning"):
        rows = [row for row in result["per_turn"] if row["shape"] == shape]
        assert [row["turn"] for row in rows] == ["0", "1", "2"]
        assert all(row["n"] == 2 and row["errors"] == 0 for row in rows)
        for session in (0, 1):
            turns = sorted(
                (r for r in records if r["shape"] == shape and r["session"] == session),
                key=lambda r: r["turn"],
            )
            for prev, cur in itertools.pairwise(turns):
                grown = prev["result"]["prompt_tokens"] + prev["result"]["completion_tokens"]
                assert cur["result"]["prompt_tokens"] == grown + cur["input_tokens"]
            assert all(r["result"]["completion_tokens"] == r["max_tokens"] for r in turns)
            # the warm-up session cached the shared system prompt (128 tokens, 8 blocks)
            assert all(r["result"]["cached_tokens"] >= 128 for r in turns)
