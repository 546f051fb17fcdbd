"""The router's client for its calls to the instances (`wire.WirePool`), on real sockets:
answers framed each way HTTP/1.1 frames them, connections kept alive and reused only
when the answer was read to its end, closed when a call is cancelled or an answer is
left mid-body, and every fault an error of the kind the flows tell apart (`client.py`).

Each server listens on 127.0.0.1 on a port the kernel picks, and is stopped by its test."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import resource
import socket
import threading
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import TypeVar

import pytest
import uvloop

from kvduplex.router import client as rc
from kvduplex.router import wire
from kvduplex.router import wire_protocol
from kvduplex.router.wire import WirePool
from tests.unit.test_router_instance_faults import _socket_server as _raw_server

T = TypeVar("T")

BOUND_S = 10.0
"""A bound for a failing run only: what never comes would be waited for here."""


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
    async with _raw_server(server.handle) as url:
        server.url = url
        yield server


Runner = Callable[[Awaitable[None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def runner(request: pytest.FixtureRequest) -> Runner:
    """Runs a test's coroutine on asyncio's own loop and on uvloop's (the router's)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def run(test: Awaitable[None]) -> None:
        with asyncio.Runner(loop_factory=factory) as loop_runner:
            loop_runner.run(_bounded(test))

    return run


def test_answers_framed_each_way_are_read_whole_and_the_connection_reused(runner: Runner) -> None:
    """A whole answer (content-length), a chunked stream and a big body read whole; one
    connection carries all three calls, each request as the instances read it."""
    big = b"x" * (3 * wire_protocol.HIGH_WATER_BYTES)  # past the high-water mark: paused

    async def run() -> None:
        answers: list[bytes | None] = [_whole(b'{"a": 1}'), _chunked(b"data: 1\n\n", b"data: 2\n\n"),
                                       _whole(big)]  # fmt: skip
        async with _serving(Server(answers)) as server:
            pool = WirePool({"x-secret": "s"}, BOUND_S, BOUND_S)
            try:
                resp = await pool.post_whole(server.url + "/internal/push/prefill", b'{"xid": "1"}')
                assert (resp.status_code, resp.json()) == (200, {"a": 1})
                resp = await pool.post_stream(server.url + "/v1/completions", b"{}")
                assert resp.header(b"content-type") == "text/event-stream"
                parts = [part async for part in resp]
                assert b"".join(parts) == b"data: 1\n\ndata: 2\n\n"
                await resp.aclose()
                resp = await pool.post_whole(server.url + "/v1/completions", b"{}")
                assert resp.content == big
            finally:
                pool.close()
        (requests,) = server.connections  # one connection, kept alive
        assert requests[0].startswith(b"POST /internal/push/prefill HTTP/1.1\r\n")
        head, _, body = requests[0].partition(b"\r\n\r\n")
        assert body == b'{"xid": "1"}'
        assert b"\r\nx-secret: s\r\n" in head and b"\r\ncontent-length: 12" in head
        assert f"\r\nhost: {server.url.removeprefix('http://')}\r\n".encode() in head

    runner(run())


def test_a_stream_left_mid_body_closes_its_connection(runner: Runner) -> None:
    """An answer closed before its end (a client that left, an instance marked unhealthy)
    closes its connection, never returned to the pool with a body still coming: the next
    call opens another and gets its own answer."""

    async def run() -> None:
        stream_head = _chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")]  # no end: more to come
        async with _serving(Server([stream_head, _whole(b"{}")])) as server:
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                resp = await pool.post_stream(server.url + "/v1/completions", b"{}")
                assert await resp._body.next_part() == b"data: 1\n\n"
                await resp.aclose()
                assert await _bounded(server.closed.get()) == 0
                resp = await pool.post_whole(server.url + "/internal/push/prefill", b"{}")
                assert resp.json() == {}
            finally:
                pool.close()
        assert [len(c) for c in server.connections] == [1, 1]

    runner(run())


def test_a_cancelled_call_closes_its_connection(runner: Runner) -> None:
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

        async with _raw_server(hold) as base:
            url = base
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                for stream in (False, True):
                    gate.clear()
                    closed.clear()
                    call = asyncio.ensure_future(
                        (pool.post_stream if stream else pool.post_whole)(url + "/v1/completions", b"{}")
                    )
                    await _bounded(gate.wait())
                    call.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await call
                    await _bounded(closed.wait())
            finally:
                pool.close()

    runner(run())


