"""Tool calls and reasoning through a push router, against a colocated instance.

P and D (and the colocated reference) write a scripted answer
(`tests.support.faults.ScriptedOutput`, the sample hook of instances started by
the test launcher: the sampler's tokens replaced by the script's, all else as in
service) that opens with ``<think>``, reasons, and
calls a tool. The router parses with ``--tool-call-parser hermes
--reasoning-parser deepseek_r1 --enable-auto-tool-choice``, the reference with
the same flags; P and D have none (the router asks D for raw text). Prefill's
first token is ``<``, the first character of the think tag: streamed raw it
would show as content.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from httpx_sse import connect_sse

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.skips import skip_module_without_nixl
from tests.support.faults import Faults
from tests.support.faults import start_instance

pytestmark = pytest.mark.integration

skip_module_without_nixl()

ARGS = {"path": "/srv/data", "recursive": True, "depth": 2}
SCRIPT = (
    "<think>The user wants the files; list them.</think>Listing."
    "<tool_call>\n" + json.dumps({"name": "list_files", "arguments": ARGS}) + "\n</tool_call>"
)
PARSERS = [
    "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
    "--enable-auto-tool-choice",
]  # fmt: skip
SERVE = [
    "serve",
    "--model",
    "tiny",
    "--num-blocks",
    "160",
    "--block-size",
    "8",
    "--log-level",
    "warning",
]
TOOLS = [{"type": "function", "function": {"name": "list_files", "parameters": {"type": "object"}}}]
BODY = {
    "model": "tiny", "max_tokens": 300, "temperature": 0.0, "tools": TOOLS,
    "messages": [{"role": "user", "content": "Which files are in /srv/data, down to depth 2?"}],
}  # fmt: skip


@pytest.fixture(scope="module")
def urls(cluster: LocalCluster) -> dict[str, str]:
    script = Faults(scripted_output=SCRIPT)
    p = start_instance(cluster, "prefill", [*SERVE, "--role", "prefill"], free_port(), script)
    d = start_instance(cluster, "decode", [*SERVE, "--role", "decode"], free_port(), script)
    ref = start_instance(
        cluster, "reference", [*SERVE, "--role", "both", *PARSERS], free_port(), script
    )
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--mode", "push", "--model", "tiny", "--prefill", p.url, "--decode", d.url]
    router = cluster.start("router", [*args, *PARSERS], free_port())
    cluster.wait_healthy(timeout_s=60)
    return {"prefill": p.url, "decode": d.url, "reference": ref.url, "router": router.url}


@pytest.fixture(autouse=True)
def clean_pools(urls: dict[str, str]) -> Iterator[None]:
    yield
    for name in ("prefill", "decode", "reference"):
        assert_pool_clean(urls[name])


def _num_pushed(decode: str) -> int:
    return int(httpx.get(decode + "/internal/kv/push/stats", timeout=10).json()["num_received"])


def _streamed(url: str) -> tuple[list[dict], dict]:
    """The chunks of a streamed answer and the message they add up to (call ids left out)."""
    chunks = []
    with (
        httpx.Client(timeout=120) as http,
        connect_sse(
            http, "POST", url + "/v1/chat/completions", json={**BODY, "stream": True}
        ) as source,
    ):
        assert source.response.status_code == 200
        for event in source.iter_sse():
            if event.data != "[DONE]":
                chunks.append(json.loads(event.data))
    content, reasoning, calls = "", "", {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for c in delta.get("tool_calls", []):
            if "id" in c:
                assert c["id"].startswith("call_")
                calls[c["index"]] = {"type": c["type"], "function": dict(c["function"])}
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    message = {"content": content or None, "reasoning_content": reasoning or None}
    return chunks, {**message, "tool_calls": [calls[i] for i in sorted(calls)]}


def test_streamed_chat_through_push_router_is_parsed(urls: dict[str, str]) -> None:
    pushed = _num_pushed(urls["decode"])
    chunks, message = _streamed(urls["router"])
    assert _num_pushed(urls["decode"]) == pushed + 1, "the answer went through push"
    assert message == {
        "content": "Listing.",
        "reasoning_content": "The user wants the files; list them.",
        "tool_calls": [
            {"type": "function", "function": {"name": "list_files", "arguments": json.dumps(ARGS)}}
        ],
    }
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"]["role"] == "assistant"
    assert all("<" not in (c["delta"].get("content") or "") for c in choices), "markup leaked"
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert len({c["id"] for c in chunks}) == 1
    _, reference = _streamed(urls["reference"])
    assert message == reference


def test_whole_chat_through_push_router_is_parsed(urls: dict[str, str]) -> None:
    pushed = _num_pushed(urls["decode"])
    routed = httpx.post(urls["router"] + "/v1/chat/completions", json=BODY, timeout=120)
    assert routed.status_code == 200, routed.text
    assert _num_pushed(urls["decode"]) == pushed + 1
    reference = httpx.post(urls["reference"] + "/v1/chat/completions", json=BODY, timeout=120)
    for r in (routed.json(), reference.json()):
        [choice] = r["choices"]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == "Listing."
        assert message["reasoning_content"] == "The user wants the files; list them."
        [call] = message["tool_calls"]
        assert call["id"].startswith("call_") and call["function"]["name"] == "list_files"
        assert json.loads(call["function"]["arguments"]) == ARGS
        assert r["usage"]["completion_tokens"] == len(SCRIPT) + 1
    # tool_choice none: the router relays the text less its reasoning, no calls parsed.
    none = httpx.post(
        urls["router"] + "/v1/chat/completions", json={**BODY, "tool_choice": "none"}, timeout=120
    )
    assert none.json()["choices"][0]["message"]["content"] == SCRIPT.split("</think>")[1]
    assert none.json()["choices"][0]["finish_reason"] == "stop"
