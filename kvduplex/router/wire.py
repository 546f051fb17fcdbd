"""The router's HTTP/1.1 client to the instances (`client.InstanceClient` over the network).

`WirePool` keeps connections alive by host and port and makes the router's calls on
them: a POST of a JSON body (P's prefill, D's answer, cancels, releases) or a GET (the
health probes, ``/v1/models``), over plain HTTP or TLS (``https`` URLs). Each connection
is an asyncio protocol around httptools's response parser (`wire_protocol.Connection`):
a part of a body is handed to its reader as it comes, with no stream reader between.

Errors are `client.CallError`s, and a call raises no other: a connection that could
not be made is `ConnectError` (or `ConnectTimeout`), one that closed or failed before
the request was written on it `ClosedBeforeWrite` (a `ConnectError`): either way the
instance never saw the request; one closed or answered with what is not HTTP once the
request was written is `RemoteProtocolError`; a whole answer
later than its deadline is `ReadTimeout`. A call cancelled (the caller's own, or
`calls.until_unhealthy`'s) closes its connection; a streamed answer closed before its
end (`StreamedAnswer.aclose`) closes it and ends a read in flight with `ReadError`. A
connection goes back to the pool only once its answer was read to the end and the
instance keeps it open, and is reused for at most `ROUTER_POOL_IDLE_S`, well within the
instances' keep-alive, so that an instance never closes one as the router writes a call
on it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import select
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from kvduplex.common.config import ROUTER_POOL_IDLE_S
from kvduplex.router.client import ConnectError
from kvduplex.router.client import ConnectTimeout
from kvduplex.router.client import LocalProtocolError
from kvduplex.router.client import ReadError
from kvduplex.router.client import ReadTimeout
from kvduplex.router.client import StreamedAnswer
from kvduplex.router.client import WholeAnswer
from kvduplex.router.wire_protocol import Connection

Key = tuple[str, int, bool]
"""Where a connection goes: host, port, and whether it speaks TLS."""


class WireBody:
    """An answer's body as it arrives on its connection (`client.Body`); `aclose` gives
    the connection back (an answer read to its end) or closes it."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn

    def __del__(self) -> None:
        """A body dropped unclosed (a caller cancelled before it closed it) closes its
        connection rather than holding it open for good."""
        if self._conn is not None and not self._conn.is_closed:
            with contextlib.suppress(RuntimeError):  # the event loop is closed already
                self._conn.close(ReadError("the answer was dropped unclosed"))

    async def next_part(self) -> bytes | None:
        if self._conn is None:
            raise ReadError("the answer was closed")
        return await self._conn.next_part()

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release()


