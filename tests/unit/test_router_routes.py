"""The router's routes answer as they did when FastAPI served them: every refusal and
answer to a set of odd and good requests, recorded from the router at 1034e55 (FastAPI's
routes and error handlers, `router_answers.json`: status, body less ids and timestamps,
``Allow``, the echoed X-Request-ID, the content type), is the same today."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvduplex.router import app as app_module
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import _router

RECORDED = json.loads((Path(__file__).parent / "router_answers.json").read_text())
"""Each case: ``[path, body, content type]`` (a POST) or ``[method, path, body, headers]``,
and what the client read."""

GOOD = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
]


def _content(body: dict[str, Any] | bytes | str) -> bytes:
    if isinstance(body, str):  # recorded as latin-1 text
        return body.encode("latin-1")
    return body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}).encode()


def _answer(r: Any) -> dict[str, Any]:
    """What the client read, less what differs between any two answers."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in r.text.splitlines() if line.startswith("data: {")]
        body: Any = [json.loads(line[6:])["choices"] for line in lines]
    else:
        try:
            body = r.json()
            for key in ("id", "created"):
                body.pop(key, None)
        except (ValueError, AttributeError):
            body = r.text
    return {"status": r.status_code, "body": body, "allow": r.headers.get("allow"),
            "rid": r.headers.get("x-request-id"), "ctype": r.headers.get("content-type")}  # fmt: skip


def _request(router: Any, case: list[Any]) -> Any:
    if len(case) == 3:  # a POST: path, body, content type
        path, body, content_type = case
        headers = {"content-type": content_type, "x-request-id": "r1"}
        return router.post(path, content=_content(body), headers=headers)
    method, path, body, headers = case
    return router.request(
        method, path, content=_content(body), headers={**headers, "x-request-id": "r1"}
    )


@pytest.mark.parametrize("recorded", RECORDED, ids=[str(i) for i in range(len(RECORDED))])
def test_every_answer_is_the_one_fastapi_gave(recorded: dict[str, Any]) -> None:
    with _router(FakeInstances()) as router:
        got = _answer(_request(router, recorded["case"]))
    assert got == {k: v for k, v in recorded.items() if k != "case"}


def test_json_content_types_that_fastapi_read_alike_are_served() -> None:
    with _router(FakeInstances()) as router:
        for content_type in ("application/json; charset=utf-8", "Application/JSON",
                             "application/merge-patch+json"):  # fmt: skip
            headers = {"content-type": content_type}
            r = router.post("/v1/completions", content=_content(GOOD[0][1]), headers=headers)
            assert r.status_code == 200, r.text


def test_a_root_path_is_below_the_routes() -> None:
    """Under a ``root_path`` (a proxy's prefix) the routes match the path below it."""
    with _router(FakeInstances()) as router, TestClient(router.app, root_path="/api") as proxied:
        r = proxied.get("/api/health")
    assert r.status_code == 200 and r.json()["role"] == "router"


def test_an_unexpected_failure_is_a_500_in_openai_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """The catch-all answers, X-Request-ID echoed."""

    async def failing(*args: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "route_request", failing)
    with _router(FakeInstances()) as router:
        headers = {"content-type": "application/json", "x-request-id": "r2"}
        r = router.post("/v1/completions", content=_content(GOOD[0][1]), headers=headers)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "r2" in r.json()["error"]["message"] and r.headers["x-request-id"] == "r2"


def test_the_openapi_document_names_the_public_routes() -> None:
    with _router(FakeInstances()) as router:
        doc = router.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
            "/metrics"} <= set(doc["paths"])  # fmt: skip
    schema = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    assert schema["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert not any(path.startswith("/internal/") for path in doc["paths"])
