"""Instances that leave DNS with calls in flight: they get no new work, their streams
go on and finish as they would have, and they are still probed until nothing is in
flight to them, so one that goes silent is marked down and its streams end with the
error event as for any instance. One that comes back meanwhile rejoins as the same
backend. A decode instance over httpx MockTransport, found by an injected resolver.

The app runs without its lifespan (httpx ASGITransport): no prober and no discovery run
but the rounds a test makes itself (`probe_all`, `Discovery.run_round`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.backends import Backend
from kvduplex.router.backends import BackendPool
from kvduplex.router.backends import Outcome
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import probe_all
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router_discovery import DECODE_NAME
from tests.unit.test_router_discovery import FakeDns
from tests.unit.test_router_hung import OpenStream

D = "http://10.0.1.1:8001"
ANSWER_IDS = [65, 66, 67]
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True,
        "return_token_ids": True}  # fmt: skip
BOUND_S = 10.0
"""A bound for a failing run only: a stream that is never ended would wait here."""


class Decode:
    """One decode instance: its /health names its role; its stream sends one token, then
    waits for `go_on` (or its close) before the rest. `is_silent`: its probes time out."""

    def __init__(self) -> None:
        self.is_silent = False
        self.waiting = asyncio.Event()
        """Set when its stream sent its first token and waits."""
        self.go_on = asyncio.Event()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            if self.is_silent:
                raise httpx.ReadTimeout("timed out", request=request)
            return httpx.Response(200, json={"status": "ok", "role": "decode", "engine_id": "e"})
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_Stream(self))


class _Stream(OpenStream):
    """D's answer on an open connection (`OpenStream`)."""

    def __init__(self, d: Decode) -> None:
        super().__init__()
        self.d = d

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i, tok in enumerate(ANSWER_IDS):
            if i == 1:
                self.d.waiting.set()
                await self._until(self.d.go_on)
            finish = "length" if i == len(ANSWER_IDS) - 1 else None
            choice = {"index": 0, "text": chr(tok), "token_ids": [tok], "finish_reason": finish}
            yield f"data: {json.dumps({'id': 'cmpl-d', 'choices': [choice]})}\n\n".encode()
        yield b"data: [DONE]\n\n"


class Router:
    """The router's state over `Decode`, found by DNS; its app, and the rounds the tests
    drive."""

    def __init__(self, d: Decode) -> None:
        self.dns = FakeDns()
        self.dns.answers[DECODE_NAME] = {"10.0.1.1"}
        cfg = RouterConfig(decode_dns=f"{DECODE_NAME}:8001", health_interval_s=60.0,
                           dns_interval_s=60.0)  # fmt: skip
        self.state = RouterState.create(
            cfg, ByteTokenizer(), make_client=mock_instances(d.handle), resolve=self.dns
        )
        self.app = httpx.ASGITransport(app=create_router_app(self.state))

    async def resolve(self, *addresses: str) -> None:
        """DNS answers `addresses` now, and a discovery round sees it."""
        assert self.state.discovery is not None
        self.dns.answers[DECODE_NAME] = set(addresses)
        await self.state.discovery.run_round()

    async def probe(self) -> None:
        await probe_all(self.state.client, self.state.policy, 1.0)

    async def post(self, body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(transport=self.app, base_url="http://router") as client:
            return await client.post("/v1/completions", json=body, timeout=BOUND_S)

    def probed(self) -> list[str]:
        return [b.url for b in self.state.policy.decode.to_probe()]


def _events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]


def _tokens(events: list[str]) -> list[int]:
    chunks = [json.loads(data) for data in events if data != "[DONE]"]
    return [t for c in chunks if "choices" in c for t in c["choices"][0]["token_ids"]]


async def _streaming(router: Router, d: Decode) -> tuple[asyncio.Task[httpx.Response], Backend]:
    """D joins; a stream starts on it and waits after its first token."""
    await router.resolve("10.0.1.1")
    (backend,) = router.state.policy.decode.backends
    answer = asyncio.create_task(router.post(BODY))
    await asyncio.wait_for(d.waiting.wait(), BOUND_S)
    return answer, backend


