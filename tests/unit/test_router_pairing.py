"""The router pairs only prefill and decode instances that serve the same model: equal
fingerprint digests, as fake instances' probes show them. A decode instance that no
prefill instance matches serves its requests alone, and the router's /health and
metrics say which instances are unpaired."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx
from fastapi.testclient import TestClient

from kvduplex.common.config import TransferMode
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.backends import Outcome
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import probe_all
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import _metric

P0, P1, D0, D1, D2 = "http://p0", "http://p1", "http://d0", "http://d1", "http://d2"
FP_A, FP_B = "a" * 64, "b" * 64


class Fleet:
    """Instances whose probes show the fingerprint digest in `fingerprints` (None: no
    fingerprint in the body); records the paths each is called on."""

    def __init__(self, fingerprints: dict[str, str | None]) -> None:
        self.fingerprints = fingerprints
        self.calls: list[tuple[str, str]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        path = request.url.path
        if path in ("/health", "/ready"):
            body: dict[str, Any] = {"status": "ok", "max_model_len": 4096, "engine_id": base}
            digest = self.fingerprints[base]
            if digest is not None:
                body["fingerprint"] = {"weights": "preset:tiny:seed=1", "digest": digest}
            return httpx.Response(200, json=body)
        self.calls.append((base, path))
        sent = json.loads(request.content)
        if path == "/internal/push/prefill":
            return httpx.Response(200, json={"xid": sent["xid"], "token_ids": [7], "text": "x"})
        choice = {"index": 0, "text": "xy", "finish_reason": "length"}
        return httpx.Response(200, json={"id": "cmpl-x", "choices": [choice]})


def _state(fleet: Fleet, prefill: tuple[str, ...], decode: tuple[str, ...]) -> RouterState:
    config = RouterConfig(prefill=prefill, decode=decode, mode=TransferMode.PUSH)
    state = RouterState.create(config, ByteTokenizer(), make_client=mock_instances(fleet.handle))
    asyncio.run(probe_all(state.client, state.policy, timeout_s=1.0))
    return state


def _ids(i: int) -> list[int]:
    return [1, 2, 3, 100 + i, 5]


def test_prefill_is_chosen_among_those_that_serve_decodes_model() -> None:
    """Two models, one P and one D each: every route pairs equal fingerprints, for new
    sessions (least loaded), named sessions (rendezvous) and their next turns."""
    fleet = Fleet({P0: FP_A, P1: FP_B, D0: FP_B, D1: FP_A})
    policy = _state(fleet, (P0, P1), (D0, D1)).policy
    pair = {D0: P1, D1: P0}
    routes = [policy.route(_ids(i), None) for i in range(6)]
    routes += [policy.route(_ids(i), f"s{i}") for i in range(6)]
    routes += [policy.route([*_ids(i), 9], f"s{i}") for i in range(6)]
    for r in routes:
        assert r.prefill is not None and r.prefill.url == pair[r.decode.url]
        assert not r.is_unpaired
    assert {r.decode.url for r in routes} == {D0, D1}


def test_a_decode_no_prefill_matches_gets_requests_only_while_none_pairs() -> None:
    """1. P0 and D0 serve model A, D1 model B: every request goes to D0 and P0, none to
    D1 (nothing decode-alone); 2. with D0 down, D1 serves alone, counted; 3. /health
    groups the instances by digest and names D1 unpaired; the gauge counts one
    unpaired decode instance and no prefill one."""
    fleet = Fleet({P0: FP_A, D0: FP_A, D1: FP_B})
    state = _state(fleet, (P0,), (D0, D1))
    client = TestClient(create_router_app(state))
    for i in range(4):  # 1. new sessions, least loaded: D0 each time
        req = {"model": "m", "prompt": _ids(i), "max_tokens": 2}
        resp = client.post("/v1/completions", json=req)
        assert resp.status_code == 200, resp.text
    assert Counter(fleet.calls) == {
        (P0, "/internal/push/prefill"): 4, (D0, "/v1/completions"): 4,
    }  # fmt: skip
    assert _metric(client, "kvduplex_router_decode_alone_unpaired_total") == 0
    fleet.calls.clear()
    d0 = state.policy.decode.by_url(D0)
    assert d0 is not None
    state.policy.decode.mark_failed(d0, 0.0)  # 2.
    for i in range(2):
        req = {"model": "m", "prompt": _ids(10 + i), "max_tokens": 2}
        assert client.post("/v1/completions", json=req).status_code == 200
    assert Counter(fleet.calls) == {(D1, "/v1/completions"): 2}
    assert _metric(client, "kvduplex_router_decode_alone_unpaired_total") == 2
    assert _metric(client, "kvduplex_router_requests_total", mode="decode") == 2
    assert _metric(client, "kvduplex_router_requests_total", mode="push") == 4
    asyncio.run(probe_all(state.client, state.policy, timeout_s=1.0))  # D0 is back
    health = client.get("/health").json()  # 3.
    assert health["fingerprints"] == {
        "groups": [
            {"digest": FP_A, "prefill": [P0], "decode": [D0]},
            {"digest": FP_B, "prefill": [], "decode": [D1]},
        ],
        "unknown": [],
        "unpaired": [{"url": D1, "role": "decode"}],
    }
    assert {i["url"]: i["fingerprint"] for i in health["instances"]} == {
        P0: FP_A, D0: FP_A, D1: FP_B
    }
    assert _metric(client, "kvduplex_router_unpaired_instances", role="decode") == 1
    assert _metric(client, "kvduplex_router_unpaired_instances", role="prefill") == 0


def test_an_unknown_fingerprint_pairs_as_before() -> None:
    """P0 shows no fingerprint (not known): it pairs with D0 whatever D0 serves, and
    nothing is unpaired; once a probe shows P0's, pairing follows it."""
    fleet = Fleet({P0: None, D0: FP_A})
    state = _state(fleet, (P0,), (D0,))
    policy = state.policy
    route = policy.route(_ids(0), None)
    assert route.prefill is not None and route.prefill.url == P0 and not route.is_unpaired
    policy.prefill_done(route, Outcome.OK)
    policy.decode_done(route, Outcome.OK)
    client = TestClient(create_router_app(state))
    assert client.get("/health").json()["fingerprints"]["unknown"] == [
        {"url": P0, "role": "prefill"}
    ]
    fleet.fingerprints[P0] = FP_B  # P0 restarted with another model
    asyncio.run(probe_all(state.client, policy, timeout_s=1.0))
    again = policy.route(_ids(0), None)
    assert again.prefill is None and again.is_unpaired
    assert _metric(client, "kvduplex_router_unpaired_instances", role="prefill") == 1


