"""The router parses routed chat answers (its own flags), prefill's first token included.

Fake instances (`tests.support.fake_instances`): P answers the push prefill with the
answer's first token, D streams the model's raw text one token per chunk (D's
copy of the first token in a chunk of its own, which names its id, as an
instance does when the router asks), or the whole raw answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvduplex.common.config import TransferMode as Mode
from kvduplex.common.openai.chat_output import AUTO_TOOL_CHOICE_ERROR
from kvduplex.common.openai.chat_output import RAW_OUTPUT_HEADER
from kvduplex.common.openai.parsing_config import ParsingConfig
from kvduplex.common.openai.render import FIRST_TOKEN_IDS_FIELD
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances

P, D = "http://p0", "http://d0"
ARGS = {"q": "kv cache", "k": 3}
SCRIPT = (
    "<think>Search first.</think>\n\n<tool_call>\n"
    + json.dumps({"name": "search", "arguments": ARGS})
    + "\n</tool_call>"
)
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


@dataclass
class FakePD:
    """P and D answering with `SCRIPT` (one byte, one token); records D's requests."""

    decode_headers: list[httpx.Headers] = field(default_factory=list)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"status": "ok"})
        body = json.loads(request.content)
        url = str(request.url)
        if url == P + "/internal/push/prefill":
            return httpx.Response(200, json={"xid": body["xid"], "first_token": ord(SCRIPT[0])})
        if url == P + "/internal/prefill":
            return httpx.Response(200, json={"xid": body["xid"], "block_ids": [0], "num_tokens": 3})
        if url.endswith("/internal/push/cancel"):
            return httpx.Response(200, json={"xid": body["xid"], "cancelled": True})
        assert url == D + "/v1/chat/completions", url
        self.decode_headers.append(request.headers)
        if not body.get("stream"):
            message = {"role": "assistant", "content": SCRIPT}
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            usage = {"prompt_tokens": 9, "completion_tokens": len(SCRIPT) + 1, "total_tokens": 0}
            return httpx.Response(
                200, json={"id": "chatcmpl-d", "choices": [choice], "usage": usage}
            )
        mark = bool((body.get("kv_transfer_params") or {}).get("mark_first_token"))
        headers = {"content-type": "text/event-stream", "x-request-id": "chatcmpl-d"}
        return httpx.Response(200, headers=headers, content=self._stream(mark))

    async def _stream(self, mark: bool) -> AsyncIterator[bytes]:
        steps = [*SCRIPT, ""]  # the last step: end of sequence, no text
        for i, text in enumerate(steps):
            delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
            finish = "stop" if i == len(steps) - 1 else None
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            chunk: dict[str, Any] = {"id": "chatcmpl-d", "object": "chat.completion.chunk"}
            chunk["choices"] = [choice]
            if mark and i == 0:
                chunk[FIRST_TOKEN_IDS_FIELD] = [ord(text)]
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b'data: {"id": "chatcmpl-d", "choices": [], "usage": {"completion_tokens": 7}}\n\n'
        yield b"data: [DONE]\n\n"


def _router(fake: FakePD, parsing: ParsingConfig, mode: Mode = Mode.PUSH) -> TestClient:
    config = RouterConfig(prefill=(P,), decode=(D,), mode=mode, **parsing.model_dump())
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fake.handle))
    return TestClient(create_router_app(state))


PARSING = ParsingConfig(tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)
BODY = {"messages": [{"role": "user", "content": "find kv"}], "tools": TOOLS, "max_tokens": 99}


def _stream(client: TestClient, body: dict) -> list[dict]:
    out = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_streamed_answer_is_parsed_from_its_first_token(mode: Mode) -> None:
    fake = FakePD()
    with _router(fake, PARSING, mode) as client:
        chunks = _stream(client, BODY)
    assert all(h.get(RAW_OUTPUT_HEADER) == "1" for h in fake.decode_headers), (
        "decode parses nothing"
    )
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    assert all("role" not in c["delta"] for c in choices[1:])
    assert all(FIRST_TOKEN_IDS_FIELD not in c for c in chunks)
    deltas = [c["delta"] for c in choices]
    # Prefill's first token is the "<" of "<think>": never sent as content.
    assert all("content" not in d for d in deltas), deltas
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Search first."
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "search"
    assert json.loads("".join(t["function"]["arguments"] for t in calls)) == ARGS
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"] == {"completion_tokens": 7}, "usage passes as it is"


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_whole_answer_is_parsed(mode: Mode) -> None:
    fake = FakePD()
    with _router(fake, PARSING, mode) as client:
        r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == "Search first."
    [call] = message["tool_calls"]
    assert (
        call["function"]["name"] == "search" and json.loads(call["function"]["arguments"]) == ARGS
    )
    assert r.json()["usage"]["completion_tokens"] == len(SCRIPT) + 1
    assert fake.decode_headers[-1].get(RAW_OUTPUT_HEADER) == "1"


def test_without_parsers_the_answer_is_relayed_raw_and_auto_is_refused() -> None:
    fake = FakePD()
    with _router(fake, ParsingConfig()) as client:
        chunks = _stream(client, BODY)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == SCRIPT
        r = client.post("/v1/chat/completions", json={**BODY, "tool_choice": "auto"})
        assert r.status_code == 400 and r.json()["error"]["message"] == AUTO_TOOL_CHOICE_ERROR
    assert len(fake.decode_headers) == 1, "refused at the router"
