"""The router's HTTP/1.1 client for its calls to the instances on a request's path.

Each routed request makes two calls before its first token (P's prefill, D's
stream) and reads one part per token of D's stream; under load the router's
core waits for nothing else. aiohttp spent ~100 us of that core a call (a
request and a response object, a timer, the body written from a task of its
own before Python 3.12) and five Python calls a part (its stream reader's
feed, chunk marks and flow control); an asyncio protocol around httptools's
parser (uvicorn's, llhttp's C) spends about a third of that. This is that
protocol and a keep-alive pool, for what the router sends: a POST of a JSON
body to an instance over plain HTTP (a ``https`` URL goes through aiohttp,
`state.InstanceTransport`), its answer returned as an `httpx.Response` whose
body is read as it arrives (`WireStream`).

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
import select
import time
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools
import httpx

from kvduplex.config import ROUTER_POOL_IDLE_S

HIGH_WATER_BYTES = 1 << 20
"""An answer's bytes read and not yet taken past which its connection stops reading."""


class _Connection(asyncio.Protocol):
    """One connection to an instance and the answer being read on it (one at a time).

    httptools calls back into it as it parses (`on_header`, ...); the caller waits on
    `head`, then takes the body's parts (`next_part`). Reused (`release`) only once its
    answer was read to the end, nothing of it left unread and nothing after it."""

    def __init__(self, pool: WirePool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.is_closed = False
        """The transport is closed or closing: never used again."""
        self.is_spoiled = False
        """Something came after the answer: the connection is not reused."""
        self.idle_since = 0.0
        self.is_pooled = False
        self.is_paused = False
        self._reset()

    def _reset(self) -> None:
        """No answer in progress: what each answer's reading keeps, afresh."""
        self.head: asyncio.Future[None] | None = None
        self.has_head = False
        self.headers: list[tuple[bytes, bytes]] = []
        self.parts: collections.deque[bytes] = collections.deque()
        self.num_buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.is_interim = False
        self.is_done = False
        self.error: httpx.HTTPError | None = None
        self.keeps_alive = False
        self.until_close = False
        """The body has no length and is not chunked: the connection's close ends it."""

    # asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # an idle connection: nothing should come
            self._fail(httpx.RemoteProtocolError("the instance sent data no call asked for"))
            return
        if self.is_done:  # after the answer: the answer stands, the connection goes
            self._spoil()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.is_done:  # `on_message_begin`: another message after the answer
                self._spoil()
            else:
                self._fail(httpx.RemoteProtocolError(f"the instance's answer is not HTTP: {exc}"))

    def eof_received(self) -> bool:
        self._note_closing()
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self._note_closing()
        if self.head is not None and not self.is_done:
            if self.error is None and self.has_head and self.until_close and exc is None:
                self.is_done = True  # the instance's close is the body's end (not ours)
            elif self.error is None:
                why = f": {exc!r}" if exc is not None else ""
                self.error = httpx.RemoteProtocolError(f"the instance closed the connection{why}")
        self._wake()

    # httptools's callbacks

    def on_message_begin(self) -> None:
        if self.is_done:
            raise _AfterTheAnswer  # stops the parser: see `data_received`

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.has_head:  # not a chunked body's trailers
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.head is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (103 Early Hints, say): the next is it
            self.headers, self.is_interim = [], True
            return
        self.has_head = True
        self.until_close = status not in (204, 304) and not any(
            n.lower() == b"content-length"
            or (n.lower() == b"transfer-encoding" and v.lower().endswith(b"chunked"))
            for n, v in self.headers
        )  # fmt: skip
        self.keeps_alive = self.parser.should_keep_alive()
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)
        self.num_buffered += len(body)
        if self.num_buffered > HIGH_WATER_BYTES and not self.is_paused and self.transport:
            self.is_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.is_interim:
            self.is_interim = False
            return
        self.is_done = True
        self._wake()

    # the caller's side

    def send(self, request: bytes) -> None:
        """Write one request; its answer's head is then `head`."""
        assert self.transport is not None and self.head is None
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(request)

    async def next_part(self) -> bytes | None:
        """What came of the body since the last part, once there is some (all of it
        joined, as aiohttp's `readany`: a burst of events is relayed in one write); None
        at its end."""
        while True:
            if self.parts:
                parts = self.parts
                part = parts.popleft() if len(parts) == 1 else b"".join(parts)
                parts.clear()
                self.num_buffered = 0
                if self.is_paused and self.transport:
                    self.is_paused = False
                    self.transport.resume_reading()
                return part
            if self.is_done:
                return None
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def is_reusable(self) -> bool:
        """The answer was read to its end, nothing left of it or after it, and the
        instance keeps the connection open."""
        return (
            self.is_done and not self.parts and not self.is_paused and not self.is_spoiled
            and not self.is_closed and not self.until_close and self.keeps_alive
        )  # fmt: skip

    def release(self) -> None:
        """The caller is done with the answer: the connection goes back to the pool if it
        `is_reusable`, else closes (a read in flight then ends with `httpx.ReadError`)."""
        if self.is_reusable() and self.waiter is None:  # no read in flight, nor its wake-up
            self._reset()
            self.pool.put_back(self)
        else:
            self.close(httpx.ReadError("the answer was closed before its end"))

    def close(self, error: httpx.HTTPError) -> None:
        """Close the connection; a read in flight ends with `error`."""
        if self.error is None and not self.is_done:
            self.error = error
        if self.transport is not None:
            self.transport.close()
        self._note_closing()
        self._wake()

    def _note_closing(self) -> None:
        self.is_closed = True
        self.pool.forget(self)

    def _spoil(self) -> None:
        """Bytes came after the answer: it stands as read, the connection is closed."""
        self.is_spoiled = True
        if self.transport is not None:
            self.transport.close()
        self._note_closing()

    def _fail(self, error: httpx.HTTPError) -> None:
        self.error = self.error or error
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved: a caller that left does not log it
        self.close(error)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        if self.head is not None and not self.head.done() and self.error is not None:
            self.head.set_exception(self.error)
            self.head.exception()


