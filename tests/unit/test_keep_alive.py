"""Idle connections from the router to an instance: the router, their client, closes them
before the instance, their server, would, so that no call is written on a connection just
as its server closes it (no client resends a POST); and it keeps them long enough to reuse
them across a session's pause."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import kvduplex.server.router.app as router_app
from kvduplex.server.cli import parse_args
from kvduplex.server.cli import router_config
from kvduplex.server.cluster import free_port
from kvduplex.server.drain import KEEP_ALIVE_S
from kvduplex.server.drain import DrainingServer
from kvduplex.server.drain import DrainState
from kvduplex.server.drain import uvicorn_config
from kvduplex.server.router.state import POOL_IDLE_S
from kvduplex.server.router.state import InstanceCalls
from kvduplex.server.router.state import InstanceTransport
from kvduplex.server.router.state import instance_session

TIMEOUT_S = 30.0


def test_the_router_closes_an_idle_connection_before_the_instance_does() -> None:
    config = uvicorn_config(_Peers(), "127.0.0.1", 0)
    assert config.timeout_keep_alive == KEEP_ALIVE_S
    assert POOL_IDLE_S < KEEP_ALIVE_S
    assert POOL_IDLE_S >= 30  # an agent's pause between turns finds the connection open


def test_the_router_serves_with_the_same_keep_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own clients (a load balancer's pool among them) close first too."""
    served: list[DrainingServer] = []

    class NotServing(DrainingServer):
        def run(self, sockets: Any = None) -> None:
            served.append(self)

    monkeypatch.setattr(router_app, "DrainingServer", NotServing)
    monkeypatch.setattr(router_app, "settle_heap", lambda: None)  # no gc.freeze in the tests
    args = parse_args(["router", "--model", "tiny", "--decode", "http://127.0.0.1:9"])
    assert router_app.serve_router(router_config(args)) == 0
    (server,) = served
    assert server.config.timeout_keep_alive == KEEP_ALIVE_S


class _Peers:
    """An instance's stand-in: answers every request with JSON, noting each one's client
    address (its port tells one connection from another)."""

    def __init__(self) -> None:
        self.clients: list[tuple[str, int]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.clients.append(scope["client"])
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"{}"})


def test_the_router_reuses_its_connection_to_an_instance() -> None:
    """Two calls one after the other over the router's own client to a server run as an
    instance runs it: one connection."""

    async def main() -> list[tuple[str, int]]:
        peers = _Peers()
        port = free_port()
        server = DrainingServer(uvicorn_config(peers, "127.0.0.1", port), DrainState())
        serving = asyncio.create_task(server.serve())
        transport = InstanceTransport(client=instance_session)
        calls = InstanceCalls(transport, {}, httpx.Timeout(TIMEOUT_S))
        try:
            async with asyncio.timeout(TIMEOUT_S):
                while not server.started:
                    await asyncio.sleep(0.01)
                for _ in range(2):
                    resp = await calls.post(f"http://127.0.0.1:{port}/v1/x", {"n": 1})
                    assert resp.status_code == 200 and resp.json() == {}
        finally:
            await transport.aclose()
            server.should_exit = True
            await serving
        return peers.clients

    first, second = asyncio.run(main())
    assert first == second