def test_a_silent_instance_that_left_dns_is_probed_until_its_stream_ends() -> None:
    """1. D streams and leaves DNS: no new work for it (503, no decode), its stream goes
    on, it is still probed; 2. it goes silent: one failed probe changes nothing; 3. the
    second marks it down and the stream ends with the error event, once; 4. nothing in
    flight to it: it is probed no more."""
    d = Decode()

    async def run() -> None:
        router = Router(d)
        answer, backend = await _streaming(router, d)
        await router.resolve()  # 1.
        assert router.state.policy.decode.backends == [] and router.probed() == [D]
        refused = await router.post(BODY)
        assert refused.status_code == 503, refused.text
        assert backend.in_flight == 1 and not answer.done()
        d.is_silent = True  # 2.
        await router.probe()
        assert backend.num_failed_probes == 1 and not backend.is_down and not answer.done()
        await router.probe()  # 3.
        resp = await asyncio.wait_for(answer, BOUND_S)
        events = _events(resp)
        assert resp.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "decode_failed" and "marked unhealthy" in error["message"]
        assert _tokens(events[:-2]) == ANSWER_IDS[:1]
        assert backend.is_down and backend.in_flight == 0 and not backend.watchers
        assert router.probed() == []  # 4.
        await router.state.aclose()

    asyncio.run(run())


def test_an_instance_that_left_dns_finishes_its_stream() -> None:
    """Leaving DNS alone ends nothing: D, still answering its probes, finishes the stream
    it has (every token, no error), and is then probed no more."""
    d = Decode()

    async def run() -> None:
        router = Router(d)
        answer, backend = await _streaming(router, d)
        await router.resolve()
        for _ in range(3):
            await router.probe()
        assert backend.is_healthy and not answer.done() and router.probed() == [D]
        d.go_on.set()
        resp = await asyncio.wait_for(answer, BOUND_S)
        events = _events(resp)
        assert resp.status_code == 200 and events[-1] == "[DONE]"
        assert not [e for e in events if "error" in e] and _tokens(events) == ANSWER_IDS
        assert backend.in_flight == 0 and router.probed() == []
        await router.state.aclose()

    asyncio.run(run())


def test_an_instance_back_in_dns_while_leaving_rejoins_as_the_same_backend() -> None:
    """D leaves DNS mid-stream and comes back: it rejoins as the same backend (its stream
    still counted on it, still watched): marked down by its probes, its stream ends."""
    d = Decode()

    async def run() -> None:
        router = Router(d)
        answer, backend = await _streaming(router, d)
        await router.resolve()
        await router.resolve("10.0.1.1")
        (rejoined,) = router.state.policy.decode.backends
        assert rejoined is backend and backend.in_flight == 1 and router.probed() == [D]
        d.is_silent = True
        await router.probe()
        await router.probe()
        resp = await asyncio.wait_for(answer, BOUND_S)
        assert json.loads(_events(resp)[-2])["error"]["code"] == "decode_failed"
        assert backend.in_flight == 0 and router.probed() == [D], "still an instance"
        await router.state.aclose()

    asyncio.run(run())


def test_a_pool_forgets_a_removed_instance_once_nothing_is_in_flight_to_it() -> None:
    """1. removed idle: not probed; 2. removed with a call in flight: probed, never routed
    to, and only its own backend may rejoin; 3. its call ends: probed no more."""
    pool = BackendPool(["http://a", "http://b", "http://c"], half_life_s=30.0)
    a, b = pool.by_url("http://a"), pool.by_url("http://b")
    assert a is not None and b is not None
    assert pool.remove("http://a") is a  # 1.
    assert pool.to_probe() == pool.backends and pool.try_leaving("http://a") is None
    pool.assign(b, 0.0)  # 2.
    assert pool.remove("http://b") is b
    assert [x.url for x in pool.to_probe()] == ["http://c", "http://b"]
    assert pool.by_url("http://b") is None and pool.healthy() == pool.backends
    assert pool.try_least_loaded(0.0) is pool.by_url("http://c")
    assert pool.try_leaving("http://b") is b
    with pytest.raises(ValueError, match="left with calls in flight"):
        pool.add(Backend("http://b"))
    pool.done(b, Outcome.OK, 1.0)  # 3.
    assert [x.url for x in pool.to_probe()] == ["http://c"]
    assert pool.try_leaving("http://b") is None
    pool.add(Backend("http://b"))
