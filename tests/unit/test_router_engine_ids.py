"""The router names each instance's KV engine id, as its probes last saw it, to the
instance's peers, so that they use their connections without asking the address first."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fastapi.testclient import TestClient

from kvduplex.common.config import ReturnMode
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import probe_all
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances

P, D = "http://p0", "http://d0"


class Instances:
    """P and D with an engine id each; records the bodies of the calls."""

    def __init__(self) -> None:
        self.engine_ids = {P: "engine-p-1", D: "engine-d-1"}
        self.bodies: dict[str, dict[str, Any]] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if request.url.path in ("/health", "/ready"):
            return httpx.Response(200, json={"status": "ok", "max_model_len": 4096,
                                             "engine_id": self.engine_ids[base]})  # fmt: skip
        body = json.loads(request.content)
        self.bodies[request.url.path] = body
        if request.url.path == "/internal/push/prefill":
            return httpx.Response(200, json={"xid": body["xid"], "token_ids": [7], "text": "x"})
        choice = {"index": 0, "text": "xy", "finish_reason": "length"}
        return httpx.Response(200, json={"id": "cmpl-x", "choices": [choice]})


def _probe(state: RouterState) -> None:
    asyncio.run(probe_all(state.client, state.policy, timeout_s=1.0))


def test_push_requests_name_both_engines_and_a_restart_is_picked_up_by_the_next_probe() -> None:
    fake = Instances()
    config = RouterConfig(prefill=(P,), decode=(D,), return_mode=ReturnMode.PUSH)
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fake.handle))
    _probe(state)
    client = TestClient(create_router_app(state))
    req = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 2, "prompt_cache_key": "s1"}

    def sent() -> tuple[str | None, dict[str, Any]]:
        resp = client.post("/v1/completions", json=req)
        assert resp.status_code == 200, resp.text
        p_body = fake.bodies["/internal/push/prefill"]
        return p_body["decode_engine_id"], fake.bodies["/v1/completions"]["kv_transfer_params"]

    decode_engine, params = sent()
    assert decode_engine == "engine-d-1"
    assert params["engine_id"] == params["return_engine_id"] == "engine-p-1"
    assert params["prefill_url"] == params["return_to"] == P
    fake.engine_ids = {P: "engine-p-2", D: "engine-d-2"}  # both restarted
    _probe(state)
    decode_engine, params = sent()
    assert (decode_engine, params["engine_id"]) == ("engine-d-2", "engine-p-2")
    health = client.get("/health").json()
    assert {(i["url"], i["role"], i["engine_id"], i["healthy"]) for i in health["instances"]} == {
        (P, "prefill", "engine-p-2", True), (D, "decode", "engine-d-2", True),
    }  # fmt: skip
