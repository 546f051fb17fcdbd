"""The API key of the /v1 routes (`kvduplex.common.auth`), on the router in process over
fake instances (`tests.support.fake_instances`) and on a bare app."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvduplex.common.auth import APIKeyGuard
from kvduplex.common.auth import resolve_api_key
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P

KEY = "sk-test-0123456789"
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0.0}


def test_v1_routes_need_the_api_key_health_and_metrics_do_not() -> None:
    fake = FakeInstances()
    config = RouterConfig(prefill=(P,), decode=(D,), api_key=KEY)
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fake.handle))
    with TestClient(create_router_app(state)) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            r = client.post("/v1/completions", json=BODY, headers=headers)
            assert r.status_code == 401, r.text
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/models").status_code == 401
        assert [c for c in fake.calls if "/health" not in c[0] and "/ready" not in c[0]] == [], "refused before routing"
        r = client.post("/v1/completions", json=BODY, headers={"authorization": f"bearer {KEY}"})
        assert r.status_code == 200, r.text
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
    assert fake.calls and all(
        h.get("authorization") == f"Bearer {KEY}" for _, _, h in fake.calls
    ), "the router presents its key to the instances"


def test_the_guard_refuses_two_authorization_headers_and_leaves_other_paths_open() -> None:
    app = FastAPI()
    app.get("/v1/x")(lambda: {"ok": True})
    app.get("/v1x")(lambda: {"ok": True})
    app.add_middleware(APIKeyGuard, api_key=KEY)
    with TestClient(app) as client:
        two = [("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}")]
        assert client.get("/v1/x", headers=two).status_code == 401
        assert client.get("/v1/x", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get("/v1x").status_code == 200, "only /v1 and /v1/... are guarded"


def test_the_flag_wins_over_the_environment() -> None:
    assert resolve_api_key("a", "b") == "a"
    assert resolve_api_key("", "b") == "b"
    assert resolve_api_key("", None) is None
