"""Tool calls and reasoning parsed out of an instance's chat answers, in process.

The tiny model's random weights never write ``<tool_call>``, so the engine is
given a script (`tests.support.faults.ScriptedOutput`, its sample hook): its
sampler's tokens are replaced by the script's, and everything after the sampler
(stop checks, detokenizing, the API's parsing and rendering) runs as in service.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.openai.chat_output import AUTO_TOOL_CHOICE_ERROR
from kvduplex.common.openai.chat_output import RAW_OUTPUT_HEADER
from kvduplex.common.openai.parsing_config import ParsingConfig
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.server import Instance
from kvduplex.instance.server import InstanceParts
from kvduplex.instance.server import build_instance
from tests.support.faults import ScriptedOutput

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]
ARGS = {"city": "Paris", "when": {"day": "today"}}
SCRIPT = (
    "The user asks for weather.</think>Let me check."
    "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n</tool_call>"
)
"""What the model writes: the byte tokenizer's template ends with ``assistant\\n`` and
deepseek_r1 starts inside the think block (R1 writes no opening tag)."""


def _instance(parsing: ParsingConfig) -> Instance:
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny"), cache=CacheConfig(kv_cache_mb=16))
    script = InstanceParts(sample_hook=ScriptedOutput.of_text(SCRIPT, "tiny"))
    return build_instance(cfg, ServerConfig(port=0, **parsing.model_dump()), parts=script)


@pytest.fixture(scope="module")
def parsing_instance() -> Iterator[Instance]:
    inst = _instance(ParsingConfig(tool_call_parser="hermes", reasoning_parser="deepseek_r1", enable_auto_tool_choice=True))
    try:
        yield inst
    finally:
        inst.async_engine.shutdown()


@pytest.fixture()
def client(parsing_instance: Instance) -> Iterator[TestClient]:
    with TestClient(parsing_instance.app) as c:
        yield c


def _chat(**fields: object) -> dict:
    return {
        "model": "tiny", "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": TOOLS, "max_tokens": 200, **fields,
    }  # fmt: skip


def _streamed(client: TestClient, body: dict) -> tuple[list[dict], dict]:
    """The stream's chunks, and their deltas added up as a client adds them."""
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    content, reasoning, calls = "", "", {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for c in delta.get("tool_calls", []):
                if "id" in c:
                    calls[c["index"]] = {
                        "id": c["id"],
                        "type": c["type"],
                        "function": dict(c["function"]),
                    }
                else:
                    calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    message = {
        "role": "assistant",
        "content": content or None,
        "reasoning_content": reasoning or None,
    }
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return chunks, message


def test_answer_is_parsed_into_reasoning_content_and_calls(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "The user asks for weather."
    assert message["content"] == "Let me check."
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGS
    # The script and its end of sequence, counted as before: parsing changes no usage.
    assert body["usage"]["completion_tokens"] == len(SCRIPT) + 1


def test_stream_adds_up_to_the_whole_answer(client: TestClient) -> None:
    whole = client.post("/v1/chat/completions", json=_chat()).json()["choices"][0]["message"]
    chunks, streamed = _streamed(client, _chat(stream_options={"include_usage": True}))
    args = [c["function"].pop("arguments") for c in [*streamed["tool_calls"], *whole["tool_calls"]]]
    assert args[0] == args[1] == json.dumps(ARGS), "the model's own text of the arguments"
    for c in (*streamed["tool_calls"], *whole["tool_calls"]):
        c.pop("id")
    assert streamed == whole
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    assert all("role" not in c["delta"] for c in choices[1:])
    assert [c["finish_reason"] for c in choices].count("tool_calls") == 1
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert all("<" not in (c["delta"].get("content") or "") for c in choices), "markup leaked"
    announced = [t for c in choices for t in c["delta"].get("tool_calls", []) if "id" in t]
    assert len(announced) == 1 and announced[0]["function"]["name"] == "get_weather"
    fragments = [t for c in choices for t in c["delta"].get("tool_calls", []) if "id" not in t]
    assert len(fragments) > 3, "arguments stream as they come"
    assert chunks[-1]["usage"]["completion_tokens"] == len(SCRIPT) + 1


def test_a_call_cut_by_a_stop_string_is_content_and_ends_in_stop(client: TestClient) -> None:
    """stop ["Paris"] cuts the call inside its arguments: the answer is its text, markup
    included, with finish_reason "stop" (vLLM's answer to a call that does not parse);
    a stream has announced the call before the cut, and ends it as for max_tokens."""
    cut = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    r = client.post("/v1/chat/completions", json=_chat(stop=["Paris"]))
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == cut and "tool_calls" not in choice["message"]
    chunks, streamed = _streamed(client, _chat(stop=["Paris"]))
    [call] = streamed["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "'}
    assert streamed["content"] == "Let me check."
    reasons = [c["finish_reason"] for k in chunks for c in k["choices"] if c["finish_reason"]]
    assert reasons == ["stop"]


def test_tool_choice_none_is_not_parsed(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=_chat(tool_choice="none"))
    message = r.json()["choices"][0]["message"]
    # Reasoning is still split off (the reasoning parser reads every chat answer).
    assert message["content"] == SCRIPT.split("</think>")[1] and "tool_calls" not in message
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_raw_output_header_turns_parsing_off(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=_chat(), headers={RAW_OUTPUT_HEADER: "1"})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": SCRIPT}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_completions_are_not_parsed(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 200})
    assert r.json()["choices"][0]["text"] == SCRIPT


def test_without_parsers_answers_are_unchanged_and_auto_is_refused() -> None:
    inst = _instance(ParsingConfig())
    try:
        with TestClient(inst.app) as c:
            r = c.post("/v1/chat/completions", json=_chat())
            assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": SCRIPT}
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            chunks, streamed = _streamed(c, _chat())
            assert streamed == {"role": "assistant", "content": SCRIPT, "reasoning_content": None}
            assert len(chunks) == len(SCRIPT) + 1, "one chunk per token, as before"
            r = c.post("/v1/chat/completions", json=_chat(tool_choice="auto"))
            assert r.status_code == 400
            assert r.json()["error"]["message"] == AUTO_TOOL_CHOICE_ERROR
            assert r.json()["error"]["param"] == "tool_choice"
            # A router parses by its own flags: it may ask for auto here.
            headers = {RAW_OUTPUT_HEADER: "1"}
            r = c.post("/v1/chat/completions", json=_chat(tool_choice="auto"), headers=headers)
            assert r.status_code == 200
    finally:
        inst.async_engine.shutdown()
