"""Schema-driven fuzzing of the public API of the router and of both instances.

A push cluster (one P, one D, a router returning finished turns to P) runs on
loopback with small pools: the context is 128 tokens, so whatever request is
served is short. Each process's own OpenAPI schema drives schemathesis: for
each public operation (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics``; never ``/internal/*``) it generates
requests that follow the schema (positive) and requests that break it
(negative: wrong types, missing fields, bytes that are not JSON). Hypothesis
runs derandomized, so a run tries the same cases every time.

Every answer must be below 500; a 4xx carries OpenAI error JSON; a 200 stream
ends with ``[DONE]`` or an error event. After each operation both pools hold
no request block and pass the integrity check, and every process is alive.
The cases tried are counted and printed at the end (about 600, in about a
minute on two cores).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import start_duplex_rig
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

schemathesis = pytest.importorskip("schemathesis", reason="pip install -e '.[dev]'")
skip_module_without_nixl()

SERVE = ["serve", "--model", "tiny", "--block-size", "8", "--num-blocks", "16"]
"""Context: 16 blocks of 8 tokens."""
EXAMPLES = {"POST": 50, "GET": 4}
"""Cases per operation and generation mode."""
MIN_CASES = 500
REQUEST_TIMEOUT_S = 60.0
HOP_BY_HOP = {"connection", "accept-encoding", "content-length", "transfer-encoding", "host"}

FUZZ_SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@dataclass
class Rig:
    router: Process
    prefill: Process
    decode: Process

    def target(self, name: str) -> Process:
        return {"router": self.router, "prefill": self.prefill, "decode": self.decode}[name]


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> Rig:
    procs = start_duplex_rig(cluster, SERVE)
    return Rig(procs["router"], procs["prefill"], procs["decode"])


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Counter[str]]:
    """Cases tried and answers by status class; printed in pytest's terminal summary."""
    counts: Counter[str] = Counter()
    yield counts
    line = "schema fuzz: " + ", ".join(f"{key} {n}" for key, n in sorted(counts.items()))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(line)


def _schema(url: str) -> Any:
    doc = httpx.get(url + "/openapi.json", timeout=10).json()
    doc["paths"] = {k: v for k, v in doc["paths"].items() if not k.startswith("/internal/")}
    return schemathesis.openapi.from_dict(doc)


@pytest.fixture(scope="module")
def schemas(rig: Rig) -> dict[str, Any]:
    return {name: _schema(rig.target(name).url) for name in ("router", "decode", "prefill")}


def _check_error(resp: httpx.Response) -> None:
    err = resp.json().get("error")
    assert isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}, resp.text
    assert isinstance(err["message"], str) and err["message"], resp.text
    assert err["type"] == "invalid_request_error", resp.text


def _check_stream(text: str) -> None:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data, f"empty stream: {text[:300]!r}"
    for chunk in data[:-1]:
        assert "error" not in json.loads(chunk), chunk
    if data[-1] != "[DONE]":
        assert "error" in json.loads(data[-1]), data[-1]


def _send(client: httpx.Client, case: Any, base_url: str) -> httpx.Response:
    kwargs = case.as_transport_kwargs(base_url=base_url)
    headers = {k: str(v) for k, v in kwargs["headers"].items() if k.lower() not in HOP_BY_HOP}
    content = kwargs.get("data")
    if "json" in kwargs:
        content = json.dumps(kwargs["json"]).encode()
        headers["content-type"] = "application/json"
    if isinstance(content, str):
        content = content.encode()
    return client.request(
        kwargs["method"], kwargs["url"], params=kwargs.get("params"), headers=headers,
        content=content,
    )  # fmt: skip


def _check(resp: httpx.Response, case: Any) -> None:
    where = f"{case.method} {case.path}: {resp.status_code} {resp.text[:300]!r}"
    assert resp.status_code < 500, where
    if resp.status_code >= 400:
        _check_error(resp)
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        _check_stream(resp.text)
    elif case.method.upper() == "POST":
        assert resp.json()["choices"], where


OPERATIONS = [
    (target, method, path, mode)
    for target in ("router", "decode", "prefill")
    for method, path in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    ]
    for mode in ("positive", "negative")
    if not (method == "GET" and mode == "negative")  # no parameters to break
]


@pytest.mark.parametrize(
    ("target", "method", "path", "mode"), OPERATIONS, ids=[" ".join(op) for op in OPERATIONS]
)
def test_schema_fuzz(
    rig: Rig,
    schemas: dict[str, Any],
    tally: Counter[str],
    target: str,
    method: str,
    path: str,
    mode: str,
) -> None:
    url = rig.target(target).url
    strategy = schemas[target][path][method].as_strategy(schemathesis.GenerationMode(mode))

    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:

        @settings(FUZZ_SETTINGS, max_examples=EXAMPLES[method])
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            case = data.draw(strategy)
            resp = _send(client, case, url)
            tally["cases"] += 1
            tally[f"{resp.status_code // 100}xx"] += 1
            _check(resp, case)

        run()
    tally["operations"] += 1
    for proc in (rig.prefill, rig.decode, rig.router):
        assert proc.is_alive(), f"{proc.name} died:\n{proc.log_tail()}"
    for proc in (rig.prefill, rig.decode):
        assert_pool_clean(proc.url)


PAST_CONTEXT = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**18}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 127}),  # just past the context
    ("/v1/completions", {"prompt": [1] * 200, "max_tokens": 1}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 1, "max_completion_tokens": 2**64},
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a" * 300}], "max_tokens": 1},
    ),
]


@pytest.mark.parametrize("stream", [False, True])
def test_requests_past_the_context_are_400_through_the_router(rig: Rig, stream: bool) -> None:
    """The router refuses them with the context length the instances' /health told it (the
    words D would use; before its first probe answered, D's own refusal reaches the client),
    and no pool keeps a block."""
    for path, body in PAST_CONTEXT:
        resp = httpx.post(rig.router.url + path, json={**body, "stream": stream}, timeout=30)
        assert resp.status_code == 400, resp.text[:300]
        _check_error(resp)
        assert "maximum context length is 128 tokens" in resp.json()["error"]["message"]
    for proc in (rig.prefill, rig.decode):
        assert_pool_clean(proc.url)


def test_cases_tried(tally: Counter[str]) -> None:
    """Runs last: enough cases were tried, none answered 5xx."""
    if tally["operations"] < len(OPERATIONS):
        pytest.skip("counted only when every operation ran")
    assert tally["5xx"] == 0
    assert tally["cases"] >= MIN_CASES, tally
