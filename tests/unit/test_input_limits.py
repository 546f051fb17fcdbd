"""Hostile input on the OpenAI routes of an instance and of the router, in process.

A body past the cap is answered 413 before it is parsed (announced or chunked);
absurd values (max_tokens past the context, n > 1, out-of-range sampling
parameters, unknown fields, too many stop strings or stop token ids, prompts longer
than the context) are answered 400 in OpenAI error JSON, naming what to fix,
before the engine sees the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.engine.request import Request as EngineRequest
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.server import Instance
from kvduplex.instance.server import build_instance
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import probe_all
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances

CAP_MB = 1
CAP = CAP_MB << 20
P, D = "http://p0", "http://d0"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def instance() -> Iterator[Instance]:
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny"), cache=CacheConfig(kv_cache_mb=16))
    inst = build_instance(cfg, ServerConfig(port=0, max_body_mb=CAP_MB))
    try:
        yield inst
    finally:
        inst.async_engine.shutdown()


@pytest.fixture()
def engine_calls(instance: Instance, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Request ids the engine was given during the test; its pool is clean after."""
    calls: list[str] = []
    generate = instance.async_engine.generate

    def record(request: EngineRequest, *args: Any, **kwargs: Any) -> Any:
        calls.append(request.request_id)
        return generate(request, *args, **kwargs)

    monkeypatch.setattr(instance.async_engine, "generate", record)
    yield calls
    stats = instance.async_engine.call(lambda e: (e.check_integrity(), e.block_pool.stats()))
    assert stats.result(10)[1].num_in_use == 0


class FakeInstances:
    """Records the work that reaches the instances; D answers every request."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/health", "/ready"):  # the router's probes: not work
            return httpx.Response(200, json={"status": "ok", "max_model_len": CONTEXT})
        self.calls.append(str(request.url))
        if request.url.path == "/internal/push/prefill":
            return httpx.Response(200, json={"xid": json.loads(request.content)["xid"]})
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        return httpx.Response(200, json={"id": "cmpl-x", "choices": [choice]})


def _router(fake: FakeInstances, *, probed: bool = False) -> TestClient:
    """`probed`: the health probes have answered (so the router knows the context length)."""
    config = RouterConfig(prefill=(P,), decode=(D,), max_body_mb=CAP_MB)
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fake.handle))
    if probed:
        asyncio.run(probe_all(state.client, state.policy, timeout_s=1.0))
        assert state.policy.max_model_len() == CONTEXT
    return TestClient(create_router_app(state))


def _assert_error(resp: httpx.Response, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text[:300]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error", err
    for word in words:
        assert word in err["message"], err


def _padded(body: dict[str, Any], size: int) -> bytes:
    """`body` as JSON of exactly `size` bytes (trailing whitespace is valid JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def _chunks(data: bytes, num: int = 4) -> Iterator[bytes]:
    """`data` sent without a content-length, in pieces."""
    step = -(-len(data) // num)
    for i in range(0, len(data), step):
        yield data[i : i + step]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ],
)
def test_oversize_bodies_are_413_before_parsing(
    instance: Instance, engine_calls: list[str], path: str, body: dict[str, Any]
) -> None:
    fake = FakeInstances()
    not_json = b"{" + b"x" * CAP  # one byte past the cap; parsed, it would be a 400
    with TestClient(instance.app) as direct, _router(fake) as router:
        for client in (direct, router):
            for content in (not_json, _chunks(not_json)):
                resp = client.post(path, content=content, headers=JSON)
                _assert_error(resp, 413, f"{CAP_MB} MiB")
                assert resp.json()["error"]["code"] == "request_too_large"
        assert fake.calls == [] and engine_calls == []
        # A body of exactly the cap is read and served.
        for client in (direct, router):
            for content in (_padded(body, CAP), _chunks(_padded(body, CAP))):
                resp = client.post(path, content=content, headers=JSON)
                assert resp.status_code == 200, resp.text[:300]
    assert len(engine_calls) == 2 and fake.calls


