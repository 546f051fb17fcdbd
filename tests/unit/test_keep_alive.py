"""Idle connections to a kvduplex server: their client closes them first. The router
reuses an idle connection to an instance for at most `ROUTER_POOL_IDLE_S`; an instance
keeps one open longer (``--keep-alive-s``), so that no call is written on a connection
just as its server closes it (no client sends a POST again). A draining server asks its
clients to close (``connection: close``), so that they reconnect to one that takes work."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

import kvduplex.router.app as router_app
import kvduplex.router.wire as wire
from kvduplex.cli.main import parse_args
from kvduplex.cluster import free_port
from kvduplex.common.config import ROUTER_POOL_IDLE_S
from kvduplex.common.drain import DrainGuard
from kvduplex.common.drain import DrainingServer
from kvduplex.common.drain import DrainState
from kvduplex.common.drain import uvicorn_config
from kvduplex.instance.config import ServerConfig
from kvduplex.router.wire import WirePool

TIMEOUT_S = 30.0


def test_an_instance_keeps_an_idle_connection_longer_than_the_router_reuses_it() -> None:
    assert ServerConfig().keep_alive_s > ROUTER_POOL_IDLE_S >= 30  # an agent's pause fits
    with pytest.raises(ValueError, match="keep_alive_s must be > 60"):
        ServerConfig(keep_alive_s=ROUTER_POOL_IDLE_S)
    with pytest.raises(ValueError, match="keep_alive_s must be > 0"):
        parse_args(["router", "--decode", "http://d:1", "--keep-alive-s", "0"]).router_config()


def test_the_routers_keep_alive_flag_reaches_its_server(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[DrainingServer] = []

    class NotServing(DrainingServer):
        def run(self, sockets: Any = None) -> None:
            served.append(self)

    monkeypatch.setattr(router_app, "DrainingServer", NotServing)
    monkeypatch.setattr(router_app, "settle_heap", lambda: None)  # no gc.freeze in the tests
    args = parse_args(["router", "--model", "tiny", "--decode", "http://127.0.0.1:9",
                       "--keep-alive-s", "90"])  # fmt: skip
    assert router_app.serve_router(args.router_config()) == 0
    (server,) = served
    assert server.config.timeout_keep_alive == 90


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
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"{}"})


async def _serving(app: Any, port: int) -> tuple[DrainingServer, asyncio.Task[None]]:
    """`app` served on `port` as an instance serves (its keep-alive 5 s). The socket
    listens before the server starts: connections wait in its backlog until it takes them."""
    listener = socket.create_server(("127.0.0.1", port))
    server = DrainingServer(uvicorn_config(app, "127.0.0.1", port, 5), DrainState())
    task = asyncio.create_task(server.serve(sockets=[listener]))
    return server, task


def test_the_router_reuses_an_idle_connection_only_within_its_pool_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over the router's own client: calls close together share a connection; a call after
    longer than the pool's idle time opens another (the instance, which keeps it 5 s here,
    has not closed it yet: the router let it go first)."""
    monkeypatch.setattr(wire, "ROUTER_POOL_IDLE_S", 0.2)

    async def main() -> list[tuple[str, int]]:
        peers, port = _Peers(), free_port()
        pool = WirePool({}, TIMEOUT_S, TIMEOUT_S)
        async with asyncio.timeout(TIMEOUT_S):
            server, serving = await _serving(peers, port)
            try:
                for idle_s in (0.0, 0.0, 0.5):
                    await asyncio.sleep(idle_s)  # the idle time under test
                    resp = await pool.post_whole(f"http://127.0.0.1:{port}/v1/x", b'{"n": 1}')
                    assert resp.status_code == 200 and resp.json() == {}
            finally:
                pool.close()
                server.should_exit = True
                await serving
        return peers.clients

    first, second, third = asyncio.run(main())
    assert first == second  # reused
    assert third != second  # idle past the pool's time: a new connection


def test_a_draining_server_asks_its_clients_to_close_their_connections() -> None:
    """One kept-alive connection: before the drain its responses keep it open; once the
    drain began, a response (a refusal of new work, and a probe's answer) says
    ``connection: close`` and the server closes the connection after it."""

    async def request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, path: str
    ) -> bytes:
        body = b"{}" if method == "POST" else b""
        writer.write(
            b"%s %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (method.encode(), path.encode(), len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        return head.lower()

    async def main() -> list[bytes]:
        drain, port = DrainState(), free_port()
        app = DrainGuard(_Peers(), drain)
        heads = []
        async with asyncio.timeout(TIMEOUT_S):
            server, serving = await _serving(app, port)
            try:
                for path in ("/v1/x", "/health"):
                    drain.is_draining = False
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    heads.append(await request(reader, writer, "POST", path))
                    drain.is_draining = True
                    heads.append(await request(reader, writer, "POST", path))
                    assert await reader.read() == b""  # the server closed it
                    writer.close()
            finally:
                drain.is_draining = False
                server.should_exit = True
                await serving
        return heads

    before, refused, probe_before, probe_during = asyncio.run(main())
    assert b"200 ok" in before and b"connection: close" not in before
    assert b"503" in refused and b"connection: close" in refused
    assert b"200 ok" in probe_before and b"connection: close" not in probe_before
    assert b"200 ok" in probe_during and b"connection: close" in probe_during