def test_a_whole_answer_cancelled_part_read_closes_its_connection(runner: Runner) -> None:
    """`post_whole` cancelled with its answer part sent (`until_unhealthy`'s cancel, say)
    closes its connection, and the next call opens another rather than read the rest."""

    async def run() -> None:
        sent = asyncio.Event()
        closed = asyncio.Event()
        num_connections = 0

        async def part(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal num_connections
            num_connections += 1
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.split(b"content-length: ")[1].split(b"\r")[0]))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}")
            await writer.drain()
            sent.set()
            await reader.read()  # until the router closes
            closed.set()
            writer.close()

        async with _raw_server(part) as url:
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                call = asyncio.ensure_future(pool.post_whole(url + "/internal/release", b"{}"))
                await _bounded(sent.wait())
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                await _bounded(closed.wait())
                sent.clear()
                call = asyncio.ensure_future(pool.post_whole(url + "/internal/release", b"{}"))
                await _bounded(sent.wait())
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            finally:
                pool.close()
        assert num_connections == 2

    runner(run())


@pytest.mark.parametrize(
    "answer,error",
    [
        (None, rc.RemoteProtocolError),  # closed before any answer
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}", rc.RemoteProtocolError),  # cut
        (b"SSH-2.0-OpenSSH_9.6\r\n", rc.RemoteProtocolError),  # not HTTP
    ],
    ids=["closed", "cut_mid_body", "not_http"],
)
def test_an_answer_that_fails_is_a_remote_protocol_error(
    answer: bytes | None, error: type[Exception], runner: Runner
) -> None:
    """The instance closes the connection before it answers, or mid-body, or answers
    what is not HTTP: the whole call fails with `rc.RemoteProtocolError` (the request
    was sent: not an error the flows route again)."""

    async def run() -> None:
        async with _serving(Server([answer], closes_after_answer=True)) as server:
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                with pytest.raises(error):
                    await pool.post_whole(server.url + "/internal/push/prefill", b"{}")
            finally:
                pool.close()

    runner(run())


