"""The router's HTTP/1.1 client for its calls to the instances on a request's path.

Each routed request makes two calls before its first token (P's prefill, D's
stream) and reads one part per token of D's stream; under load the router's
core waits for nothing else. Through aiohttp alone a call cost 110-240 us of
that core (a request and a response object, a timer, the body written from a
task of its own before Python 3.12; the router wrapped httpx's response around
it) and a part five Python calls or more (its stream reader's feed, chunk
marks, flow control); over an asyncio protocol around httptools's parser
(uvicorn's, llhttp's C: `wire_protocol.Connection`) a call, httpx's response
included, costs about two thirds of that and a part two calls
(`benchmarks/bench_http_clients.py`). This is that protocol's keep-alive pool,
for what the router sends: a POST of a JSON body to an instance over plain HTTP
(a ``https`` URL goes through aiohttp, `state.InstanceTransport`), its answer
returned as an `httpx.Response` whose body is read as it arrives (`WireStream`), or,
read whole, as a `WholeAnswer`.

Errors are httpx's, as the router tells them apart (`state.InstanceTransport`):
a connection that could not be made is `httpx.ConnectError` (or
`httpx.ConnectTimeout`): the instance never saw the request; one closed or
answered with what is not HTTP once the request was written is
`httpx.RemoteProtocolError`; a whole answer later than its deadline is
`httpx.ReadTimeout`. A call cancelled (the caller's own, or
`calls.until_unhealthy`'s) closes its connection; a stream closed before its
end (`WireStream.aclose`) closes it and ends a read in flight with
`httpx.ReadError`. A connection goes back to the pool only once its answer
was read to the end and the instance keeps it open, and is reused for at
most `ROUTER_POOL_IDLE_S`, well within the instances' keep-alive, so that an
instance never closes one as the router writes a call on it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import select
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvduplex.common.config import ROUTER_POOL_IDLE_S
from kvduplex.router.wire_protocol import Connection


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """An instance's whole answer to a call, as the router reads one: its status and body.
    No `httpx.Response` is made of it: reading P's answer into one, whose content goes
    through httpx's byte streams, decoders and context managers, cost four times the
    `json.loads` of that answer, on every request's path to its first token (more with
    the caches cold, as they are between a request's steps under load). The body is as it
    came: no content coding is undone (the router asks for none, and instances send
    none), and `text` reads it as UTF-8, as JSON is."""

    status_code: int
    content: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    """As they came (the connection starts a new list for its next answer)."""

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class WireStream(httpx.AsyncByteStream):
    """An answer's body as it arrives on its connection (`httpx.Response.stream`);
    `aclose` gives the connection back (an answer read to its end) or closes it."""

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn

    def __del__(self) -> None:
        """A stream dropped unclosed (a caller cancelled before it closed it) closes its
        connection, as aiohttp's response does, rather than holding it open for good."""
        if self._conn is not None and not self._conn.is_closed:
            with contextlib.suppress(RuntimeError):  # the event loop is closed already
                self._conn.close(httpx.ReadError("the answer was dropped unclosed"))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (part := await self.next_part()) is not None:
            yield part

    async def next_part(self) -> bytes | None:
        """The next part, None at the end (or `httpx.ReadError` once closed)."""
        if self._conn is None:
            raise httpx.ReadError("the answer was closed")
        return await self._conn.next_part()

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release()


