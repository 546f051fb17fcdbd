"""The router's client for its calls to the instances (`wire.WirePool`), on real sockets:
answers framed each way HTTP/1.1 frames them, connections kept alive and reused only
when the answer was read to its end, closed when a call is cancelled or an answer is
left mid-body, and every fault an httpx error of the kind the flows tell apart.

Each server listens on 127.0.0.1 on a port the kernel picks, and is stopped by its test."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from dataclasses import dataclass
from dataclasses import field
from typing import TypeVar

import httpx
import pytest

from kvduplex.server.router import wire
from kvduplex.server.router.wire import WirePool

T = TypeVar("T")

BOUND_S = 10.0
"""A bound for a failing run only: what never comes would be waited for here."""
TIMEOUT = httpx.Timeout(BOUND_S, connect=BOUND_S)


async def _bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, BOUND_S)


def _whole(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body,
    )  # fmt: skip


def _chunked(*parts: bytes) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


@dataclass
class Server:
    """Answers each request on a connection with the next of `answers` (None: closes the
    connection instead; `closes_after_answer`: closes it after each), and notes what it saw: the requests, one list per connection,
    and when each connection was closed by the router."""

    answers: list[bytes | None]
    closes_after_answer: bool = False
    url: str = ""
    connections: list[list[bytes]] = field(default_factory=list)
    closed: asyncio.Queue[int] = field(default_factory=asyncio.Queue)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen: list[bytes] = []
        self.connections.append(seen)
        index = len(self.connections) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                seen.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.closes_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            await self.closed.put(index)  # the router closed the connection
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def _serving(server: Server) -> AsyncIterator[Server]:
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    async with listening:
        server.url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
        yield server


def _run(test: Awaitable[None]) -> None:
    asyncio.run(_bounded(test))


def test_answers_framed_each_way_are_read_whole_and_the_connection_reused() -> None:
    """A whole answer (content-length), a chunked stream and a big body read whole; one
    connection carries all three calls, each request as the instances read it."""
    big = b"x" * (3 * wire.HIGH_WATER_BYTES)  # past the high-water mark: read paused, resumed

    async def run() -> None:
        answers: list[bytes | None] = [_whole(b'{"a": 1}'), _chunked(b"data: 1\n\n", b"data: 2\n\n"),
                                       _whole(big)]  # fmt: skip
        async with _serving(Server(answers)) as server:
            pool = WirePool({"x-secret": "s"}, TIMEOUT)
            try:
                resp = await pool.post(server.url + "/internal/push/prefill", b'{"xid": "1"}')
                assert (resp.status_code, resp.json()) == (200, {"a": 1})
                resp = await pool.post(server.url + "/v1/completions", b"{}", stream=True)
                assert resp.headers["content-type"] == "text/event-stream"
                parts = [part async for part in resp.aiter_bytes()]
                assert b"".join(parts) == b"data: 1\n\ndata: 2\n\n"
                await resp.aclose()
                resp = await pool.post(server.url + "/v1/completions", b"{}")
                assert resp.content == big
            finally:
                pool.close()
        (requests,) = server.connections  # one connection, kept alive
        assert requests[0].startswith(b"POST /internal/push/prefill HTTP/1.1\r\n")
        head, _, body = requests[0].partition(b"\r\n\r\n")
        assert body == b'{"xid": "1"}'
        assert b"\r\nx-secret: s\r\n" in head and b"\r\ncontent-length: 12" in head
        assert f"\r\nhost: {server.url.removeprefix('http://')}\r\n".encode() in head

    _run(run())


def test_a_stream_left_mid_body_closes_its_connection() -> None:
    """An answer closed before its end (a client that left, an instance marked unhealthy)
    closes its connection, never returned to the pool with a body still coming: the next
    call opens another and gets its own answer."""

    async def run() -> None:
        stream_head = _chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")]  # no end: more to come
        async with _serving(Server([stream_head, _whole(b"{}")])) as server:
            pool = WirePool({}, TIMEOUT)
            try:
                resp = await pool.post(server.url + "/v1/completions", b"{}", stream=True)
                assert await resp.stream.next_part() == b"data: 1\n\n"  # type: ignore[attr-defined]
                await resp.aclose()
                assert await _bounded(server.closed.get()) == 0
                resp = await pool.post(server.url + "/internal/push/prefill", b"{}")
                assert resp.json() == {}
            finally:
                pool.close()
        assert [len(c) for c in server.connections] == [1, 1]

    _run(run())


def test_a_cancelled_call_closes_its_connection() -> None:
    """A call cancelled while it waits for its answer (the caller's cancel, or the one
    `calls.until_unhealthy` brings) closes its connection: the instance sees the router
    leave (and aborts the request), and no later call reads that answer."""

    async def run() -> None:
        gate = asyncio.Event()
        closed = asyncio.Event()

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            gate.set()
            await reader.read()  # until the router closes
            closed.set()
            writer.close()

        listening = await asyncio.start_server(hold, "127.0.0.1", 0)
        async with listening:
            url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
            pool = WirePool({}, TIMEOUT)
            try:
                for stream in (False, True):
                    gate.clear()
                    closed.clear()
                    call = asyncio.ensure_future(
                        pool.post(url + "/v1/completions", b"{}", stream=stream)
                    )
                    await _bounded(gate.wait())
                    call.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await call
                    await _bounded(closed.wait())
            finally:
                pool.close()

    _run(run())


@pytest.mark.parametrize(
    "answer,error",
    [
        (None, httpx.RemoteProtocolError),  # closed before any answer
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}", httpx.RemoteProtocolError),  # cut
        (b"SSH-2.0-OpenSSH_9.6\r\n", httpx.RemoteProtocolError),  # not HTTP
    ],
    ids=["closed", "cut_mid_body", "not_http"],
)
def test_an_answer_that_fails_is_an_httpx_error(
    answer: bytes | None, error: type[Exception]
) -> None:
    """The instance closes the connection before it answers, or mid-body, or answers
    what is not HTTP: the whole call fails with `httpx.RemoteProtocolError` (the request
    was sent: not an error the flows route again)."""

    async def run() -> None:
        async with _serving(Server([answer], closes_after_answer=True)) as server:
            pool = WirePool({}, TIMEOUT)
            try:
                with pytest.raises(error):
                    await pool.post(server.url + "/internal/push/prefill", b"{}")
            finally:
                pool.close()

    _run(run())


def test_a_refused_connection_is_a_connect_error() -> None:
    """Nothing listens: `httpx.ConnectError`, the error the flows take for an instance
    that never saw the request (and route it again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused

        async def run() -> None:
            pool = WirePool({}, TIMEOUT)
            with pytest.raises(httpx.ConnectError):
                await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}")

        _run(run())