class _AfterTheAnswer(Exception):
    """A message began on a connection after its answer ended (not asked for)."""


class WireStream(httpx.AsyncByteStream):
    """An answer's body as it arrives on its connection (`httpx.Response.stream`);
    `aclose` gives the connection back (an answer read to its end) or closes it."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn

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
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        """Idle connections by host and port, the least recently used first."""
        self._swept_at = time.monotonic()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    async def post(
        self, url: str, content: bytes, headers: dict[str, str] | None = None,
        *, stream: bool = False,
    ) -> httpx.Response:  # fmt: skip
        """POST `content` (JSON) to `url` (``http://``): the answer read whole within the
        read deadline, or (`stream`) once its head came, with no deadline (a stream's read
        ends when its instance is marked unhealthy, `calls.py`), its body to be read
        (`WireStream`) and closed by the caller. `headers` are sent in place of the common
        ones of the same names. A URL or header that cannot be sent as it is (a line
        break, not ASCII) is `httpx.LocalProtocolError`, and nothing is sent."""
        try:
            key, head = self._target(url)
            lines = self._headers
            if headers:
                extra = {name.lower(): value for name, value in headers.items()}
                lines = _header_lines({**self._base_headers, **extra})
        except ValueError as exc:
            raise httpx.LocalProtocolError(str(exc)) from None
        conn = self._take(key) or await self._connect(key)
        conn.send(b"%s%scontent-length: %d\r\n\r\n%s" % (head, lines, len(content), content))
        assert conn.head is not None
        try:
            if stream:
                await conn.head
            else:
                async with asyncio.timeout(self._read_timeout_s):
                    await conn.head
                    body = b"".join([part async for part in _parts(conn)])
        except TimeoutError:
            conn.close(httpx.ReadTimeout("no answer in time"))
            raise httpx.ReadTimeout(f"{url} did not answer in {self._read_timeout_s} s") from None
        except BaseException:
            conn.close(httpx.ReadError("the call was cancelled"))
            raise
        status = conn.parser.get_status_code()
        extensions = {"http_version": b"HTTP/1.1"}
        if stream:
            return httpx.Response(
                status, headers=conn.headers, stream=WireStream(conn), extensions=extensions
            )
        response = httpx.Response(status, headers=conn.headers, content=body, extensions=extensions)
        conn.release()
        return response

    def put_back(self, conn: _Connection) -> None:
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

    def forget(self, conn: _Connection) -> None:
        """`conn` closed: out of the pool if it was idle there."""
        if conn.is_pooled:
            self._unpool(conn)
            self._idle[conn.key].remove(conn)

    @staticmethod
    def _unpool(conn: _Connection) -> _Connection:
        conn.is_pooled = False
        return conn

    def close(self) -> None:
        """Close every idle connection (those in use close as their callers end)."""
        self._is_closed = True
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close(httpx.ReadError("the router's client closed"))
        self._idle.clear()

    def _take(self, key: tuple[str, int]) -> _Connection | None:
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

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self, key)
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


async def _parts(conn: _Connection) -> AsyncIterator[bytes]:
    while (part := await conn.next_part()) is not None:
        yield part


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
