"""Readiness and drain, in process: an instance's /ready and what it refuses while
draining (`kvduplex.common.drain`); the router's probes of /ready, a draining instance
taken out of rotation with its calls going on, and the router's own /ready.
(tests/integration/test_drain.py sends the signal to real processes.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvduplex.common.drain import DrainGuard
from kvduplex.common.drain import DrainState
from kvduplex.common.drain import draining_response
from kvduplex.common.drain import owed_work
from kvduplex.common.drain import wait_drained
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.instance.server import Instance
from kvduplex.router.app import create_router_app
from kvduplex.router.backends import Outcome
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import probe_all
from kvduplex.router.health import run_prober
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture()
def draining(instance: Instance) -> Iterator[TestClient]:
    """The module's instance, draining for one test."""
    with TestClient(instance.app) as client:
        assert client.get("/ready").status_code == 200
        instance.state.drain.is_draining = True
        try:
            yield client
        finally:
            instance.state.drain.is_draining = False


def test_ready_says_ready_with_what_health_says(instance: Instance) -> None:
    with TestClient(instance.app) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200
        assert ready.json() == {**client.get("/health").json(), "status": "ready"}


def test_a_draining_instance_refuses_new_work_and_serves_the_rest(draining: TestClient) -> None:
    ready = draining.get("/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = draining.post(path, json=BODY)
        assert resp.status_code == 503, resp.text
        err = resp.json()["error"]
        assert err["code"] == "draining" and err["type"] == "server_error"
    assert draining.get("/v1/models").json()["error"]["code"] == "draining"
    # Liveness, metrics and the internal routes go on.
    assert draining.get("/health").status_code == 200
    assert draining.get("/metrics").status_code == 200
    assert draining.get("/internal/kv/stats").json()["integrity_ok"] is True


def test_an_idle_instance_owes_nothing(instance: Instance) -> None:
    drain = DrainState(timeout_s=5.0)
    assert instance.async_engine.call(lambda e: owed_work(e, drain)).result(10) == {}
    assert asyncio.run(wait_drained(instance.async_engine, drain)) is True


def test_a_drain_waits_for_requests_in_flight_and_ends_at_its_deadline(
    instance: Instance,
) -> None:
    drain = DrainState(timeout_s=0.3)
    drain.num_in_flight = 1
    assert asyncio.run(wait_drained(instance.async_engine, drain)) is False
    drain.owed_checks.append(lambda _e: {"send_jobs": 1, "send_cancelled_tombstones": 4})
    drain.num_in_flight = 0
    owed = instance.async_engine.call(lambda e: owed_work(e, drain)).result(10)
    assert owed == {"send_jobs": 1}  # tombstones are not owed


def test_the_guard_counts_requests_in_flight_but_not_probes() -> None:
    drain = DrainState()
    seen: dict[str, int] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen[scope["path"]] = drain.num_in_flight
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def run() -> None:
        transport = httpx.ASGITransport(app=DrainGuard(app, drain))
        async with httpx.AsyncClient(transport=transport, base_url="http://i") as http:
            for path in ("/internal/push/cancel", "/health", "/ready", "/v1/models"):
                assert (await http.get(path)).status_code == 200
            drain.is_draining = True
            assert (await http.get("/internal/push/cancel")).status_code == 200
            for path in ("/v1/models", "/internal/push/prefill", "/internal/prefill"):
                resp = await http.post(path)
                assert resp.status_code == 503 and resp.json()["error"]["code"] == "draining"

    asyncio.run(run())
    assert seen == {"/internal/push/cancel": 1, "/health": 0, "/ready": 0, "/v1/models": 1}
    assert drain.num_in_flight == 0


P, D1, D2 = "http://p0", "http://d1", "http://d2"


class Probed:
    """Instances as the router's probes see them: ready, draining, or without /ready."""

    def __init__(self) -> None:
        self.draining: set[str] = set()
        self.old: set[str] = set()
        """Instances without /ready (404), probed at /health."""
        self.paths: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        self.paths.append(base + request.url.path)
        if request.url.path == "/ready" and base in self.old:
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/ready" and base in self.draining:
            return httpx.Response(503, json={"status": "draining", "reason": "shutting down"})
        return httpx.Response(200, json={"status": "ok", "max_model_len": 64})


def _router(fake: Probed) -> RouterState:
    config = RouterConfig(prefill=(P,), decode=(D1, D2))
    return RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fake.handle))


def _probe(state: RouterState) -> None:
    asyncio.run(probe_all(state.client, state.policy, timeout_s=1.0))
    state.note_probe_round()


def test_a_draining_instance_gets_no_new_work_but_keeps_its_calls() -> None:
    fake = Probed()
    state = _router(fake)
    _probe(state)
    d1 = state.policy.decode.backends[0]
    abandoned: list[str] = []
    d1.watchers[object()] = lambda: abandoned.append("call")  # a call in flight to D1
    fake.draining.add(D1)
    _probe(state)
    _probe(state)  # however many probes say so, the instance is not taken for down
    assert not d1.is_healthy and not d1.is_down
    assert abandoned == [] and len(d1.watchers) == 1
    for i in range(4):  # new work goes to D2
        route = state.policy.route([1, 2, 3, i], None)
        assert route.decode.url == D2
        state.policy.prefill_done(route, Outcome.OK)
        state.policy.decode_done(route, Outcome.OK)
    fake.draining.clear()
    _probe(state)
    assert d1.is_healthy