class WirePool:
    """Kept-alive connections to the instances, by host and port, and the calls on them.
    No cap: every request in flight holds one to its P and one to its D."""

    def __init__(self, headers: dict[str, str], timeout: httpx.Timeout) -> None:
        """`headers`: sent on every call (checked once: `ValueError` if one holds a line
        break); `timeout`: its connect and read deadlines (read: a whole answer's)."""
        self._base_headers = {name.lower(): value for name, value in headers.items()}
        self._headers = _header_lines(self._base_headers)
        self._is_closed = False
        self._connect_timeout_s = timeout.connect
        self._read_timeout_s = timeout.read
        self._idle: dict[tuple[str, int], collections.deque[Connection]] = {}
        """Idle connections by host and port, the least recently used first."""
        self._swept_at = time.monotonic()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}
        self._lines: dict[tuple[tuple[str, str], ...], bytes] = {}
        """The header lines of each set of a call's own headers (a chat's: one), made once."""

    async def post(
        self, url: str, content: bytes, headers: dict[str, str] | None = None,
        *, stream: bool = False,
    ) -> httpx.Response:  # fmt: skip
        """POST `content` (JSON) to `url` (``http://``): the answer read whole within the
        read deadline (`post_whole`'s, as an `httpx.Response`), or (`stream`) once its head
        came, with no deadline (a stream's read ends when its instance is marked unhealthy,
        `calls.py`), its body to be read (`WireStream`) and closed by the caller. `headers`
        are sent in place of the common ones of the same names. A URL or header that
        cannot be sent as it is (a line break, not ASCII) is `httpx.LocalProtocolError`,
        and nothing is sent."""
        if not stream:
            whole = await self.post_whole(url, content, headers)
            return httpx.Response(
                whole.status_code, headers=whole.headers, content=whole.content,
                extensions={"http_version": b"HTTP/1.1"},
            )  # fmt: skip
        conn, head = await self._send(url, content, headers)
        try:
            await head
        except BaseException:
            conn.close(httpx.ReadError("the call was cancelled"))
            raise
        status = conn.parser.get_status_code()
        return httpx.Response(
            status, headers=conn.headers, stream=WireStream(conn),
            extensions={"http_version": b"HTTP/1.1"},
        )  # fmt: skip

    async def post_whole(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> WholeAnswer:
        """`post`'s whole answer as it was read, with no `httpx.Response` made of it."""
        conn, head = await self._send(url, content, headers)
        try:
            async with asyncio.timeout(self._read_timeout_s):
                await head
                body = await _read_to_end(conn)
        except TimeoutError:
            conn.close(httpx.ReadTimeout("no answer in time"))
            raise httpx.ReadTimeout(f"{url} did not answer in {self._read_timeout_s} s") from None
        except BaseException:
            conn.close(httpx.ReadError("the call was cancelled"))
            raise
        whole = WholeAnswer(conn.parser.get_status_code(), body, conn.headers)
        conn.release()
        return whole

    async def _send(
        self, url: str, content: bytes, headers: dict[str, str] | None
    ) -> tuple[Connection, asyncio.Future[None]]:
        """A connection to `url`'s instance (an idle one, or a new one) with the call
        written on it, and the head of its answer to come."""
        try:
            key, start = self._target(url)
            lines = self._lines_with(headers) if headers else self._headers
        except ValueError as exc:
            raise httpx.LocalProtocolError(str(exc)) from None
        conn = self._take(key) or await self._connect(key)
        request = b"%s%scontent-length: %d\r\n\r\n%s" % (start, lines, len(content), content)
        return conn, conn.send(request)

    def _lines_with(self, headers: dict[str, str]) -> bytes:
        """The header lines with `headers` in place of the common ones of their names."""
        key = tuple(headers.items())
        lines = self._lines.get(key)
        if lines is None:
            if len(self._lines) >= 64:  # the router's calls use one or two sets
                self._lines.clear()
            extra = {name.lower(): value for name, value in headers.items()}
            lines = self._lines[key] = _header_lines({**self._base_headers, **extra})
        return lines

    def put_back(self, conn: Connection) -> None:
        if self._is_closed:  # a stream that ended after the pool closed
            conn.close(httpx.ReadError("the router's client closed"))
            return
        conn.idle_since = now = time.monotonic()
        conn.is_pooled = True
        self._idle.setdefault(conn.key, collections.deque()).append(conn)
        if now - self._swept_at >= ROUTER_POOL_IDLE_S:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close the connections idle too long, to instances called no more included."""
        self._swept_at = now
        for key, idle in list(self._idle.items()):
            while idle and now - idle[0].idle_since >= ROUTER_POOL_IDLE_S:
                self._unpool(idle.popleft()).close(httpx.ReadError("idle too long"))
            if not idle:
                del self._idle[key]

    def forget(self, conn: Connection) -> None:
        """`conn` closed: out of the pool if it was idle there."""
        if conn.is_pooled:
            self._unpool(conn)
            self._idle[conn.key].remove(conn)

    @staticmethod
    def _unpool(conn: Connection) -> Connection:
        conn.is_pooled = False
        return conn

    def close(self) -> None:
        """Close every idle connection (those in use close as their callers end)."""
        self._is_closed = True
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close(httpx.ReadError("the router's client closed"))
        self._idle.clear()

    def _take(self, key: tuple[str, int]) -> Connection | None:
        """The most recently used idle connection to `key` that is still good, if any: not
        idle too long, and not closed by the instance, even if the event loop has not read
        that yet (an idle connection with anything to read has only its end to read, as
        urllib3 checks its own: the call would fail as it is written, as if the instance
        had seen it, and be answered 502, not sent to another instance)."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = self._unpool(idle.pop())
            if now - conn.idle_since < ROUTER_POOL_IDLE_S and not conn.is_closed:
                transport = conn.transport
                if transport is not None and not transport.is_closing():
                    sock = transport.get_extra_info("socket")
                    if sock is None or not _has_input(sock.fileno()):
                        return conn
            conn.close(httpx.ReadError("idle too long, or closed by the instance"))
        return None

    async def _connect(self, key: tuple[str, int]) -> Connection:
        loop = asyncio.get_running_loop()
        conn = Connection(self, key)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await loop.create_connection(lambda: conn, *key)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except (OSError, UnicodeError) as exc:  # UnicodeError: a host name IDNA refuses
            raise httpx.ConnectError(f"connecting to {key[0]}:{key[1]} failed: {exc}") from exc
        return conn

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        """`url`'s host and port, and its request line and Host header (parsed once)."""
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= 4096:  # instances come and go: keep the table bounded
                self._targets.clear()
            parts = urlsplit(url)
            if parts.scheme != "http" or parts.hostname is None:
                raise ValueError(f"not a plain http URL: {url}")
            port = 80 if parts.port is None else parts.port
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            _check_field(path, host)
            if " " in path:
                raise ValueError(f"a space in the URL's path: {url}")
            line = f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            if not line.isascii():
                raise ValueError(f"not an ASCII URL: {url!r}")
            target = self._targets[url] = ((parts.hostname, port), line.encode("ascii"))
        return target


async def _read_to_end(conn: Connection) -> bytes:
    """The answer's body, whole (a loop, not an async generator: the event loop keeps a
    weak reference to each generator made)."""
    parts = []
    while (part := await conn.next_part()) is not None:
        parts.append(part)
    return b"".join(parts)


def _has_input(fd: int) -> bool:
    """Whether `fd` has anything to read now (poll, not select: any fd number)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def is_wire_url(url: str) -> bool:
    """Whether `WirePool` calls `url` (plain http)."""
    return url.startswith("http://")


def _header_lines(headers: dict[str, str]) -> bytes:
    for item in headers.items():
        _check_field(*item)
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("latin-1")


def _check_field(*fields: str) -> None:
    """A header's name and value, a URL's host and path: none may hold a line break or a
    NUL (which would add a header, or a request, of its own)."""
    for text in fields:
        if "\r" in text or "\n" in text or "\0" in text:
            raise ValueError(f"a header or URL holds a line break: {text!r}")
