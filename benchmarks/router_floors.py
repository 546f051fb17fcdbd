"""The floors of `bench_router_capacity.py`: relays that call P and D as the push router
does and pipe D's stream back, with less of the router in each (raw asyncio; uvicorn and
aiohttp; uvicorn with the router's client; that inside the router's guards, validating
and relaying as the router does), run as processes of their
own: ``python benchmarks/router_floors.py --floor-relay|--stack-floor|--client-floor|
--app-floor PORT P_PORT D_PORT``."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
import uvicorn
from pydantic import TypeAdapter

from benchmarks.router_stub import read_request
from kvduplex.common.auth import APIKeyGuard
from kvduplex.common.config import ROUTER_POOL_IDLE_S
from kvduplex.common.drain import DrainGuard
from kvduplex.common.drain import DrainState
from kvduplex.common.guard import BodyCap
from kvduplex.common.openai.protocol import CompletionRequest
from kvduplex.router.app import _parse_body
from kvduplex.router.app import _read_body
from kvduplex.router.client import StreamedAnswer
from kvduplex.router.relay import relay
from kvduplex.router.state import CONNECT_TIMEOUT_S
from kvduplex.router.state import READ_TIMEOUT_S
from kvduplex.router.wire import WirePool

FLAGS = ("--floor-relay", "--stack-floor", "--client-floor", "--app-floor")
"""The floors, as `main` takes them (``--ladder``'s rungs last)."""


class FloorRelay:
    """The least a push relay does, in raw asyncio streams: per client connection one
    kept-alive connection to P and one to D; each request goes to both at once (P's
    prefill, D's stream, as the router sends them), and D's HTTP chunks are piped back as
    they come, unparsed. No routing, JSON, tokenizing, validation or framework: what it
    adds to TTFT is the floor under a Python relay's on this machine (its process, pinned
    as the router is, and the hops between cores)."""

    def __init__(self, p_port: int, d_port: int) -> None:
        self.p_port, self.d_port = p_port, d_port

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        p_reader, p_writer = await asyncio.open_connection("127.0.0.1", self.p_port)
        d_reader, d_writer = await asyncio.open_connection("127.0.0.1", self.d_port)
        prefill = b'{"xid": "floor"}'
        p_request = (
            b"POST /internal/push/prefill HTTP/1.1\r\nhost: p\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(prefill), prefill)
        )
        try:
            while True:
                _, path, body = await read_request(reader)
                p_writer.write(p_request)
                d_writer.write(
                    b"POST %s HTTP/1.1\r\nhost: d\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
                )
                p_head = await p_reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", p_head, re.IGNORECASE)
                await p_reader.readexactly(int(length.group(1)) if length else 0)
                writer.write(await d_reader.readuntil(b"\r\n\r\n"))
                while True:
                    line = await d_reader.readuntil(b"\r\n")
                    size = int(line[:-2], 16)
                    writer.write(line + await d_reader.readexactly(size + 2))
                    if size == 0:
                        break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for w in (writer, p_writer, d_writer):
                w.close()


class StackFloor:
    """The router's own server and client stack with nothing of the router in it: one
    ASGI callable under uvicorn (uvloop, httptools, as `kvduplex router` runs), calling P
    and D with aiohttp's client (one pooled session, as the router's client was until
    `wire.py`) in the
    push router's order (P's call started first, in a task; D's stream opened; P's answer
    awaited) and sending D's parts on as aiohttp reads them, unparsed. No routing, JSON,
    tokenizing, middleware or framework. What it adds is the floor under any relay built on
    this stack on this machine, as `FloorRelay`'s is under any Python relay."""

    def __init__(self, p_port: int, d_port: int) -> None:
        self.p_url = f"http://127.0.0.1:{p_port}/internal/push/prefill"
        self.d_url = f"http://127.0.0.1:{d_port}"
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # `wait_ready`
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        if self.session is None:  # made in the server's event loop
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=ROUTER_POOL_IDLE_S)
            self.session = aiohttp.ClientSession(connector=connector)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        prefill = asyncio.ensure_future(self._prefill(self.session))
        await asyncio.sleep(0)  # P's call goes out first
        url = self.d_url + scope["path"]
        async with self.session.post(url, data=body, headers=_JSON_HEADERS) as d:
            await prefill
            head = [(b"content-type", d.headers["content-type"].encode())]
            await send({"type": "http.response.start", "status": d.status, "headers": head})
            async for part in d.content.iter_any():
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _prefill(self, session: aiohttp.ClientSession) -> None:
        async with session.post(self.p_url, data=b'{"xid": "floor"}', headers=_JSON_HEADERS) as p:
            await p.read()