def test_an_instance_without_ready_is_probed_at_health() -> None:
    fake = Probed()
    fake.old.add(D1)
    state = _router(fake)
    _probe(state)
    assert f"{D1}/health" in fake.paths and f"{D2}/health" not in fake.paths
    assert all(b.is_healthy for b in state.policy.decode.backends)
    assert state.policy.decode.backends[0].max_model_len == 64


def test_router_ready_needs_a_probe_round_a_decode_and_a_prefill() -> None:
    fake = Probed()
    state = _router(fake)
    client = TestClient(create_router_app(state))  # no lifespan: the test probes
    resp = client.get("/ready")
    assert resp.status_code == 503 and "not been probed" in resp.json()["reason"]
    _probe(state)
    assert client.get("/ready").json() == {"status": "ready", "role": "router"}
    fake.draining.add(D1)
    _probe(state)
    assert client.get("/ready").status_code == 200  # D2 serves
    fake.draining.add(D2)
    _probe(state)
    resp = client.get("/ready")
    assert resp.status_code == 503 and resp.json()["reason"] == "no healthy decode instance"
    assert client.get("/health").status_code == 200  # liveness stays
    fake.draining = {P}
    _probe(state)
    resp = client.get("/ready")
    assert resp.status_code == 503 and resp.json()["reason"] == "no healthy prefill instance"


def test_the_prober_reports_each_round() -> None:
    fake = Probed()
    state = _router(fake)

    async def run() -> None:
        done = asyncio.Event()
        task = asyncio.create_task(
            run_prober(state.client, state.policy, 10.0, 1.0, on_round=done.set)
        )
        await asyncio.wait_for(done.wait(), 10)
        task.cancel()

    asyncio.run(run())
    assert {P + "/ready", D1 + "/ready", D2 + "/ready"} <= set(fake.paths)


def test_a_draining_router_refuses_new_requests_and_says_so() -> None:
    fake = Probed()
    state = _router(fake)
    _probe(state)
    client = TestClient(create_router_app(state))
    state.drain.is_draining = True
    resp = client.get("/ready")
    assert resp.status_code == 503 and resp.json()["status"] == "draining"
    resp = client.post("/v1/completions", json=BODY)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "draining"
    assert client.get("/health").status_code == 200
    assert not [p for p in fake.paths if not p.endswith("/ready")], "nothing was routed"


class Serving(Probed):
    """`Probed`, serving push requests; decode instances in `refusing` answer them with
    503 ``draining`` (they got SIGTERM after the last probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing: set[str] = set()

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/ready", "/health"):
            return super().handle(request)
        base, path = f"{request.url.scheme}://{request.url.host}", request.url.path
        self.paths.append(base + path)
        body = json.loads(request.content)
        if path == "/internal/push/prefill":
            return httpx.Response(200, json={"xid": body["xid"], "token_ids": [7], "text": "x"})
        if path == "/internal/push/cancel":
            return httpx.Response(200, json={"xid": body["xid"], "cancelled": True})
        if base in self.refusing:
            refusal = draining_response().response()
            return httpx.Response(
                503, content=refusal.body, headers={"content-type": "application/json"}
            )
        choice = {"index": 0, "text": "xy", "finish_reason": "length"}
        return httpx.Response(200, json={"id": "cmpl-x", "choices": [choice]})


def test_a_request_refused_by_a_draining_decode_goes_to_another() -> None:
    fake = Serving()
    state = _router(fake)
    _probe(state)
    client = TestClient(create_router_app(state))
    fake.refusing.add(D1)
    for i in range(2):  # one of them is routed to D1 first (ties go round-robin)
        req = {"model": "m", "prompt": [1, 2, 3, i], "max_tokens": 2}
        resp = client.post("/v1/completions", json=req)
        assert resp.status_code == 200, resp.text
    assert fake.paths.count(D1 + "/v1/completions") == 1
    assert fake.paths.count(D2 + "/v1/completions") == 2
    assert P + "/internal/push/cancel" in fake.paths  # P's push for D1 was cancelled
    d1 = state.policy.decode.backends[0]
    assert not d1.is_healthy and not d1.is_down


def test_another_503_from_decode_reaches_the_client_as_it_was() -> None:
    fake = Serving()

    def dead(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            err = {"error": {"message": "engine loop ended", "code": "engine_dead"}}
            return httpx.Response(503, json=err)
        return fake.handle(request)

    config = RouterConfig(prefill=(P,), decode=(D1, D2))
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(dead))
    _probe(state)
    client = TestClient(create_router_app(state))
    for stream in (False, True):
        req = {"model": "m", "prompt": [1, 2], "max_tokens": 2, "stream": stream}
        resp = client.post("/v1/completions", json=req)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
    assert all(b.is_healthy for b in state.policy.decode.backends)  # one request's failure
