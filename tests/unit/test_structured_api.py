"""Structured output through one instance's API (tiny preset, seeded random weights):
response_format json_object / json_schema and tool_choice required / named.

A random-weight model emits no JSON of its own (checked below), so every valid
answer here is the grammar's doing. Schemas bound their strings and integers:
a random model left free would write one string or number for ever.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from kvduplex.instance.server import Instance

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "vip": {"type": "boolean"},
            },
            "required": ["id", "vip"],
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                "top": {"type": "boolean"},
            },
            "required": ["query", "top"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture()
def client(instance: Instance) -> Iterator[TestClient]:
    with TestClient(instance.app) as c:
        yield c
    assert instance.async_engine.is_healthy, "a request took the engine down"
    stats = instance.async_engine.call(
        lambda e: (e.check_integrity(), e.block_pool.stats())
    ).result(10)[1]
    assert stats.num_in_use == 0, "a request left blocks in use"


def _chat(client: TestClient, content: str = "describe a pet", **fields: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 300,
        **fields,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(
    client: TestClient, content: str = "describe a pet", **fields: Any
) -> list[dict[str, Any]]:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 300,
        "stream": True, **fields,
    }  # fmt: skip
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_free_text_of_the_random_model_is_not_json(client: TestClient) -> None:
    """Without a grammar the same requests answer no JSON: the tests below would fail
    if the grammar were ignored."""
    for temperature in (0.0, 1.0):
        text = _chat(client, temperature=temperature, seed=3, max_tokens=60)["choices"][0][
            "message"
        ]["content"]
        assert not _is_json(text)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 1), (1.0, 2), (0.8, 7)])
def test_json_schema_answer_is_valid_against_the_schema(
    client: TestClient, temperature: float, seed: int | None
) -> None:
    body = _chat(client, temperature=temperature, seed=seed, response_format=_schema_format(PET))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema_rs.validate(PET, json.loads(choice["message"]["content"]))


def test_json_schema_stream_is_the_same_answer(client: TestClient) -> None:
    fields = {"temperature": 1.0, "seed": 5, "response_format": _schema_format(PET)}
    whole = _chat(client, **fields)["choices"][0]["message"]["content"]
    chunks = _stream(client, **fields)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema_rs.validate(PET, json.loads(text))


@pytest.mark.parametrize("seed", [None, 4])
def test_json_object_answer_is_an_object(client: TestClient, seed: int | None) -> None:
    temperature = 0.0 if seed is None else 1.0
    body = _chat(
        client, temperature=temperature, seed=seed, response_format={"type": "json_object"}
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_completions_take_a_response_format(client: TestClient) -> None:
    body = {"model": "tiny", "prompt": "pet:", "max_tokens": 300, "temperature": 0,
            "response_format": _schema_format(PET)}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    jsonschema_rs.validate(PET, json.loads(r.json()["choices"][0]["text"]))


def test_max_tokens_before_the_grammar_completes_is_length_with_the_partial_text(
    client: TestClient,
) -> None:
    full = _chat(client, temperature=0, response_format=_schema_format(PET))["choices"][0]
    cut = _chat(client, temperature=0, max_tokens=5, response_format=_schema_format(PET))[
        "choices"
    ][0]
    assert cut["finish_reason"] == "length"
    assert full["message"]["content"].startswith(cut["message"]["content"])
    assert len(cut["message"]["content"]) == 5  # one byte token each


def test_tool_calls_cut_by_max_tokens_stay_text_with_length(client: TestClient) -> None:
    body = _chat(
        client, "weather?", temperature=0, max_tokens=12, tools=TOOLS, tool_choice="required"
    )
    answer = body["choices"][0]
    assert answer["finish_reason"] == "length"
    assert answer["message"]["content"] == '[{"name":"ge' and "tool_calls" not in answer["message"]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_calls_cut_by_a_stop_string_stay_text_with_stop(
    client: TestClient, tool_choice: Any
) -> None:
    """The grammar ends an answer only once its calls are whole; a stop string can cut
    one short: that answer is text, finishing "stop" (never "tool_calls" with arguments
    that do not parse), whole or streamed."""
    fields = {"temperature": 0, "tools": TOOLS, "tool_choice": tool_choice,
              "parallel_tool_calls": False}  # fmt: skip
    full = _chat(client, "weather?", **fields)["choices"][0]["message"]["tool_calls"]
    arguments = full[0]["function"]["arguments"]
    stop = arguments[len(arguments) // 2 :]  # cuts the first call's arguments in two
    answer = _chat(client, "weather?", stop=[stop], **fields)["choices"][0]
    assert answer["finish_reason"] == "stop"
    assert "tool_calls" not in answer["message"]
    assert arguments[: len(arguments) // 2] in answer["message"]["content"]
    chunks = _stream(client, "weather?", stop=[stop], **fields)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def _check_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema_rs.validate(PARAMS[name], json.loads(call["function"]["arguments"]))


@pytest.mark.parametrize(("temperature", "seed"), [(1.0, 0), (1.0, 1)])
def test_tool_choice_required_answers_valid_tool_calls(
    client: TestClient, temperature: float, seed: int | None
) -> None:
    body = _chat(
        client, "weather?", temperature=temperature, seed=seed, tools=TOOLS, tool_choice="required"
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    _check_calls(choice["message"]["tool_calls"])


def test_tool_choice_required_without_parallel_calls_makes_one(client: TestClient) -> None:
    """Greedy, the random model would repeat one call until max_tokens; seed 3 samples five."""
    for temperature, seed in ((0.0, None), (1.0, 3)):
        body = _chat(client, "weather?", temperature=temperature, seed=seed, tools=TOOLS,
                     tool_choice="required", parallel_tool_calls=False)  # fmt: skip
        answer = body["choices"][0]
        assert answer["finish_reason"] == "tool_calls"
        assert len(answer["message"]["tool_calls"]) == 1
        _check_calls(answer["message"]["tool_calls"])


@pytest.mark.parametrize("name", ["get_weather", "search"])
def test_named_tool_choice_answers_one_call_to_it(client: TestClient, name: str) -> None:
    choice = {"type": "function", "function": {"name": name}}
    body = _chat(client, "go", temperature=1.0, seed=2, tools=TOOLS, tool_choice=choice)
    answer = body["choices"][0]
    assert answer["finish_reason"] == "stop"
    calls = answer["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == name
    _check_calls(calls)


def _streamed_calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assemble streamed tool-call deltas the way an OpenAI client does."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in (
            chunk["choices"][0]["delta"].get("tool_calls") or () if chunk["choices"] else ()
        ):
            call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
            for key in ("id", "type"):
                if key in delta:
                    call[key] = delta[key]
            fn = delta.get("function", {})
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    ("tool_choice", "reason"),
    [
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ],
)
def test_streamed_tool_calls_match_the_whole_answer(
    client: TestClient, tool_choice: Any, reason: str
) -> None:
    fields = {"temperature": 1.0, "seed": 6, "tools": TOOLS, "tool_choice": tool_choice}
    whole = _chat(client, "weather?", **fields)["choices"][0]["message"]["tool_calls"]
    chunks = _stream(client, "weather?", **fields)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == reason
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    calls = _streamed_calls(chunks)
    _check_calls(calls)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole
    ]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": _schema_format({"type": "objectx"})}, 'Unsupported type "objectx"'),
        ({"response_format": _schema_format({"type": "string", "pattern": "[a-"})}, "Regex"),
        ({"response_format": _schema_format({"$ref": "#/$defs/missing"})}, "missing"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
                ],
                "tool_choice": "required",
            },
            "schema cannot be used",
        ),
    ],
)
def test_bad_structured_requests_are_400(
    client: TestClient, fields: dict[str, Any], words: str
) -> None:
    for stream in (False, True):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "stream": stream,
            **fields,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], error