class WirePool:
    """Kept-alive connections to the instances, by host and port, and the calls on them
    (`client.InstanceClient`). No cap: every request in flight holds one to its P and
    one to its D."""

    def __init__(
        self, headers: dict[str, str], connect_timeout_s: float, read_timeout_s: float
    ) -> None:
        """`headers`: the credentials sent on every POST and on a GET that asks for them
        (checked once: `ValueError` if one holds a line break); the connect deadline, and
        the read deadline of a POST's whole answer."""
        self._base_headers = {"content-type": "application/json"}
        self._base_headers.update({name.lower(): value for name, value in headers.items()})
        self._headers = _header_lines(self._base_headers)
        self._credentials = _header_lines({n.lower(): v for n, v in headers.items()})
        self._is_closed = False
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._tls: ssl.SSLContext | None = None
        self._idle: dict[Key, collections.deque[Connection]] = {}
        """Idle connections by where they go, the least recently used first."""
        self._swept_at = time.monotonic()
        self._targets: dict[tuple[bytes, str], tuple[Key, bytes]] = {}
        self._lines: dict[tuple[tuple[str, str], ...], bytes] = {}
        """The header lines of each set of a call's own headers (a chat's: one), made once."""

    async def post_stream(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> StreamedAnswer:
        """See `client.InstanceClient.post_stream`. A URL or header that cannot be sent as
        it is (a line break, not ASCII) is `LocalProtocolError`, and nothing is sent."""
        conn, head = await self._send(b"POST", url, self._post_lines(headers), content)
        try:
            await head
        except BaseException:
            conn.close(ReadError("the call was cancelled"))
            raise
        return StreamedAnswer(conn.parser.get_status_code(), conn.headers, WireBody(conn))

    async def post_whole(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> WholeAnswer:
        """See `client.InstanceClient.post_whole`."""
        return await self._whole(
            b"POST", url, self._post_lines(headers), content, self._read_timeout_s
        )

    async def get(self, url: str, timeout_s: float, *, credentials: bool = False) -> WholeAnswer:
        """See `client.InstanceClient.get`."""
        lines = self._credentials if credentials else b""
        async with _deadline(url, timeout_s):
            return await self._whole(b"GET", url, lines, None, None)

    async def _whole(
        self, method: bytes, url: str, lines: bytes, content: bytes | None,
        timeout_s: float | None,
    ) -> WholeAnswer:  # fmt: skip
        conn, head = await self._send(method, url, lines, content)
        try:
            async with _deadline(url, timeout_s):
                await head
                body = await _read_to_end(conn)
        except BaseException as exc:
            why = "no answer in time" if isinstance(exc, ReadTimeout) else "the call was cancelled"
            conn.close(ReadError(why))
            raise
        whole = WholeAnswer(conn.parser.get_status_code(), body, conn.headers)
        conn.release()
        return whole

    def _post_lines(self, headers: dict[str, str] | None) -> bytes:
        """A POST's header lines: the common ones, `headers` in place of those of their
        names."""
        if not headers:
            return self._headers
        key = tuple(headers.items())
        lines = self._lines.get(key)
        if lines is None:
            if len(self._lines) >= 64:  # the router's calls use one or two sets
                self._lines.clear()
            extra = {name.lower(): value for name, value in headers.items()}
            try:
                lines = _header_lines({**self._base_headers, **extra})
            except ValueError as exc:
                raise LocalProtocolError(str(exc)) from None
            self._lines[key] = lines
        return lines

    async def _send(
        self, method: bytes, url: str, lines: bytes, content: bytes | None
    ) -> tuple[Connection, asyncio.Future[None]]:
        """A connection to `url`'s instance (an idle one, or a new one) with the call
        written on it, and the head of its answer to come."""
        try:
            key, start = self._target(method, url)
        except ValueError as exc:
            raise LocalProtocolError(str(exc)) from None
        conn = self._take(key) or await self._connect(key)
        if content is None:
            request = b"%s%s\r\n" % (start, lines)
        else:
            request = b"%s%scontent-length: %d\r\n\r\n%s" % (start, lines, len(content), content)
        return conn, conn.send(request)

    def put_back(self, conn: Connection) -> None:
        if self._is_closed:  # a stream that ended after the pool closed
            conn.close(ReadError("the router's client closed"))
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
                self._unpool(idle.popleft()).close(ReadError("idle too long"))
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
                conn.close(ReadError("the router's client closed"))
        self._idle.clear()

    def _take(self, key: Key) -> Connection | None:
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
            conn.close(ReadError("idle too long, or closed by the instance"))
        return None

    async def _connect(self, key: Key) -> Connection:
        loop = asyncio.get_running_loop()
        conn = Connection(self, key)
        host, port, is_tls = key
        if is_tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await loop.create_connection(
                    lambda: conn, host, port, ssl=self._tls if is_tls else None
                )
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except Exception as exc:  # OSError; UnicodeError: a host name IDNA refuses; any
            # other the loop raises (uvloop's RuntimeError): no connection, nothing sent
            raise ConnectError(f"connecting to {host}:{port} failed: {exc!r}") from exc
        return conn

    def _target(self, method: bytes, url: str) -> tuple[Key, bytes]:
        """Where `url` goes, and its request line and Host header (parsed once)."""
        target = self._targets.get((method, url))
        if target is None:
            if len(self._targets) >= 4096:  # instances come and go: keep the table bounded
                self._targets.clear()
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or parts.hostname is None:
                raise ValueError(f"not an http or https URL: {url}")
            is_tls = parts.scheme == "https"
            port = parts.port if parts.port is not None else 443 if is_tls else 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            _check_field(path, host)
            if " " in path:
                raise ValueError(f"a space in the URL's path: {url}")
            line = f"{method.decode()} {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            if not line.isascii():
                raise ValueError(f"not an ASCII URL: {url!r}")
            target = ((parts.hostname, port, is_tls), line.encode("ascii"))
            self._targets[(method, url)] = target
        return target


@contextlib.asynccontextmanager
async def _deadline(url: str, timeout_s: float | None) -> AsyncIterator[None]:
    """`ReadTimeout` (a `ConnectTimeout` stays one) once `timeout_s` has passed."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise ReadTimeout(f"{url} did not answer in {timeout_s} s") from None


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
