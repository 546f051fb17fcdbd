"""Instances discovered by DNS, over fake instances (`tests.support.fake_instances`) and an injected
resolver whose answers change: joins, leaves, refusals by role, DNS failures; and the
DNS resolver itself against a small DNS server."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.discovery import DnsResolver
from kvduplex.router.discovery import ResolveFailed
from kvduplex.router.discovery import instance_url
from kvduplex.router.discovery import run_discovery
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.support.static_dns import StaticDns
from tests.unit.test_router import _metric

PREFILL_NAME, DECODE_NAME = "prefill.kv.svc", "decode.kv.svc"
STATIC_P = "http://10.0.0.1:8000"


class FakeDns:
    """A `Resolve` whose answers the test sets; a name set to None fails this round."""

    def __init__(self) -> None:
        self.answers: dict[str, set[str] | None] = {}

    async def __call__(self, name: str) -> set[str]:
        found = self.answers.get(name, set())
        if found is None:
            raise ResolveFailed(f"{name}: timed out")
        return set(found)


class Fleet:
    """Instances by host: their role (None: /health does not answer); D answers requests."""

    def __init__(self) -> None:
        self.roles: dict[str, str | None] = {}
        self.served: list[str] = []
        """The URL of each /v1 request and prefill call, in order."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.method == "GET" and request.url.path in ("/health", "/ready"):
            role = self.roles.get(host)
            if role is None:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, json={"status": "ok", "role": role, "engine_id": f"e-{host}"})
        body = json.loads(request.content)
        self.served.append(str(request.url))
        if request.url.path == "/internal/push/prefill":
            return httpx.Response(200, json={"xid": body["xid"], "first_token": 104})
        choice = {"index": 0, "text": "hi", "token_ids": [104, 105], "finish_reason": "length"}
        return httpx.Response(200, json={"id": "cmpl-x", "choices": [choice]})


def _state(fleet: Fleet, dns: FakeDns, **config: Any) -> RouterState:
    cfg = RouterConfig(
        prefill_dns=f"{PREFILL_NAME}:8000", decode_dns=f"{DECODE_NAME}:8001",
        health_interval_s=60.0, dns_interval_s=60.0, **config,
    )  # fmt: skip
    return RouterState.create(
        cfg, ByteTokenizer(), make_client=mock_instances(fleet.handle), resolve=dns
    )


def _round(state: RouterState) -> None:
    assert state.discovery is not None
    asyncio.run(state.discovery.run_round())


def _urls(state: RouterState) -> tuple[set[str], set[str]]:
    return (
        {b.url for b in state.policy.prefill.backends},
        {b.url for b in state.policy.decode.backends},
    )


def test_instances_join_leave_and_are_refused_by_role(caplog: pytest.LogCaptureFixture) -> None:
    """1. the first answers join, with the engine ids their /health names; an address whose
    /health says another role is refused (logged once); one that does not answer waits;
    2. an address that appears joins, one that is gone leaves, the silent one joins once
    it answers; 3. a failed resolution keeps the instances; 4. a name with no address
    has no instances."""
    fleet, dns = Fleet(), FakeDns()
    fleet.roles = {"10.0.0.1": "prefill", "10.0.0.2": "prefill", "10.0.1.1": "decode",
                   "10.0.1.9": "prefill", "10.0.1.2": None}  # fmt: skip
    dns.answers = {PREFILL_NAME: {"10.0.0.1", "10.0.0.2"},
                   DECODE_NAME: {"10.0.1.1", "10.0.1.9", "10.0.1.2"}}  # fmt: skip
    state = _state(fleet, dns)
    assert _urls(state) == (set(), set())
    assert state.unready_reason() == "the instances have not been probed yet"
    state.note_probe_round()
    assert state.unready_reason() == "the instances' DNS names have not been resolved yet"
    with caplog.at_level(logging.WARNING, logger="kvduplex.router.discovery"):
        _round(state)  # 1.
        _round(state)
    assert _urls(state) == (
        {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, {"http://10.0.1.1:8001"}
    )
    assert state.policy.decode.backends[0].engine_id == "e-10.0.1.1"
    refusals = [r for r in caplog.records if "10.0.1.9" in r.getMessage()]
    assert len(refusals) == 1 and "role 'prefill', not decode" in refusals[0].getMessage()
    assert state.unready_reason() is None
    fleet.roles["10.0.1.2"] = "decode"  # 2.
    fleet.roles["10.0.0.3"] = "prefill"
    dns.answers[PREFILL_NAME] = {"10.0.0.2", "10.0.0.3"}
    _round(state)
    assert _urls(state) == (
        {"http://10.0.0.2:8000", "http://10.0.0.3:8000"},
        {"http://10.0.1.1:8001", "http://10.0.1.2:8001"},
    )
    dns.answers[PREFILL_NAME] = None  # 3.
    _round(state)
    assert len(state.policy.prefill.backends) == 2
    dns.answers[PREFILL_NAME] = set()  # 4.
    _round(state)
    assert _urls(state)[0] == set()
    assert state.unready_reason() == "no healthy prefill instance"


def test_urls_given_stay_and_are_not_added_twice() -> None:
    fleet, dns = Fleet(), FakeDns()
    fleet.roles = {"10.0.0.1": "prefill", "10.0.0.2": "prefill", "10.0.1.1": "decode"}
    dns.answers = {PREFILL_NAME: {"10.0.0.1", "10.0.0.2"}, DECODE_NAME: {"10.0.1.1"}}
    state = _state(fleet, dns, prefill=(STATIC_P,))
    _round(state)
    assert [b.url for b in state.policy.prefill.backends] == [STATIC_P, "http://10.0.0.2:8000"]
    dns.answers[PREFILL_NAME] = set()
    _round(state)
    assert [b.url for b in state.policy.prefill.backends] == [STATIC_P]


def test_requests_reach_joined_instances_and_sessions_leave_one_that_left() -> None:
    """Through the app: a named session's turns go to the decode instance it ranks first;
    when that one leaves DNS, its next turn goes to the other; the metrics follow."""
    fleet, dns = Fleet(), FakeDns()
    fleet.roles = {"10.0.0.1": "prefill", "10.0.1.1": "decode", "10.0.1.2": "decode"}
    dns.answers = {PREFILL_NAME: {"10.0.0.1"}, DECODE_NAME: {"10.0.1.1", "10.0.1.2"}}
    state = _state(fleet, dns)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0.0}
    with TestClient(create_router_app(state)) as client:  # the lifespan resolves at once
        assert client.get("/ready").status_code == 200
        for role, url in (("decode", "http://10.0.1.1:8001"), ("decode", "http://10.0.1.2:8001")):
            assert _metric(client, "kvduplex_router_instance_healthy", url=url, role=role) == 1
        sid = {"x-session-id": "carol"}
        assert client.post("/v1/completions", json=body, headers=sid).status_code == 200
        first = state.policy.sessions.get("carol", state.policy.clock())
        assert first is not None
        dns.answers[DECODE_NAME] = {"10.0.1.1", "10.0.1.2"} - {httpx.URL(first.decode_url).host}
        client.portal.call(state.discovery.run_round)  # type: ignore[union-attr]
        fleet.served.clear()
        assert client.post("/v1/completions", json=body, headers=sid).status_code == 200
        (decode_call,) = [u for u in fleet.served if u.endswith("/v1/completions")]
        assert not decode_call.startswith(first.decode_url)
        assert _metric(client, "kvduplex_router_instance_healthy", url=first.decode_url) == 0
        assert {i["url"] for i in client.get("/health").json()["instances"]} == {
            "http://10.0.0.1:8000", decode_call.removesuffix("/v1/completions")
        }


