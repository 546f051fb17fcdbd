"""The router's fetch plan over fake instances: once prefill's pool turned over since a
session was there, decode is asked to lease the history, prefill's call names the leased
blocks, and whatever decode answers (nothing, an error, too late), prefill's call still
goes out and the client gets its answer."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.backends import Outcome
from kvduplex.router.config import RouterConfig
from kvduplex.router.plans import note_turn_held
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P
from tests.unit.test_router import _metric

LEASE = {"engine_id": "d-engine", "block_ids": [7, 3, 9], "keys": ["aa", "bb", "cc"],
         "num_tokens": 24, "lease_s": 10.0}  # fmt: skip
FIRST = [(i % 200) + 1 for i in range(200)]
ANSWER = list(range(20, 40))
SECOND = FIRST + ANSWER[:-1] + [(i % 50) + 5 for i in range(40)]


@dataclass
class LendingDecode(FakeInstances):
    """D answers a fetch with `fetch_status` (and `LEASE` if 200), or never when `hang`; P
    says it read `LEASE`'s tokens when its body names them. D answers the request only
    once P's call came, in a push (a real D waits for P's KV)."""

    fetch_status: int = 200
    hang: bool = False
    order: list[str] = field(default_factory=list)
    prefill_called: asyncio.Event | None = None

    async def handle(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if request.url.path not in ("/health", "/ready"):
            self.order.append(url)
        if self.prefill_called is None:
            self.prefill_called = asyncio.Event()
        if url == P + "/internal/push/prefill":
            self.prefill_called.set()
        elif url == D + "/v1/completions" and _json(request)["kv_transfer_params"]["mode"] == "push":
            await self.prefill_called.wait()
        if url == D + "/internal/kv/fetch":
            self.calls.append((url, _json(request), request.headers))
            if self.hang:
                await asyncio.Event().wait()  # until the router gives up on the call
            if self.fetch_status != 200:
                return httpx.Response(self.fetch_status, json={"error": {"message": "no"}})
            return httpx.Response(200, json={"xid": _json(request)["xid"], **LEASE})
        resp = await super().handle(request)
        if url == P + "/internal/push/prefill" and "pull_from" in _json(request):
            ans = {**resp.json(), "num_read_tokens": 24, "num_cached_tokens": 24}
            return httpx.Response(200, json=ans)
        return resp


def _json(request: httpx.Request) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(request.content)
    return body


def _router_with_a_lost_session(fake: LendingDecode, **config: Any) -> TestClient:
    """The router after session "s"'s first turn (200 tokens, answered 20), which decode
    holds and prefill lost since (its pool turned over)."""
    state = RouterState.create(
        RouterConfig(prefill=(P,), decode=(D,), **config), ByteTokenizer(),
        make_client=mock_instances(fake.handle),
    )  # fmt: skip
    policy = state.policy
    now = policy.clock()
    p, d = policy.prefill.backends[0], policy.decode.backends[0]
    p.kv_clock.note(num_blocks=100, allocated=0, now=now)
    d.kv_clock.note(num_blocks=1000, allocated=0, now=now)
    route = policy.route(FIRST, "s")
    policy.sessions.note_held("s", FIRST, is_prefill=True, stamp=13, num_tokens=len(FIRST))
    policy.sessions.note_answer("s", FIRST, len(ANSWER), ANSWER, None, now)
    note_turn_held(policy.sessions, route, FIRST, len(ANSWER), now)
    policy.prefill_done(route, Outcome.OK)
    policy.decode_done(route, Outcome.OK)
    p.kv_clock.note(num_blocks=100, allocated=13 + 85, now=now)  # others' turns since
    return TestClient(create_router_app(state))


def _second_turn(router: TestClient) -> httpx.Response:
    body = {"model": "tiny", "prompt": SECOND, "max_tokens": 2, "temperature": 0.0,
            "prompt_cache_key": "s"}  # fmt: skip
    return router.post("/v1/completions", json=body)


def test_prefill_is_sent_the_history_decode_leased() -> None:
    fake = LendingDecode()
    with _router_with_a_lost_session(fake) as router:
        assert _second_turn(router).status_code == 200
        [fetch] = fake.bodies(D + "/internal/kv/fetch")
        [p_body] = fake.bodies(P + "/internal/push/prefill")
        assert fetch["prompt_token_ids"] == SECOND and fetch["session_id"] == "s"
        assert fetch["xid"] == p_body["xid"] + "-fetch"
        assert p_body["pull_from"] == {
            "decode_url": D, "engine_id": "d-engine", "block_ids": [7, 3, 9],
            "keys": ["aa", "bb", "cc"], "num_tokens": 24, "lease_xid": fetch["xid"],
            "pin_left_s": 10.0,
        }  # fmt: skip
        assert fake.order.index(D + "/internal/kv/fetch") < fake.order.index(
            P + "/internal/push/prefill"
        )
        [d_body] = fake.bodies(D + "/v1/completions")
        assert d_body["kv_transfer_params"]["mode"] == "push", "decode computes nothing"
        assert _metric(router, "kvduplex_router_requests_total", mode="fetch") == 1
        assert _metric(router, "kvduplex_router_fetched_tokens_total") == 24
        assert _metric(router, "kvduplex_router_fetch_misses_total") == 0


@pytest.mark.parametrize("refusal", [404, 503, 500, "late"])
def test_prefill_computes_the_history_when_decode_lends_nothing(refusal: int | str) -> None:
    fake = LendingDecode(fetch_status=refusal if isinstance(refusal, int) else 200,
                         hang=refusal == "late")  # fmt: skip
    with _router_with_a_lost_session(fake, fetch_timeout_s=0.2) as router:
        resp = _second_turn(router)
        assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == [104, 105]
        [p_body] = fake.bodies(P + "/internal/push/prefill")
        assert "pull_from" not in p_body
        assert _metric(router, "kvduplex_router_requests_total", mode="fetch") == 1
        assert _metric(router, "kvduplex_router_fetch_misses_total") == 1
        assert _metric(router, "kvduplex_router_fetched_tokens_total") == 0


def test_without_the_fetch_plan_decode_is_not_asked() -> None:
    fake = LendingDecode()
    with _router_with_a_lost_session(fake, fetch_token_cost=1.0) as router:
        assert _second_turn(router).status_code == 200
        assert fake.bodies(D + "/internal/kv/fetch") == []
        assert _metric(router, "kvduplex_router_requests_total", mode="short_append") == 1
