"""Failures as OpenAI error JSON on an instance and on the router (in process): an
unexpected exception is a 500 that names the request and hides the traceback, bodies
nested too deeply are a 400 that says the limit, error bodies are ASCII."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvduplex.common.openai.prompt import PromptError
from kvduplex.common.openai.prompt import prompt_token_ids
from kvduplex.common.openai.protocol import MAX_NESTING_DEPTH
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import ChatMessage
from kvduplex.common.openai.protocol import ChatTool
from kvduplex.common.openai.protocol import FunctionDefinition
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.instance.server import Instance
from kvduplex.instance.state import Generation
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P
from tests.unit.test_router import _router

SECRET = "/srv/kvduplex/secret-path \u00fc"
"""What an unexpected exception says; a client must never see it."""


@pytest.fixture()
def direct(instance: Instance) -> Iterator[TestClient]:
    with TestClient(instance.app) as c:
        yield c


@pytest.fixture()
def routed() -> Iterator[TestClient]:
    with _router(FakeInstances()) as c:
        yield c


@pytest.fixture()
def router_state() -> Iterator[tuple[TestClient, RouterState]]:
    fake = FakeInstances()
    config = RouterConfig(prefill=(P,), decode=(D,))
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fake.handle))
    with TestClient(create_router_app(state)) as c:
        yield c, state


def _check_error(r: Any, status: int, err_type: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.content.isascii(), r.content
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == err_type
    return dict(error)


# ------------------------------------------------- unexpected exceptions


def test_an_unexpected_exception_on_an_instance_is_a_500_in_openai_json(
    direct: TestClient, instance: Instance, caplog: pytest.LogCaptureFixture
) -> None:
    async def fail(raw: object, gen: Generation) -> None:
        raise RuntimeError(SECRET)

    instance.state.prepare = fail
    try:
        with caplog.at_level(logging.ERROR, logger="kvduplex.common.openai.errors"):
            r = direct.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    finally:
        instance.state.prepare = None
    error = _check_error(r, 500, "server_error")
    assert error["code"] == "internal_error"
    assert "secret" not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
    (record,) = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
    rid = record.args[0]  # type: ignore[index]
    assert isinstance(rid, str) and rid.startswith("cmpl-") and rid in error["message"]
    assert record.exc_info is not None and SECRET in str(record.exc_info[1]), "logged in full"
    assert direct.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 200


def test_an_unexpected_exception_on_the_router_is_a_500_in_openai_json(
    router_state: tuple[TestClient, RouterState],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, state = router_state

    def fail(*args: object) -> None:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(state.policy, "route", fail)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with caplog.at_level(logging.ERROR, logger="kvduplex.common.openai.errors"):
        r = client.post("/v1/completions", json=body, headers={"x-request-id": "req-7"})
    error = _check_error(r, 500, "server_error")
    assert "req-7" in error["message"] and "secret" not in r.text and "Traceback" not in r.text
    assert r.headers["x-request-id"] == "req-7"
    assert any(rec.getMessage().startswith("request req-7 ") for rec in caplog.records)


def test_error_bodies_are_ascii_json(direct: TestClient, routed: TestClient) -> None:
    """An error message that quotes the client's input, non-ASCII (a lone surrogate
    even), is sent escaped."""
    for value in ("r\u00e9quired \U0001f600", "\ud800"):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": value,
        }
        for client in (direct, routed):
            r = client.post(
                "/v1/chat/completions", content=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )  # fmt: skip
            error = _check_error(r, 400, "invalid_request_error")
            assert "tool_choice" in error["message"]
    r = direct.post("/v1/completions", json={"model": "mod\u00e8le", "prompt": "hi"})
    assert "mod\u00e8le" in _check_error(r, 404, "invalid_request_error")["message"]


# ------------------------------------------------- nesting


def _nested(depth: int) -> str:
    """JSON text of an object nested `depth` levels deep."""
    return '{"a":' * depth + "1" + "}" * depth


def _tools_body(parameters: str) -> bytes:
    return (
        '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], '
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": '
        + parameters
        + "}}]}"
    ).encode()


def _arguments_body(arguments: str) -> bytes:
    call = '{"id": "c", "function": {"name": "f", "arguments": ' + arguments + "}}"
    return (
        '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "assistant", "content": "x", '
        '"tool_calls": [' + call + "]}]}"
    ).encode()


@pytest.mark.parametrize("depth", [10_000, 900, MAX_NESTING_DEPTH])
@pytest.mark.parametrize("where", ["tools", "arguments"])
def test_nesting_past_the_limit_is_a_400_that_says_it(
    direct: TestClient, routed: TestClient, depth: int, where: str
) -> None:
    """Depth 10,000 is past the JSON parser's reach, 900 within it but past the limit,
    and a tool schema at the limit (in the body) is one level too deep."""
    content = (_tools_body if where == "tools" else _arguments_body)(_nested(depth))
    for client in (direct, routed):
        r = client.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        error = _check_error(r, 400, "invalid_request_error")
        assert f"at most {MAX_NESTING_DEPTH} levels" in error["message"], error


def test_nesting_within_the_limit_is_served(direct: TestClient) -> None:
    # The body, tools, the tool, function, parameters: 5 levels before the schema's own.
    r = direct.post(
        "/v1/chat/completions",
        content=_tools_body(_nested(MAX_NESTING_DEPTH - 5)),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    args = json.dumps(_nested(5_000))  # JSON text of arguments: kept as text, not parsed
    r = direct.post(
        "/v1/chat/completions",
        content=_arguments_body(args),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "maximum context length" in r.text, "refused for its length"


def test_recursion_while_building_a_prompt_is_a_prompt_error() -> None:
    """A request that skipped validation (built in code) with a schema 10,000 deep: the
    template's recursion ends in PromptError (a 400), not in a RecursionError."""
    deep: dict[str, Any] = {}
    for _ in range(10_000):
        deep = {"a": deep}
    tool = ChatTool.model_construct(
        type="function", function=FunctionDefinition.model_construct(name="f", parameters=deep)
    )
    request = ChatCompletionRequest.model_construct(
        messages=[ChatMessage(role="user", content="x")], tools=[tool]
    )
    with pytest.raises(PromptError, match=f"within {MAX_NESTING_DEPTH} levels") as exc:
        prompt_token_ids(request, ByteTokenizer())
    assert exc.value.param == "tools"
