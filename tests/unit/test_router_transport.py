"""The router's client to the instances (httpx over aiohttp): its errors keep the meanings
the flows act on, and a response closed while it is read ends the read."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvduplex.cluster import free_port
from kvduplex.router.state import InstanceTransport
from kvduplex.router.state import instance_session

_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_ONE_EVENT = b"b\r\ndata: one\n\n\r\n"  # one HTTP chunk: 11 bytes


def _client() -> httpx.AsyncClient:
    transport = InstanceTransport(client=instance_session)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), transport=transport)


def test_a_refused_connection_is_a_connect_error() -> None:
    """A D that never saw the request: `flows.DecodeUnreachable` routes it again."""

    async def run() -> None:
        async with _client() as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{free_port()}/v1/completions")

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
        async with server, _client() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(f"http://127.0.0.1:{port}/v1/completions")

    asyncio.run(run())
    assert seen and seen[0].startswith(b"GET /v1/completions")


def test_a_stream_cut_mid_answer_ends_its_read_with_a_read_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_STREAM_HEAD + _ONE_EVENT)
        await writer.drain()
        writer.close()

    async def run() -> list[bytes]:
        server = await asyncio.start_server(cut, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        parts: list[bytes] = []
        async with server, _client() as client:
            request = client.build_request("GET", f"http://127.0.0.1:{port}/")
            resp = await client.send(request, stream=True)
            with pytest.raises(httpx.ReadError):
                async for part in resp.aiter_bytes():
                    parts.append(part)
        return parts

    assert b"".join(asyncio.run(run())) == b"data: one\n\n"


def test_closing_a_response_ends_a_read_in_flight_and_the_connection() -> None:
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
        async with server, _client() as client:
            request = client.build_request("GET", f"http://127.0.0.1:{port}/")
            resp = await client.send(request, stream=True)
            parts: list[bytes] = []
            got_one = asyncio.Event()

            async def read() -> None:
                async for part in resp.aiter_bytes():
                    parts.append(part)
                    got_one.set()  # this task goes on to wait for D's next bytes

            reading = asyncio.ensure_future(read())
            await got_one.wait()
            await resp.aclose()
            with pytest.raises(httpx.TransportError):
                await asyncio.wait_for(reading, 10)
            await asyncio.wait_for(closed.wait(), 10)
            assert parts == [b"data: one\n\n"]

    asyncio.run(run())


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The next request on a connection, head and body (None: the client closed it)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


def test_instance_calls_post_json_with_the_routers_headers_over_real_sockets() -> None:
    """`InstanceCalls` (the flows' POSTs, sent to the transport directly): the body as JSON
    with the router's headers and the call's own, a whole answer read and its connection
    given back for the next call, a streamed one left for its reader."""
    from kvduplex.router.state import InstanceCalls

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
        transport = InstanceTransport(client=instance_session)
        calls = InstanceCalls(transport, {"x-secret": "s"}, httpx.Timeout(5.0))
        try:
            url = f"http://127.0.0.1:{port}"
            got = await calls.post(url + "/prefill", {"user": "\ud800", "n": 1})
            assert got.status_code == 200 and got.json() == {"ok": True} and got.is_closed
            streamed = await calls.post(url + "/stream", {}, {"x-raw": "1"}, stream=True)
            assert not streamed.is_closed  # the relay reads it
            assert [part async for part in streamed.aiter_bytes()] == [b"data: one\n\n"]
            await streamed.aclose()
        finally:
            await transport.aclose()
            server.close()
            await server.wait_closed()
        assert len(connections) == 1  # the whole answer's connection served the next call
        first, second = (r.lower() for r in requests)
        assert b"x-secret: s" in first and b"content-type: application/json" in first
        assert first.endswith(b'{"user": "\\ud800", "n": 1}')  # a lone surrogate escaped
        assert b"x-raw: 1" in second and b"x-secret: s" in second

    asyncio.run(run())


def test_instance_calls_tell_connection_errors_apart_as_the_transport_does() -> None:
    """`InstanceCalls.post` over the router's transport (no `httpx.Request`): a refused
    connection is a connect error (the request is routed again), a connection closed
    after the request is not."""
    from kvduplex.router.state import InstanceCalls

    async def close_after_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(close_after_request, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = InstanceTransport(client=instance_session)
        calls = InstanceCalls(transport, {}, httpx.Timeout(5.0))
        try:
            with pytest.raises(httpx.ConnectError):
                await calls.post(f"http://127.0.0.1:{free_port()}/x", {})
            for stream in (False, True):
                with pytest.raises(httpx.RemoteProtocolError):
                    await calls.post(f"http://127.0.0.1:{port}/x", {}, stream=stream)
        finally:
            await transport.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(run())


def test_instance_calls_whole_answers_read_the_same_over_the_wire_and_over_httpx() -> None:
    """`InstanceCalls.post_whole` (P's answer, cancels, releases): over the router's own
    client (`WirePool`, no `httpx.Response` made) and over any other transport (a test's,
    through httpx), the same status, body, JSON, text and headers as `post` reads; over
    the wire, each call on the one kept-alive connection."""
    from kvduplex.router.state import InstanceCalls

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
        wire_transport = InstanceTransport(client=instance_session)
        over_wire = InstanceCalls(wire_transport, {}, httpx.Timeout(5.0))
        over_httpx = InstanceCalls(httpx.MockTransport(mock), {}, httpx.Timeout(5.0))
        try:
            assert over_wire.wire is not None and over_httpx.wire is None
            for calls in (over_wire, over_httpx):
                whole = await calls.post_whole(url, {"xid": "x"})
                response = await calls.post(url, {"xid": "x"})
                assert whole.status_code == response.status_code == 409
                assert whole.content == response.content == body
                assert whole.json() == response.json() == {"xid": "x", "first_token": 65}
                assert whole.text == response.text
                assert httpx.Headers(whole.headers)["x-request-id"] == "r1"
        finally:
            await wire_transport.aclose()
            over_wire.close()
            server.close()
            await server.wait_closed()
        assert len(connections) == 1  # both calls on one connection, given back after each

    asyncio.run(run())
