"""The router's client to the instances (`wire.WirePool`), as the flows, probes and
discovery call it: its errors keep the meanings the flows act on, and an answer closed
while it is read ends the read."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvduplex.cluster import free_port
from kvduplex.router import client as rc
from kvduplex.router.state import json_body
from kvduplex.router.wire import WirePool
from tests.support.fake_instances import MockInstances

_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_ONE_EVENT = b"b\r\ndata: one\n\n\r\n"  # one HTTP chunk: 11 bytes


def _pool(headers: dict[str, str] | None = None) -> WirePool:
    return WirePool(headers or {}, 5.0, 600.0)


def test_a_refused_connection_is_a_connect_error() -> None:
    """A D that never saw the request: `flows.DecodeUnreachable` routes it again."""

    async def run() -> None:
        pool = _pool()
        with pytest.raises(rc.ConnectError):
            await pool.get(f"http://127.0.0.1:{free_port()}/v1/completions", 5.0)

    asyncio.run(run())


def test_a_connection_closed_after_the_request_is_not_a_connect_error() -> None:
    """The instance read the request, then closed its connection: not "unreachable"."""
    seen: list[bytes] = []

    async def close_after_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(close_after_request, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = _pool()
        async with server:
            with pytest.raises(rc.RemoteProtocolError):
                await pool.get(f"http://127.0.0.1:{port}/v1/completions", 5.0)
        pool.close()

    asyncio.run(run())
    assert seen and seen[0].startswith(b"GET /v1/completions")


def test_a_stream_cut_mid_answer_ends_its_read_with_an_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD + _ONE_EVENT)
        await writer.drain()
        writer.close()

    async def run() -> list[bytes]:
        server = await asyncio.start_server(cut, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        parts: list[bytes] = []
        pool = _pool()
        async with server:
            resp = await pool.post_stream(f"http://127.0.0.1:{port}/", b"{}")
            with pytest.raises(rc.CallError):
                async for part in resp:
                    parts.append(part)
            await resp.aclose()
        pool.close()
        return parts

    assert b"".join(asyncio.run(run())) == b"data: one\n\n"


def test_closing_an_answer_ends_a_read_in_flight_and_the_connection() -> None:
    """What `relay.relay` does when D is marked unhealthy mid-answer: D sees its
    connection closed."""
    closed = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD + _ONE_EVENT)
        await writer.drain()
        await reader.read()  # b"" once the router closes the connection
        closed.set()
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = _pool()
        async with server:
            resp = await pool.post_stream(f"http://127.0.0.1:{port}/", b"")
            parts: list[bytes] = []
            got_one = asyncio.Event()

            async def read() -> None:
                async for part in resp:
                    parts.append(part)
                    got_one.set()  # this task goes on to wait for D's next bytes

            reading = asyncio.ensure_future(read())
            await got_one.wait()
            await resp.aclose()
            with pytest.raises(rc.ReadError):
                await asyncio.wait_for(reading, 10)
            await asyncio.wait_for(closed.wait(), 10)
            assert parts == [b"data: one\n\n"]
        pool.close()

    asyncio.run(run())


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The next request on a connection, head and body (None: the client closed it)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lower = head.lower()
    if b"content-length: " not in lower:
        return head
    length = int(lower.split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


def test_calls_post_json_with_the_routers_headers_over_real_sockets() -> None:
    """The flows' POSTs: the body as JSON with the router's headers and the call's own, a
    whole answer read and its connection given back for the next call, a streamed one
    left for its reader; a probe's GET without the router's credentials, and
    ``/v1/models``' with them."""
    requests: list[bytes] = []
    connections: list[asyncio.StreamWriter] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while (request := await _read_request(reader)) is not None:
            requests.append(request)
            if b"/stream" in request.split(b"\r\n")[0]:
                writer.write(_STREAM_HEAD + _ONE_EVENT + b"0\r\n\r\n")
            else:
                writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n{"ok": true}')
            await writer.drain()
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = _pool({"x-secret": "s"})
        try:
            url = f"http://127.0.0.1:{port}"
            got = await pool.post_whole(url + "/prefill", json_body({"user": "\ud800", "n": 1}))
            assert got.status_code == 200 and got.json() == {"ok": True}
            streamed = await pool.post_stream(url + "/stream", b"{}", {"x-raw": "1"})
            assert [part async for part in streamed] == [b"data: one\n\n"]
            await streamed.aclose()
            assert (await pool.get(url + "/ready", 5.0)).json() == {"ok": True}
            models = await pool.get(url + "/v1/models", 5.0, credentials=True)
            assert models.json() == {"ok": True}
        finally:
            pool.close()
            server.close()
            await server.wait_closed()
        assert len(connections) == 1  # each answer's connection served the next call
        first, second, probe, listing = (r.lower() for r in requests)
        assert b"x-secret: s" in first and b"content-type: application/json" in first
        assert first.endswith(b'{"user": "\\ud800", "n": 1}')  # a lone surrogate escaped
        assert b"x-raw: 1" in second and b"x-secret: s" in second
        assert probe.startswith(b"get /ready http/1.1") and b"x-secret" not in probe
        assert listing.startswith(b"get /v1/models") and b"x-secret: s" in listing

    asyncio.run(run())


def test_calls_tell_connection_errors_apart() -> None:
    """A refused connection is a connect error (the request is routed again), a
    connection closed after the request is not, whole answer or stream."""

    async def close_after_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(close_after_request, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = _pool()
        try:
            with pytest.raises(rc.ConnectError):
                await pool.post_whole(f"http://127.0.0.1:{free_port()}/x", b"{}")
            with pytest.raises(rc.RemoteProtocolError):
                await pool.post_whole(f"http://127.0.0.1:{port}/x", b"{}")
            with pytest.raises(rc.RemoteProtocolError):
                await pool.post_stream(f"http://127.0.0.1:{port}/x", b"{}")
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(run())


def test_whole_answers_read_the_same_over_the_wire_and_from_the_tests_fakes() -> None:
    """`post_whole` (P's answer, cancels, releases) and `post_stream` read whole: over the
    router's own client and from the tests' fake instances (`MockInstances`), the same
    status, body, JSON, text and headers; over the wire, each call on the one kept-alive
    connection."""
    body = b'{"xid": "x", "first_token": 65}'
    answer_bytes = (
        b"HTTP/1.1 409 Conflict\r\ncontent-type: application/json\r\nx-request-id: r1\r\n"
    )
    answer_bytes += b"content-length: %d\r\n\r\n%s" % (len(body), body)
    connections: list[asyncio.StreamWriter] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while await _read_request(reader) is not None:
            writer.write(answer_bytes)
            await writer.drain()
        writer.close()

    def mock(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "application/json", "x-request-id": "r1"}
        return httpx.Response(409, headers=headers, content=body)

    async def run() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/internal/push/prefill"
        over_wire = _pool()
        fakes = MockInstances(mock)
        try:
            for calls in (over_wire, fakes):
                whole = await calls.post_whole(url, b'{"xid": "x"}')
                streamed = await calls.post_stream(url, b'{"xid": "x"}')
                content = await streamed.read()
                assert whole.status_code == streamed.status_code == 409
                assert whole.content == content == body
                assert whole.json() == streamed.json() == {"xid": "x", "first_token": 65}
                assert whole.text == content.decode()
                assert whole.header(b"x-request-id") == streamed.header(b"x-request-id") == "r1"
        finally:
            over_wire.close()
            server.close()
            await server.wait_closed()
        assert len(connections) == 1  # both calls on one connection, given back after each

    asyncio.run(run())
