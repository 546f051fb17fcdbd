"""The router trusts an instance with the cluster secret and the API key only once it proved
the secret (`kvduplex.router.admission`), over fake instances that answer the proof as an
instance does (`Responder`) and impostors that record everything they are sent: one that
relays the proof to a member, one with another secret, one without the proof's routes."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvduplex.common.challenge import AUTH_PATHS
from kvduplex.common.challenge import CHALLENGE_PATH
from kvduplex.common.challenge import Responder
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.router.admission import BACKOFF_MIN_S
from kvduplex.router.admission import RENEW_S
from kvduplex.router.admission import Untrusted
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import probe_all
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import _metric
from tests.unit.test_router_discovery import FakeDns

SECRET = "admission-secret-" + "s" * 24
API_KEY = "admission-api-key-" + "k" * 12
PREFILL_NAME, DECODE_NAME = "prefill.kv.svc", "decode.kv.svc"
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0.0}
AUTH = {"authorization": f"Bearer {API_KEY}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Host:
    """A fake instance, or an impostor: `kind` is member, relay (forwards the proof to
    `relay_to`), stranger (another secret) or old (no proof routes)."""

    role: str
    kind: str = "member"
    relay_to: str = ""
    responder: Responder | None = None
    received: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)
    """Every request: method, path, headers, body."""


class Fleet:
    def __init__(self, hosts: dict[str, Host]) -> None:
        self.hosts = hosts
        for host in hosts.values():
            secret = "another-secret-" + "x" * 24 if host.kind == "stranger" else SECRET
            host.responder = Responder(secret, host.role)

    def handle(self, request: httpx.Request) -> httpx.Response:
        host = self.hosts[request.url.host]
        path = request.url.path
        host.received.append((request.method, path, dict(request.headers), request.content))
        if path in ("/health", "/ready"):
            return httpx.Response(200, json={"status": "ok", "role": host.role})
        if path in AUTH_PATHS:
            return self._prove(host, request)
        if host.kind != "member" or request.headers.get(SECRET_HEADER) != SECRET:
            return httpx.Response(500, json={"error": "a call no member would get"})
        if path == "/internal/push/prefill":
            return httpx.Response(200, json={"xid": json.loads(request.content)["xid"],
                                             "first_token": 104})  # fmt: skip
        choice = {"index": 0, "text": "hi", "token_ids": [104, 105], "finish_reason": "length"}
        return httpx.Response(200, json={"id": "cmpl-x", "choices": [choice]})

    def _prove(self, host: Host, request: httpx.Request) -> httpx.Response:
        if host.kind == "old":
            return httpx.Response(404, json={"detail": "Not Found"})
        seen = f"{host.relay_to or request.url.host}:{request.url.port}"
        if host.kind == "relay":  # the member answers, reached at its own address
            host = self.hosts[host.relay_to]
        assert host.responder is not None
        try:
            if request.url.path == CHALLENGE_PATH:
                return httpx.Response(200, content=host.responder.challenge(request.content, seen))
            return httpx.Response(200, content=host.responder.prove(request.content))
        except Exception:
            return httpx.Response(401, json={"error": {"code": "invalid_cluster_secret"}})

    def credentials_sent_to(self, address: str) -> list[str]:
        """What of the secret or the API key reached `address`, in any header or body."""
        return [
            f"{method} {path}"
            for method, path, headers, body in self.hosts[address].received
            if any(s in json.dumps(headers) or s.encode() in body for s in (SECRET, API_KEY))
        ]

    def calls_to(self, address: str, path: str) -> int:
        return sum(1 for _, p, _, _ in self.hosts[address].received if p == path)


def _state(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, clock: Clock, dns: FakeDns | None = None,
    **config: Any,
) -> RouterState:  # fmt: skip
    monkeypatch.setenv("KVDUPLEX_CLUSTER_SECRET", SECRET)
    cfg = RouterConfig(api_key=API_KEY, health_interval_s=60.0, dns_interval_s=60.0, **config)
    return RouterState.create(
        cfg, ByteTokenizer(), make_client=mock_instances(fleet.handle), clock=clock, resolve=dns
    )


def test_impostors_at_discovered_addresses_are_refused_and_never_sent_credentials(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """1. DNS names members and impostors: only the members join; each impostor is logged
    once and counted by its reason; requests reach the members only, and no impostor ever
    gets the secret or the API key; 2. an impostor is not asked again before its backoff,
    then it is (counted again, not logged again)."""
    fleet = Fleet({
        "10.0.0.1": Host("prefill"), "10.0.0.6": Host("prefill", "old"),
        "10.0.1.1": Host("decode"), "10.0.1.6": Host("decode", "relay", "10.0.1.1"),
        "10.0.1.7": Host("decode", "stranger"),
    })  # fmt: skip
    impostors = ["10.0.0.6", "10.0.1.6", "10.0.1.7"]
    dns, clock = FakeDns(), Clock()
    dns.answers = {PREFILL_NAME: {"10.0.0.1", "10.0.0.6"},
                   DECODE_NAME: {"10.0.1.1", "10.0.1.6", "10.0.1.7"}}  # fmt: skip
    state = _state(fleet, monkeypatch, clock, dns, prefill_dns=f"{PREFILL_NAME}:8000",
                   decode_dns=f"{DECODE_NAME}:8001")  # fmt: skip
    with caplog.at_level(logging.WARNING), TestClient(create_router_app(state)) as client:
        assert client.get("/ready").status_code == 200  # 1.
        assert {i["url"] for i in client.get("/health").json()["instances"]} == {
            "http://10.0.0.1:8000", "http://10.0.1.1:8001"
        }
        for session in ("ann", "bob", "cy", "dee"):
            resp = client.post("/v1/completions", json=BODY,
                               headers={**AUTH, "x-session-id": session})  # fmt: skip
            assert resp.status_code == 200, resp.text
        refused = "kvduplex_router_instance_refusals_total"
        assert _metric(client, refused, role="prefill", reason="no_challenge") == 1
        assert _metric(client, refused, role="decode", reason="address") == 1
        assert _metric(client, refused, role="decode", reason="wrong_secret") == 1
        for address in impostors:
            assert fleet.credentials_sent_to(address) == []
            assert {p for _, p, _, _ in fleet.hosts[address].received} <= {"/health", *AUTH_PATHS}
        assert fleet.calls_to("10.0.1.1", "/v1/completions") == 4
        asked = {a: fleet.calls_to(a, CHALLENGE_PATH) for a in impostors}
        client.portal.call(state.discovery.run_round)  # type: ignore[union-attr]  # 2.
        assert {a: fleet.calls_to(a, CHALLENGE_PATH) for a in impostors} == asked
        clock.now += BACKOFF_MIN_S
        client.portal.call(state.discovery.run_round)  # type: ignore[union-attr]
        assert {a: fleet.calls_to(a, CHALLENGE_PATH) for a in impostors} == {
            a: n + 1 for a, n in asked.items()
        }
        assert _metric(client, refused, role="decode", reason="address") == 2
        for address in impostors:
            assert fleet.credentials_sent_to(address) == []
    for address in impostors:
        logged = [r for r in caplog.records if f"http://{address}:" in r.getMessage()
                  and "did not prove the cluster secret" in r.getMessage()]  # fmt: skip
        assert len(logged) == 1, [r.getMessage() for r in logged]


def test_instances_given_by_url_get_work_only_after_their_proof(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1. before the first probe round no instance is trusted: a request is refused, and a
    call with credentials is not even sent; 2. the probe round admits the members only;
    3. one presumed down proves itself again, and its proof is renewed after RENEW_S."""
    fleet = Fleet({"10.0.0.1": Host("prefill"), "10.0.1.1": Host("decode"),
                   "10.0.1.7": Host("decode", "stranger")})  # fmt: skip
    clock = Clock()
    member, stranger = "http://10.0.1.1:8001", "http://10.0.1.7:8001"
    state = _state(fleet, monkeypatch, clock, prefill=("http://10.0.0.1:8000",),
                   decode=(stranger, member))  # fmt: skip
    assert state.admission is not None
    assert not any(b.is_healthy for b in state.policy.decode.backends)  # 1.
    with pytest.raises(Untrusted):
        asyncio.run(state.client.post_whole(member + "/v1/completions", b"{}"))
    assert fleet.calls_to("10.0.1.1", "/v1/completions") == 0
    asyncio.run(probe_all(state.client, state.policy, 1.0, state.admission))  # 2.
    health = {b.url: b.is_healthy for b in state.policy.decode.backends}
    assert health == {stranger: False, member: True}
    assert state.policy.prefill.backends[0].is_healthy
    with TestClient(create_router_app(state)) as client:
        for session in ("ann", "bob", "cy"):
            resp = client.post("/v1/completions", json=BODY,
                               headers={**AUTH, "x-session-id": session})  # fmt: skip
            assert resp.status_code == 200, resp.text
    assert fleet.credentials_sent_to("10.0.1.7") == []
    d = state.policy.decode.by_url(member)  # 3.
    assert d is not None
    asked = fleet.calls_to("10.0.1.1", CHALLENGE_PATH)
    asyncio.run(probe_all(state.client, state.policy, 1.0, state.admission))
    assert fleet.calls_to("10.0.1.1", CHALLENGE_PATH) == asked  # its proof holds
    state.policy.decode.mark_failed(d, clock())
    clock.now += 1.0
    asyncio.run(probe_all(state.client, state.policy, 1.0, state.admission))
    assert fleet.calls_to("10.0.1.1", CHALLENGE_PATH) == asked + 1 and d.is_healthy
    clock.now += RENEW_S
    asyncio.run(probe_all(state.client, state.policy, 1.0, state.admission))
    assert fleet.calls_to("10.0.1.1", CHALLENGE_PATH) == asked + 2 and d.is_healthy
    # Another process at its address, with another secret: once it is presumed down, it
    # gets nothing more.
    fleet.hosts["10.0.1.1"].responder = Responder("another-secret-" + "y" * 24, "decode")
    state.policy.decode.mark_failed(d, clock())
    clock.now += 1.0
    before = len(fleet.hosts["10.0.1.1"].received)
    asyncio.run(probe_all(state.client, state.policy, 1.0, state.admission))
    assert not state.admission.is_trusted(member) and not d.is_healthy
    with pytest.raises(Untrusted):
        asyncio.run(state.client.post_whole(member + "/v1/completions", b"{}"))
    assert {p for _, p, _, _ in fleet.hosts["10.0.1.1"].received[before:]} <= set(AUTH_PATHS)


def test_without_a_secret_every_address_is_trusted_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVDUPLEX_CLUSTER_SECRET", raising=False)
    fleet = Fleet({"10.0.1.1": Host("decode")})
    cfg = RouterConfig(decode=("http://10.0.1.1:8001",), health_interval_s=60.0)
    state = RouterState.create(cfg, ByteTokenizer(), make_client=mock_instances(fleet.handle))
    assert state.admission is not None and not state.admission.is_active
    assert state.policy.decode.backends[0].is_healthy
    asyncio.run(probe_all(state.client, state.policy, 1.0, state.admission))
    assert fleet.calls_to("10.0.1.1", CHALLENGE_PATH) == 0