def test_a_whole_answer_later_than_its_deadline_is_a_read_timeout() -> None:
    """A whole answer's call has a deadline (its read timeout): past it, `httpx.ReadTimeout`
    and the connection closed. A stream has none: its instance marked unhealthy ends it."""
    closed = asyncio.Event()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()
        closed.set()
        writer.close()

    async def run() -> None:
        listening = await asyncio.start_server(never, "127.0.0.1", 0)
        async with listening:
            url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
            pool = WirePool({}, httpx.Timeout(0.05, connect=BOUND_S))
            with pytest.raises(httpx.ReadTimeout):
                await pool.post(url + "/internal/push/prefill", b"{}")
            await _bounded(closed.wait())

    _run(run())


@pytest.mark.parametrize("extra", [b"connection: close\r\n", b""], ids=["close", "until_close"])
def test_an_answer_the_instance_ends_by_closing_is_read_and_not_reused(extra: bytes) -> None:
    """An answer that says ``connection: close``, or one with no length that ends when the
    connection does: read whole, and the next call opens a connection of its own."""

    async def run() -> None:
        if extra:
            first: bytes | None = _whole(b'{"n": 1}', extra)
        else:
            first = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"n": 1}'
        server = Server([first, _whole(b'{"n": 2}')], closes_after_answer=True)
        async with _serving(server):
            pool = WirePool({}, TIMEOUT)
            try:
                for n in (1, 2):
                    resp = await pool.post(server.url + "/internal/push/prefill", b"{}")
                    assert resp.json() == {"n": n}
            finally:
                pool.close()
        assert len(server.connections) == 2

    _run(run())


def test_an_idle_connection_past_the_pool_idle_time_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection idle for `ROUTER_POOL_IDLE_S` or more is closed, not reused (the
    instance, which keeps one open longer, would close it as a call is written on it)."""
    monkeypatch.setattr(wire, "ROUTER_POOL_IDLE_S", 0.0)

    async def run() -> None:
        async with _serving(Server([_whole(b"{}"), _whole(b"{}")])) as server:
            pool = WirePool({}, TIMEOUT)
            try:
                for _ in range(2):
                    assert (await pool.post(server.url + "/x", b"{}")).json() == {}
            finally:
                pool.close()
        assert [len(c) for c in server.connections] == [1, 1]

    _run(run())


def test_headers_and_urls_cannot_add_lines_of_their_own() -> None:
    """A header or URL with a line break (a config's secret, say) is refused before
    anything is sent; so is a URL that is not plain http."""
    with pytest.raises(ValueError, match="line break"):
        WirePool({"x-secret": "s\r\nx-admin: 1"}, TIMEOUT)

    async def run() -> None:
        pool = WirePool({}, TIMEOUT)
        with pytest.raises(ValueError, match="line break"):
            await pool.post("http://127.0.0.1:1/v1/completions", b"{}", {"x": "a\nb"})
        with pytest.raises(ValueError, match="plain http"):
            await pool.post("https://127.0.0.1:1/v1/completions", b"{}")

    _run(run())