def test_a_refused_connection_is_a_connect_error(runner: Runner) -> None:
    """Nothing listens: `rc.ConnectError`, the error the flows take for an instance
    that never saw the request (and route it again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused

        async def run() -> None:
            pool = WirePool({}, BOUND_S, BOUND_S)
            with pytest.raises(rc.ConnectError):
                await pool.post_whole(f"http://127.0.0.1:{port}/v1/completions", b"{}")

        runner(run())


def test_a_whole_answer_later_than_its_deadline_is_a_read_timeout(runner: Runner) -> None:
    """A whole answer's call has a deadline (its read timeout): past it, `rc.ReadTimeout`
    and the connection closed. A stream has none: its instance marked unhealthy ends it."""
    closed = asyncio.Event()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()
        closed.set()
        writer.close()

    async def run() -> None:
        async with _raw_server(never) as base:
            url = base
            pool = WirePool({}, BOUND_S, 0.05)
            with pytest.raises(rc.ReadTimeout):
                await pool.post_whole(url + "/internal/push/prefill", b"{}")
            await _bounded(closed.wait())

    runner(run())


@pytest.mark.parametrize("extra", [b"connection: close\r\n", b""], ids=["close", "until_close"])
def test_an_answer_the_instance_ends_by_closing_is_read_and_not_reused(
    extra: bytes, runner: Runner
) -> None:
    """An answer that says ``connection: close``, or one with no length that ends when the
    connection does: read whole, and the next call opens a connection of its own."""

    async def run() -> None:
        if extra:
            first: bytes | None = _whole(b'{"n": 1}', extra)
        else:
            first = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"n": 1}'
        server = Server([first, _whole(b'{"n": 2}')], closes_after_answer=True)
        async with _serving(server):
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                for n in (1, 2):
                    resp = await pool.post_whole(server.url + "/internal/push/prefill", b"{}")
                    assert resp.json() == {"n": n}
            finally:
                pool.close()
        assert len(server.connections) == 2

    runner(run())


def test_an_idle_connection_past_the_pool_idle_time_is_not_reused(
    monkeypatch: pytest.MonkeyPatch, runner: Runner
) -> None:
    """A connection idle for `ROUTER_POOL_IDLE_S` or more is closed, not reused (the
    instance, which keeps one open longer, would close it as a call is written on it)."""
    monkeypatch.setattr(wire, "ROUTER_POOL_IDLE_S", 0.0)

    async def run() -> None:
        async with _serving(Server([_whole(b"{}"), _whole(b"{}")])) as server:
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                for _ in range(2):
                    assert (await pool.post_whole(server.url + "/x", b"{}")).json() == {}
            finally:
                pool.close()
        assert [len(c) for c in server.connections] == [1, 1]

    runner(run())


def test_headers_and_urls_cannot_add_lines_of_their_own(runner: Runner) -> None:
    """A common header with a line break (a config's secret, say) is refused when the pool
    is made; a call's own header or URL that cannot be sent as it is (a line break, not
    ASCII, neither http nor https) is `client.LocalProtocolError`, and nothing is sent."""
    with pytest.raises(ValueError, match="line break"):
        WirePool({"x-secret": "s\r\nx-admin: 1"}, BOUND_S, BOUND_S)

    async def run() -> None:
        async with _serving(Server([])) as server:
            pool = WirePool({}, BOUND_S, BOUND_S)
            bad = [
                (server.url + "/v1/completions", {"x": "a\nb"}),
                (server.url + "/v1/completions\r\nx-admin: 1", None),
                (server.url + "/v1/compl\u00e9tions", None),
                ("ftp" + server.url.removeprefix("http") + "/v1/completions", None),
            ]
            for url, headers in bad:
                with pytest.raises(rc.LocalProtocolError):
                    await pool.post_whole(url, b"{}", headers)
            pool.close()
        assert server.connections == []

    runner(run())


def test_a_calls_own_headers_take_the_place_of_the_common_ones(runner: Runner) -> None:
    """A header given with a call is sent in place of the common one of its name (any
    case), never beside it."""

    async def run() -> None:
        async with _serving(Server([_whole(b"{}")])) as server:
            pool = WirePool({"Content-Type": "application/json", "x-a": "1"}, BOUND_S, BOUND_S)
            try:
                await pool.post_whole(server.url + "/x", b"{}", {"content-type": "text/plain"})
            finally:
                pool.close()
        ((request,),) = server.connections
        head = request.partition(b"\r\n\r\n")[0].lower()
        assert head.count(b"content-type:") == 1 and b"content-type: text/plain" in head
        assert b"x-a: 1" in head

    runner(run())


@pytest.mark.parametrize(
    "num_bytes", [16, 2 * wire_protocol.HIGH_WATER_BYTES], ids=["small", "paused"]
)
def test_an_answer_closed_with_parts_unread_is_never_read_by_the_next_call(
    num_bytes: int, runner: Runner
) -> None:
    """D's whole stream came (its end included) but the relay closed it before reading it
    all (a client that left, a first token that diverged): what is buffered must not
    reach the next call. The connection is closed (also when so much was left that its
    reading was paused), and the next call gets only its own answer."""

    async def run() -> None:
        rest = b"r" * num_bytes
        answers: list[bytes | None] = [_chunked(b"data: A-1\n\n", rest), _whole(b'{"b": 2}')]
        async with _serving(Server(answers)) as server:
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                resp = await pool.post_stream(server.url + "/v1/completions", b"{}")
                stream = resp._body
                assert isinstance(stream, wire.WireBody)
                conn = stream._conn
                assert conn is not None
                while not (conn.is_done or conn.is_paused):  # all of it read, or all it takes
                    await asyncio.sleep(0)
                await resp.aclose()
                resp = await pool.post_whole(server.url + "/internal/push/prefill", b"{}")
                assert resp.content == b'{"b": 2}'
            finally:
                pool.close()
        assert [len(c) for c in server.connections] == [1, 1]

    runner(run())


def test_bytes_after_an_answer_leave_it_whole_and_the_connection_unused(runner: Runner) -> None:
    """The instance sends more after a whole answer (the start of another, junk): the
    answer is read as it was, and its connection is closed, not reused mid-message."""

    async def run() -> None:
        after = _whole(b'{"a": 1}') + b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nINJECTED!"
        async with _serving(Server([after, _whole(b'{"b": 2}')])) as server:
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                resp = await pool.post_whole(server.url + "/x", b"{}")
                assert (resp.content, resp.header(b"content-length")) == (b'{"a": 1}', "8")
                assert (await pool.post_whole(server.url + "/x", b"{}")).json() == {"b": 2}
            finally:
                pool.close()
        assert [len(c) for c in server.connections] == [1, 1]

    runner(run())


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + _whole(b'{"a": 1}'),
     b"HTTP/1.1 100 Continue\r\n\r\n" + _whole(b'{"a": 1}'),
     b"HTTP/1.1 204 No Content\r\n\r\n"],
    ids=["103", "100", "204"],
)  # fmt: skip
def test_interim_and_empty_answers_are_read_as_http_says(answer: bytes, runner: Runner) -> None:
    """An interim answer (1xx) is not the answer: the one after it is, with its own
    headers only; a 204 has no body by definition. Either way the connection is reused."""

    async def run() -> None:
        async with _serving(Server([answer, _whole(b'{"b": 2}')])) as server:
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                resp = await pool.post_stream(server.url + "/x", b"{}")
                body = b"".join([part async for part in resp])
                await resp.aclose()
                if b" 204 " in answer:
                    assert (resp.status_code, body) == (204, b"")
                else:
                    assert (resp.status_code, body) == (200, b'{"a": 1}')
                    assert resp.header(b"link") is None
                assert (await pool.post_whole(server.url + "/x", b"{}")).json() == {"b": 2}
            finally:
                pool.close()
        assert [len(c) for c in server.connections] == [2]

    runner(run())


def test_an_idle_connection_the_instance_closed_is_not_used_for_a_call(runner: Runner) -> None:
    """The instance closes an idle connection (a shutdown, a restart) and the router's
    loop has not read that yet: the next call goes on a new connection and is answered,
    never written on the closed one (where it would fail as if the instance had seen it).
    The instance is a thread here, so that the loop stays blocked while it closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    closed = threading.Event()
    seen: list[bytes] = []

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while not data.endswith(b"{}"):
                    data += conn.recv(65536)
                seen.append(data.split(b"\r\n")[0])
                conn.sendall(_whole(b'{"n": %d}' % len(seen)))
                if len(seen) == 1:
                    conn.shutdown(socket.SHUT_WR)  # the FIN is out before the event is set
            closed.set()

    async def run() -> None:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/x"
        pool = WirePool({}, BOUND_S, BOUND_S)
        try:
            assert (await pool.post_whole(url, b"{}")).json() == {"n": 1}
            assert closed.wait(BOUND_S)  # blocks the loop: it reads nothing meanwhile
            assert (await pool.post_whole(url, b"{}")).json() == {"n": 2}
        finally:
            pool.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        runner(run())
    finally:
        listener.close()
        thread.join(BOUND_S)
    assert seen == [b"POST /x HTTP/1.1"] * 2