PROMPT = {"model": "tiny", "prompt": "hi"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
CONTEXT = "maximum context length is 4096 tokens"
ABSURD: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {**PROMPT, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": "four"}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": [4]}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "n": 2}, "n=1"),
    ("/v1/completions", {**PROMPT, "n": 0}, "n=1"),
    ("/v1/completions", {**PROMPT, "best_of": 4}, "best_of"),
    ("/v1/completions", {**PROMPT, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**PROMPT, "temperature": 2.5}, "temperature"),
    ("/v1/completions", {**PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {**PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**PROMPT, "top_k": 0}, "top_k"),
    ("/v1/completions", {**PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {**PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {**PROMPT, "min_p": -0.1}, "min_p"),
    ("/v1/completions", {**PROMPT, "guided_choice": ["a"]}, "guided_choice: unknown field"),
    ("/v1/completions", {**PROMPT, "stop": ["x"] * 17}, "16 stop"),
    ("/v1/completions", {**PROMPT, "stop_token_ids": [1] * 257}, "stop_token_ids"),
    ("/v1/completions", {**PROMPT, "stop": 7}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": 3}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 3}, "n=1"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": None}, "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
]
"""Refused by validation: the router refuses them too, without calling an instance."""
PAST_CONTEXT: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {**PROMPT, "max_tokens": 10**18}, CONTEXT),
    ("/v1/completions", {**PROMPT, "max_tokens": 2**64}, CONTEXT),
    ("/v1/completions", {**PROMPT, "max_tokens": 4096}, CONTEXT),  # context minus prompt + 1
    ("/v1/completions", {"model": "tiny", "prompt": "a" * 5000, "max_tokens": 1}, CONTEXT),
    ("/v1/completions", {"model": "tiny", "prompt": [1] * 4096, "max_tokens": 1}, CONTEXT),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**18}, CONTEXT),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 4096}, CONTEXT),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "a" * 5000}]},
        CONTEXT,
    ),
]
"""Refused by the instance that knows its context length (the router forwards them)."""


@pytest.mark.parametrize(
    ("path", "body", "word"),
    ABSURD + PAST_CONTEXT,
    ids=[str(i) for i in range(len(ABSURD + PAST_CONTEXT))],
)
def test_absurd_values_are_400_before_the_engine(
    instance: Instance, engine_calls: list[str], path: str, body: dict[str, Any], word: str
) -> None:
    with TestClient(instance.app) as client:
        _assert_error(client.post(path, json=body), 400, word)
        _assert_error(client.post(path, json={**body, "stream": True}), 400, word)
    assert engine_calls == []


@pytest.mark.parametrize(("path", "body", "word"), ABSURD, ids=[str(i) for i in range(len(ABSURD))])
def test_router_refuses_absurd_values_without_calling_an_instance(
    path: str, body: dict[str, Any], word: str
) -> None:
    fake = FakeInstances()
    with _router(fake) as router:
        _assert_error(router.post(path, json=body), 400, word)
    assert fake.calls == []


def test_the_largest_request_that_fits_is_served(
    instance: Instance, engine_calls: list[str]
) -> None:
    """prompt + max_tokens == the context length is served (the bound is inclusive)."""
    with TestClient(instance.app) as client:
        ids = [1] * 4090
        resp = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6}
        )
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["usage"]["completion_tokens"] <= 6


CONTEXT = 128
"""The context length the fake instances' /health reports."""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [1] * 100, "max_tokens": 29}),
        ("/v1/completions", {"prompt": [1] * 200, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 200}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": 10**18}),
    ],
)  # fmt: skip
def test_router_refuses_requests_past_the_instances_context_before_dispatching(
    path: str, body: dict[str, Any], stream: bool
) -> None:
    fake = FakeInstances()
    with _router(fake, probed=True) as router:
        resp = router.post(path, json={"model": "m", **body, "stream": stream})
        _assert_error(resp, 400, f"maximum context length is {CONTEXT} tokens")
    assert fake.calls == []


def test_router_dispatches_the_largest_request_that_fits_the_context() -> None:
    fake = FakeInstances()
    with _router(fake, probed=True) as router:
        resp = router.post("/v1/completions", json={"model": "m", "prompt": [1] * 100, "max_tokens": 28})
        assert resp.status_code == 200, resp.text[:300]
    assert fake.calls
