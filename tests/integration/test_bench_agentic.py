"""The multi-turn agentic benchmark's quick workload against a real tiny instance (``--url``),
in its default form, and in the agent form against one with a reasoning parser; the
coding-agent shape, scaled down and sized from the instance's pool."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvduplex.bench.conversation import AGENT_SERVER_FLAGS
from kvduplex.bench.conversation import TOOL_NAME
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port

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


def test_coding_agent_shape_sized_to_the_instances_pool(instance: Process, tmp_path: Path) -> None:
    """Tool outputs and answers at 1% of their size, 20-40 turns, sessions whose KV is half
    of the instance's pool (256 blocks of 16: 4,096 tokens, read from its /metrics)."""
    cmd = [sys.executable, "-m", "kvduplex", "bench", "--workload", "agentic",
           "--shapes", "coding_agent", "--length-scale", "0.01", "--oversubscription", "0.5",
           "--think-min", "0", "--think-max", "0", "--url", instance.url,
           "--metrics-url", instance.url, "--no-progress", "--results-dir", str(tmp_path),
           "--name", "coding"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "coding.json").read_text())
    (workload,) = result["workloads"]
    assert workload["shape"]["turns"] == [20, 40] and 80 <= workload["system_tokens"] <= 160
    plans = result["plans"]["coding_agent"]
    histories = [sum(t["input_tokens"] + t["answer_tokens"] for t in p["turns"]) for p in plans]
    kv = workload["system_tokens"] + sum(histories)
    assert kv >= 2048 > kv - histories[-1]  # the fewest sessions holding half the pool
    assert any("prefill pool's 4096 tokens" in n for n in result["notes"])

    records = result["records"]
    assert len(records) == sum(len(p["turns"]) for p in plans)
    assert all(r["result"]["ok"] for r in records), [r["result"]["error"] for r in records]
    for plan in plans:
        assert 20 <= len(plan["turns"]) <= 40
        turns = sorted((r for r in records if r["session"] == plan["index"]), key=lambda r: r["turn"])
        for prev, cur in itertools.pairwise(turns):
            grown = prev["result"]["prompt_tokens"] + prev["result"]["completion_tokens"]
            assert cur["result"]["prompt_tokens"] == grown + cur["input_tokens"]
    (sources,) = result["prompt_sources"]
    assert sources["role"] == "both" and sources["requests"] == len(records)
    tokens = sources["tokens"]
    mean_prompt = sum(r["result"]["prompt_tokens"] for r in records) / len(records)
    assert tokens["local_cache_hit"] > tokens["local_compute"] > 0  # the history is cached
    assert tokens["local_cache_hit"] + tokens["local_compute"] == pytest.approx(mean_prompt, rel=0.05)
    text = (tmp_path / "coding.md").read_text()
    assert "By turn (coding_agent" in text and "Prompt tokens by source" in text


@pytest.fixture(scope="module")
def reasoning_instance(cluster: LocalCluster) -> Process:
    args = ["serve", "--model", "tiny", "--num-blocks", "256", "--block-size", "16"]
    args += [*AGENT_SERVER_FLAGS, "--log-level", "warning"]
    proc = cluster.start("reasoning-instance", args, free_port())
    cluster.wait_healthy(timeout_s=120)
    return proc


def test_the_agent_form_sends_model_calls_back_and_strips_reasoning(
    reasoning_instance: Process, tmp_path: Path
) -> None:
    url = reasoning_instance.url
    cmd = [sys.executable, "-m", "kvduplex", "bench", "--workload", "agentic", "--quick",
           "--form", "agent", "--shapes", "agentic", "--url", url, "--metrics-url", url,
           "--no-progress", "--results-dir", str(tmp_path), "--name", "agent"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = json.loads((tmp_path / "agent.json").read_text())["records"]
    assert len(records) == 2 * 3 and all(r["result"]["ok"] for r in records)
    for r in records:
        message = r["result"]["message"]
        if r["turn"] % 2 == 0:  # the model's own call, under the tool's grammar
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == TOOL_NAME
            assert len(json.loads(call["function"]["arguments"])["command"]) <= 48
        else:  # the reasoning parser's split (the client then strips the reasoning)
            assert message["reasoning_content"] and not message.get("tool_calls")
    for session in (0, 1):
        turns = sorted((r for r in records if r["session"] == session), key=lambda r: r["turn"])
        for prev, cur in itertools.pairwise(turns):  # the history holds the previous turn
            assert cur["result"]["cached_tokens"] >= prev["result"]["prompt_tokens"] // 16 * 16