def test_an_idle_connections_end_is_seen_whatever_its_file_number() -> None:
    """The check for input on an idle connection works for any file number, past
    select's 1,024 too (a router with a thousand streams has that many sockets)."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("the open-files limit is under 1,200 here")
    ours, theirs = socket.socketpair()
    high = fcntl.fcntl(ours.fileno(), fcntl.F_DUPFD, 1100)
    try:
        assert not wire._has_input(high)
        theirs.close()  # the end is there to read
        assert wire._has_input(high)
    finally:
        os.close(high)
        ours.close()


async def _a_read_waiting(
    pool: WirePool, url: str
) -> tuple[rc.StreamedAnswer, wire_protocol.Connection, asyncio.Future[bytes | None]]:
    """D's stream opened, its first part (``data: 1``) read, and a read of the next one in
    flight, waiting for D."""
    resp = await pool.post_stream(url, b"{}")
    stream = resp._body
    assert isinstance(stream, wire.WireBody)
    assert await stream.next_part() == b"data: 1\n\n"
    conn = stream._conn
    assert conn is not None
    read = asyncio.ensure_future(stream.next_part())
    while conn.waiter is None:  # the read waits for D's next part
        await asyncio.sleep(0)
    return resp, conn, read


@pytest.mark.parametrize("framing", ["chunked", "until_close"])
def test_a_read_in_flight_on_a_stream_closed_from_another_task_fails(
    framing: str, runner: Runner
) -> None:
    """The relay closes D's stream from a task of its own when D is marked unhealthy
    (`relay.relay`): the read in flight ends with `rc.ReadError`, never as if the
    answer had ended, whether D's body is chunked or ends with its connection."""

    async def run() -> None:
        if framing == "chunked":
            first = _chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")]
        else:
            first = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n"
        gate = asyncio.Event()

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(first)
            await gate.wait()
            writer.close()

        async with _raw_server(hold) as base:
            url = base + "/v1/completions"
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                resp, _, read = await _a_read_waiting(pool, url)
                await asyncio.ensure_future(resp.aclose())  # as `relay`'s abandon does
                with pytest.raises(rc.ReadError):
                    await read
            finally:
                gate.set()
                pool.close()

    runner(run())


