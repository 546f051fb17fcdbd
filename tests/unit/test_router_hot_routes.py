"""The router's two POST routes served past FastAPI's request handling (`app.HotRoutes`):
a JSON body that validates is routed at once; every other request reaches FastAPI's
route as it came, and the answers are the same either way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.types import ASGIApp
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.router import app as app_module
from kvduplex.router.app import _is_plain
from tests.unit.test_router import BAD
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import _router

JSON = {"content-type": "application/json"}
PLUS_JSON = {"content-type": "application/merge-patch+json"}
"""JSON to FastAPI's routes (a ``+json`` type), not to `HotRoutes`: the reference path."""

GOOD = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
]


@contextmanager
def _counting_fastapi_routes(client: TestClient) -> Iterator[dict[str, int]]:
    """Requests that reached FastAPI's route for each POST path."""
    counts = {"/v1/completions": 0, "/v1/chat/completions": 0}
    app: Any = client.app
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path in counts:
            route.app = _counting(route.app, counts, route.path)
    yield counts


def _counting(app: ASGIApp, counts: dict[str, int], path: str) -> ASGIApp:
    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        counts[path] += 1
        await app(scope, receive, send)

    return counted


def _content(body: dict[str, Any] | bytes) -> bytes:
    return body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}).encode()


def _answer(r: Any) -> tuple[int, Any]:
    """Status and what the client read, less what differs between any two answers."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in r.text.splitlines() if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in lines]
        return r.status_code, [c["choices"] for c in chunks]
    body = r.json()
    for key in ("id", "created"):
        body.pop(key, None)
    return r.status_code, body


def test_a_request_that_validates_never_reaches_fastapis_route() -> None:
    with _router(FakeInstances()) as router, _counting_fastapi_routes(router) as counts:
        for path, body in GOOD:
            r = router.post(path, content=_content(body), headers=JSON)
            assert r.status_code == 200, r.text
        assert counts == {"/v1/completions": 0, "/v1/chat/completions": 0}
        r = router.post("/v1/completions", content=_content(GOOD[0][1]), headers=PLUS_JSON)
        assert r.status_code == 200, r.text  # FastAPI's route serves it all the same
        assert counts == {"/v1/completions": 1, "/v1/chat/completions": 0}


def test_a_body_that_fails_reaches_fastapis_route_whole() -> None:
    """Not JSON, or JSON that does not validate: FastAPI's route reads the body itself (it
    names the field at fault, so it read the body the client sent)."""
    with _router(FakeInstances()) as router, _counting_fastapi_routes(router) as counts:
        r = router.post("/v1/completions", content=b"{not json", headers=JSON)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "the request body is not valid JSON"
        r = router.post("/v1/completions", content=_content({"prompt": "x", "n": 3}), headers=JSON)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "n"
        assert counts == {"/v1/completions": 2, "/v1/chat/completions": 0}


CASES: list[tuple[str, Any]] = [*BAD, *GOOD]


@pytest.mark.parametrize(("path", "body"), CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_every_answer_is_fastapis_routes_own(path: str, body: dict[str, Any] | bytes) -> None:
    """Refused or served, through `HotRoutes` or FastAPI's route, the client reads the
    same answer (ids and timestamps aside); X-Request-ID is echoed either way."""
    fake = FakeInstances()
    with _router(fake) as router:
        hot = router.post(path, content=_content(body), headers={**JSON, "x-request-id": "r1"})
        reference = router.post(
            path, content=_content(body), headers={**PLUS_JSON, "x-request-id": "r1"}
        )
    assert _answer(hot) == _answer(reference)
    assert hot.headers["x-request-id"] == reference.headers["x-request-id"] == "r1"


def test_a_post_that_is_not_json_goes_to_fastapi() -> None:
    """Another content type, or none: FastAPI's route answers as it would (it does not
    read such a body as JSON)."""
    with _router(FakeInstances()) as router, _counting_fastapi_routes(router) as counts:
        content = _content(GOOD[0][1])
        for headers in ({"content-type": "text/plain"}, {}):
            r = router.post("/v1/completions", content=content, headers=headers)
            assert r.status_code == 400, r.text
        assert counts["/v1/completions"] == 2


def test_json_content_types_that_fastapi_reads_alike_take_the_hot_path() -> None:
    with _router(FakeInstances()) as router, _counting_fastapi_routes(router) as counts:
        for content_type in ("application/json; charset=utf-8", "Application/JSON"):
            headers = {"content-type": content_type}
            r = router.post("/v1/completions", content=_content(GOOD[0][1]), headers=headers)
            assert r.status_code == 200, r.text
        assert counts["/v1/completions"] == 0


def test_a_root_path_or_fastapis_telemetry_leaves_the_request_to_fastapi() -> None:
    """A ``root_path`` changes what path a route matches, and FastAPI's OpenTelemetry names
    its spans by the route it matched: either way FastAPI routes the request itself."""
    headers = [(b"content-type", b"application/json")]
    plain = {"type": "http", "headers": headers, "root_path": ""}
    assert _is_plain(plain)
    assert not _is_plain({**plain, "root_path": "/api"})
    assert not _is_plain({**plain, "fastapi.telemetry": object()})
    assert _is_plain({**plain, "fastapi.telemetry": None})  # a request it excluded
    assert not _is_plain({**plain, "headers": [(b"content-type", b"text/plain")]})


def test_an_unexpected_failure_on_the_hot_path_is_a_500_in_openai_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on FastAPI's route: the catch-all answers, X-Request-ID echoed."""

    async def failing(*args: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "route_request", failing)
    with _router(FakeInstances()) as router:
        headers = {**JSON, "x-request-id": "r2"}
        r = router.post("/v1/completions", content=_content(GOOD[0][1]), headers=headers)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "r2" in r.json()["error"]["message"] and r.headers["x-request-id"] == "r2"