def test_a_reroute_keeps_prefill_only_if_it_matches_the_new_decode() -> None:
    """A session on P0/D0 (model A) whose D0 could not be reached is routed to D1 (model
    B): P0 does not pair with D1, so P1 (model B) takes the request; with no P of model
    B the reroute goes decode-alone."""
    fleet = Fleet({P0: FP_A, P1: FP_B, D0: FP_A, D1: FP_B})
    policy = _state(fleet, (P0, P1), (D0, D1)).policy
    route = policy.route(_ids(0), None)
    while route.decode.url != D0:  # the round-robin start is the policy's
        route = policy.route(_ids(0), None)
    policy.decode_done(route, Outcome.UNREACHABLE)
    rerouted = policy.try_reroute(route)
    assert rerouted is not None and rerouted.decode.url == D1
    assert rerouted.prefill is not None and rerouted.prefill.url == P1

    fleet2 = Fleet({P0: FP_A, D0: FP_A, D1: FP_B})
    policy2 = _state(fleet2, (P0,), (D0, D1)).policy
    route2 = policy2.route(_ids(1), None)
    assert route2.decode.url == D0  # the only decode instance P0 pairs with
    assert route2.prefill is not None and route2.prefill.url == P0
    policy2.decode_done(route2, Outcome.UNREACHABLE)
    rerouted2 = policy2.try_reroute(route2)
    assert rerouted2 is not None and rerouted2.decode.url == D1
    assert rerouted2.prefill is None and rerouted2.is_unpaired


def test_decode_is_chosen_among_those_a_healthy_prefill_pairs_with() -> None:
    """P0 serves model A, P1 model B; D0 and D1 serve A, D2 B. 1. While P1 is down, no
    route goes to D2, for new, named and returning sessions, and a session that was on
    D2 moves; every route has a prefill instance of its decode's model; 2. with P1 back,
    D2 gets its share again; 3. with both P down, decode is chosen among all (alone,
    not counted unpaired); 4. a reroute from D0 goes to D1, not D2, while P1 is down."""
    fleet = Fleet({P0: FP_A, P1: FP_B, D0: FP_A, D1: FP_A, D2: FP_B})
    policy = _state(fleet, (P0, P1), (D0, D1, D2)).policy
    p1 = policy.prefill.by_url(P1)
    assert p1 is not None
    # 1. a named and an unnamed session on D2 while P1 was healthy
    key = next(f"k{i}" for i in range(100) if policy.route(_ids(99), f"k{i}").decode.url == D2)
    prompt = next(
        [200 + i] * 40 for i in range(100) if policy.route([200 + i] * 40, None).decode.url == D2
    )
    policy.prefill.mark_failed(p1, 0.0)
    routes = [policy.route(_ids(i), None) for i in range(9)]
    routes += [policy.route(_ids(i), f"s{i}") for i in range(9)]
    routes += [policy.route([*_ids(i), 9], f"s{i}") for i in range(9)]
    moved = [policy.route([*_ids(99), 7], key), policy.route([*prompt, 7], None)]
    assert all(r.is_session_hit and r.decode.url != D2 for r in moved)
    for r in [*routes, *moved]:
        assert r.decode.url in (D0, D1)
        assert r.prefill is not None and r.prefill.url == P0 and not r.is_unpaired
    assert {r.decode.url for r in routes} == {D0, D1}

    p1.is_healthy = True  # 2. its probes succeed again
    back = [policy.route(_ids(20 + i), None) for i in range(9)]
    assert D2 in {r.decode.url for r in back}
    for r in back:
        assert r.prefill is not None and r.prefill.url == {D2: P1}.get(r.decode.url, P0)

    p0 = policy.prefill.by_url(P0)
    assert p0 is not None
    policy.prefill.mark_failed(p0, 0.0)  # 3.
    policy.prefill.mark_failed(p1, 0.0)
    alone = [policy.route(_ids(40 + i), None) for i in range(9)]
    assert {r.decode.url for r in alone} == {D0, D1, D2}
    assert all(r.prefill is None and not r.is_unpaired for r in alone)

    p0.is_healthy = True  # 4. P0 back, P1 still down
    route = policy.route(_ids(60), None)
    while route.decode.url != D0:
        route = policy.route(_ids(60), None)
    policy.decode_done(route, Outcome.UNREACHABLE)
    rerouted = policy.try_reroute(route)
    assert rerouted is not None and rerouted.decode.url == D1
    assert rerouted.prefill is not None and rerouted.prefill.url == P0