def test_a_stream_closed_while_its_last_read_wakes_is_not_pooled(
    monkeypatch: pytest.MonkeyPatch, runner: Runner
) -> None:
    """D's stream is closed from another task (`relay`'s abandon) in the loop turn in which
    its end arrives, after the end woke the read in flight and before that read ran: the
    connection is closed, not pooled under the read (which would wait on it for good, or
    read the next call's answer); the read sees the end, and the next call its answer."""
    hooks: list[Callable[[], None]] = []
    data_received = wire_protocol.Connection.data_received

    def first_the_hooks(self: wire_protocol.Connection, data: bytes) -> None:
        while hooks:
            hooks.pop()()
        data_received(self, data)

    # On the class: uvloop binds a protocol's data_received when the connection is made.
    monkeypatch.setattr(wire_protocol.Connection, "data_received", first_the_hooks)

    async def run() -> None:
        end = asyncio.Event()
        stream_head = _chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")]

        num_connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal num_connections
            num_connections += 1
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await reader.readuntil(b"\r\n\r\n")
                if num_connections == 1:  # D's stream, its end once `end` is set
                    writer.write(stream_head)
                    await end.wait()
                    writer.write(b"0\r\n\r\n")
                    await reader.readuntil(b"\r\n\r\n")  # a next call, if it came here
                writer.write(_whole(b'{"b": 2}'))
                await writer.drain()

        async with _raw_server(serve) as base:
            url = base + "/x"
            pool = WirePool({}, BOUND_S, BOUND_S)
            try:
                resp, conn, read = await _a_read_waiting(pool, url)
                closing: list[asyncio.Future[None]] = []
                hooks.append(lambda: closing.append(asyncio.ensure_future(resp.aclose())))
                end.set()  # the end arrives; the close was scheduled just before it
                assert await read is None  # the answer did end
                await closing[0]
                assert conn.is_closed, "pooled under a read in flight"
                assert (await pool.post_whole(url, b"{}")).json() == {"b": 2}
                assert num_connections == 2
            finally:
                pool.close()

    runner(run())


def test_a_host_name_that_cannot_be_resolved_as_written_is_a_connect_error(
    runner: Runner,
) -> None:
    """A host name IDNA refuses (an empty label) fails as a connection does, not with an
    error the flows do not handle."""

    async def run() -> None:
        pool = WirePool({}, BOUND_S, BOUND_S)
        with pytest.raises(rc.ConnectError):
            await pool.post_whole("http://a..b:8000/v1/completions", b"{}")

    runner(run())


def test_a_stream_dropped_unclosed_closes_its_connection(runner: Runner) -> None:
    """A stream its caller dropped without closing it (a cancel between the call and the
    relay) closes its connection once collected: the instance sees the router leave."""

    async def run() -> None:
        closed = asyncio.Event()

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(_chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")])
            await reader.read()  # until the router closes
            closed.set()

        async with _raw_server(hold) as base:
            url = base + "/x"
            pool = WirePool({}, BOUND_S, BOUND_S)
            resp = await pool.post_stream(url, b"{}")
            del resp  # dropped: collected at once (no cycle holds it)
            await _bounded(closed.wait())
            pool.close()

    runner(run())