def test_instance_urls_put_ipv6_in_brackets() -> None:
    assert instance_url("10.1.2.3", 8000) == "http://10.1.2.3:8000"
    assert instance_url("fd00::5", 8000) == "http://[fd00::5]:8000"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"decode_dns": "decode-headless"}, "decode_dns must be HOST:PORT"),
        ({"decode_dns": "decode-headless:http"}, "decode_dns must be HOST:PORT"),
        ({"decode_dns": "d:8000", "prefill_dns": "http://p:8000"}, "prefill_dns must be"),
        ({"decode_dns": "d:8000", "dns_server": "dns.local"}, "dns_server is an IP address"),
        ({"decode_dns": "d:8000", "dns_interval_s": 0}, "dns_interval_s must be > 0"),
        ({}, "--decode URL, or --decode-dns NAME:PORT"),
    ],
)
def test_bad_dns_settings_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**config)


def test_the_dns_resolver_reads_a_and_aaaa_records_and_tells_failures() -> None:
    with StaticDns() as server:
        server.set("decode.kv.svc", ["127.0.0.2", "127.0.0.3", "fd00::7"])
        server.set("empty.kv.svc", [])
        resolve = DnsResolver(server.address)
        assert asyncio.run(resolve("decode.kv.svc")) == {"127.0.0.2", "127.0.0.3", "fd00::7"}
        assert asyncio.run(resolve("empty.kv.svc")) == set()
        assert asyncio.run(resolve("missing.kv.svc")) == set(), "NXDOMAIN: no instance"
        port = int(server.address.rsplit(":", 1)[1])
    silent = DnsResolver(f"127.0.0.1:{port}", timeout_s=0.3)  # nothing answers there now
    with pytest.raises(ResolveFailed):
        asyncio.run(silent("decode.kv.svc"))


def test_a_fully_qualified_name_is_asked_as_it_is() -> None:
    """A name with its final dot (as the manifests give the Services' names) is one
    question per record type: no search domain is tried before or after it."""
    with StaticDns() as server:
        server.set("decode.kv.svc.cluster.local", ["10.1.2.3"])
        resolve = DnsResolver(server.address)
        assert asyncio.run(resolve("decode.kv.svc.cluster.local.")) == {"10.1.2.3"}
        assert server.num_queries == 2


def test_a_round_that_fails_unexpectedly_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A resolver answer that is not an address: the round fails, logged; discovery goes
    on and the next round, with a good answer, adds the instance."""
    fleet = Fleet()
    fleet.roles = {"10.0.1.1": "decode"}
    answers = [{"not-an-address"}, {"10.0.1.1"}]
    num_resolved = 0
    third_round = asyncio.Event()  # set as it begins: the second one (rounds run in turn) ended

    async def resolve(name: str) -> set[str]:
        nonlocal num_resolved
        num_resolved += 1
        if num_resolved == 3:
            third_round.set()
        return answers.pop(0) if len(answers) > 1 else answers[0]

    cfg = RouterConfig(decode_dns=f"{DECODE_NAME}:8001", dns_interval_s=0.01)
    state = RouterState.create(
        cfg, ByteTokenizer(), make_client=mock_instances(fleet.handle), resolve=resolve
    )
    assert state.discovery is not None
    discovery = state.discovery

    async def two_rounds() -> None:
        rounds = asyncio.create_task(run_discovery(discovery, interval_s=0.01))
        await third_round.wait()
        rounds.cancel()

    with caplog.at_level(logging.ERROR, logger="kvduplex.router.discovery"):
        asyncio.run(asyncio.wait_for(two_rounds(), timeout=10))
    assert f"decode DNS {DECODE_NAME}: the round failed" in caplog.text
    assert [b.url for b in state.policy.decode.backends] == ["http://10.0.1.1:8001"]