_JSON_HEADERS = {"content-type": "application/json"}


class ClientFloor(StackFloor):
    """`StackFloor` with the router's own client to the instances (`wire.WirePool`; D's
    stream read as the relay reads it). The first rung of ``--ladder``."""

    pool: WirePool | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "GET":
            return await super().__call__(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        d = await self.open(body, scope["path"])
        head = [(b"content-type", (d.header(b"content-type") or "").encode())]
        await send({"type": "http.response.start", "status": d.status_code, "headers": head})
        try:
            async for part in d:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        finally:
            await d.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def open(self, request: bytes, path: str) -> StreamedAnswer:
        """P called and D's stream opened as `StackFloor` does, through the router's client;
        D's answer once P answered."""
        if self.pool is None:
            self.pool = WirePool({}, CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
        prefill = asyncio.ensure_future(self.pool.post_whole(self.p_url, b'{"xid": "floor"}'))
        await asyncio.sleep(0)  # P's call goes out first
        d = await self.pool.post_stream(self.d_url + path, request)
        (await prefill).json()
        return d


class AppFloor:
    """`ClientFloor`'s relay inside the router's guards (as `router.app.create_router_app`
    wraps its app), the body read, parsed and validated as the router's route does, the
    answer sent by the router's `relay.relay`. The second rung of ``--ladder``: what is
    left between it and the router is the router's own work (prompt, routing, sessions,
    splice, answer tap)."""

    def __init__(self, p_port: int, d_port: int) -> None:
        self.client = ClientFloor(p_port, d_port)
        self.adapter = TypeAdapter(CompletionRequest)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "GET":
            return await self.client(scope, receive, send)
        body = await _read_body(receive)
        self.adapter.validate_python(_parse_body(scope, body), from_attributes=True)
        d = await self.client.open(body, "/v1/completions")
        await relay(d, aiter(d), lambda failed: None, "decode")(scope, receive, send)


def app_floor(p_port: int, d_port: int) -> Any:
    """An `AppFloor` inside the router's guards."""
    app: Any = AppFloor(p_port, d_port)
    app = DrainGuard(app, drain=DrainState())
    app = BodyCap(app, max_body_bytes=1 << 20)
    return APIKeyGuard(app, api_key=None)


def serve_stack_floor(port: int, p_port: int, d_port: int, rung: str = "stack") -> None:
    """Run a `StackFloor` (`rung`: or a `ClientFloor`, or an `app_floor`) on
    127.0.0.1:`port` until killed."""
    rungs: dict[str, Callable[[int, int], Any]] = {
        "stack": StackFloor, "client": ClientFloor, "app": app_floor,
    }  # fmt: skip
    app = rungs[rung](p_port, d_port)
    uvicorn.run(
        app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="off",
        log_level="warning", backlog=4096,
    )  # fmt: skip


def serve_floor_relay(port: int, p_port: int, d_port: int) -> None:
    """Run a `FloorRelay` on 127.0.0.1:`port` until killed."""

    async def main() -> None:
        relay = FloorRelay(p_port, d_port)
        server = await asyncio.start_server(relay.serve, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def main() -> None:
    """Serve the floor that ``argv[1]`` names on the ports that follow it."""
    flag = sys.argv[1]
    if flag not in FLAGS:
        raise SystemExit(f"usage: router_floors.py {'|'.join(FLAGS)} PORT P_PORT D_PORT")
    port, p_port, d_port = (int(a) for a in sys.argv[2:5])
    if flag == "--floor-relay":
        serve_floor_relay(port, p_port, d_port)
    else:
        serve_stack_floor(port, p_port, d_port, flag.removeprefix("--").removesuffix("-floor"))


if __name__ == "__main__":
    main()
