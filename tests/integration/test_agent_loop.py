"""An agent's tool loop with the official `openai` client, through a push+duplex router.

The agent defines a shell tool. On even turns it forces a call (``tool_choice``
``required``: grammar-constrained, so even random weights answer a valid call), runs
it and sends the result back as a ``tool`` message; on odd turns it lets the model
answer (``auto``, with the router's ``hermes`` tool-call parser and ``deepseek_r1``
reasoning parser: a random model's answer is all reasoning) and strips the reasoning
before sending the answer back, as Qwen3 and DeepSeek clients do. Every reply must
parse into the client's types, and each must be token for token the reply of a
colocated instance (same flags) given the same messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvduplex.server.cluster import LocalCluster
from kvduplex.server.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.skips import skip_module_without_nixl

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration

skip_module_without_nixl()

_PARSERS = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice",
            "--reasoning-parser", "deepseek_r1"]  # fmt: skip
_SERVE = ["serve", "--model", "tiny", "--num-blocks", "600", "--log-level", "warning"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "maxLength": 24}},
                "required": ["command"],
            },
        },
    }
]
NUM_TURNS = 6


@dataclass
class Rig:
    prefill: str
    decode: str
    reference: str
    router: str


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> Iterator[Rig]:
    p = cluster.start("prefill", [*_SERVE, "--role", "prefill"], free_port())
    d = cluster.start("decode", [*_SERVE, "--role", "decode"], free_port())
    ref = cluster.start("reference", [*_SERVE, "--role", "both", *_PARSERS], free_port())
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--model", "tiny", "--prefill", p.url, "--decode", d.url,
            "--return-mode", "push", *_PARSERS]  # fmt: skip
    router = cluster.start("router", args, free_port())
    cluster.wait_healthy(timeout_s=60)
    yield Rig(p.url, d.url, ref.url, router.url)


def _ask(client: Any, messages: list[dict[str, Any]], turn: int) -> tuple[Any, list[int]]:
    """One request; the parsed reply and its token ids (``return_token_ids``)."""
    resp = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice="required" if turn % 2 == 0 else "auto",
        parallel_tool_calls=False,  # a forced answer is one call, not an array of them
        max_tokens=96,
        temperature=0.0,
        extra_body={"return_token_ids": True, "session_id": "agent-loop"},
    )
    choice = resp.choices[0]
    return choice, list((choice.model_extra or {})["token_ids"])


def _without_call_ids(message: Any) -> dict[str, Any]:
    """The reply as parsed, but for the tool calls' ids (each server makes its own)."""
    out = dict(message.model_dump(exclude_none=True))
    out["tool_calls"] = [
        {k: v for k, v in call.items() if k != "id"} for call in out.get("tool_calls", [])
    ]
    return out


def test_a_tool_loop_through_push_and_duplex_matches_colocated(rig: Rig) -> None:
    agent = openai.OpenAI(base_url=rig.router + "/v1", api_key="unused", max_retries=0)
    colocated = openai.OpenAI(base_url=rig.reference + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the shell tool."},
        {"role": "user", "content": "Find why the build fails and fix it."},
    ]
    for turn in range(NUM_TURNS):
        choice, ids = _ask(agent, messages, turn)
        ref_choice, ref_ids = _ask(colocated, messages, turn)
        assert ids == ref_ids, f"turn {turn}: the router's answer is not colocated's"
        message = choice.message
        assert _without_call_ids(message) == _without_call_ids(ref_choice.message), turn
        if turn % 2 == 0:  # a forced call: valid arguments for the tool's schema
            assert choice.finish_reason == "tool_calls", (turn, message)
            assert message.tool_calls, turn
            call = message.tool_calls[0]
            assert call.function.name == "run_shell"
            args = json.loads(call.function.arguments)
            assert isinstance(args["command"], str) and len(args["command"]) <= 24
            messages.append(message.model_dump(exclude_none=True))
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": f"exit 1: step {turn}"}
            )
        else:  # the parser split the answer: all of a random model's text is reasoning
            assert message.tool_calls is None, turn
            reasoning = (message.model_extra or {}).get("reasoning_content")
            assert reasoning, f"turn {turn}: no reasoning_content"
            # The client strips the reasoning before sending the answer back.
            messages.append({"role": "assistant", "content": message.content or ""})
            messages.append({"role": "user", "content": f"Now try step {turn + 1}."})
    push = httpx.get(rig.decode + "/internal/kv/push/stats", timeout=10).json()
    assert push["num_received"] == NUM_TURNS and push["num_fallbacks"] == 0, push
    returns = httpx.get(rig.decode + "/internal/kv/return/stats", timeout=10).json()
    assert returns["num_offered"] >= 1 and returns["num_failed"] == 0, returns
    for url in (rig.prefill, rig.decode, rig.reference):
        assert_pool_clean(url)
