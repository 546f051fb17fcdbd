"""One connection of the router's HTTP/1.1 client (`wire.py`) and the answer read on it.

`Connection` is an asyncio protocol around httptools's response parser (llhttp): the
event loop calls `data_received`, httptools calls back as it parses (`on_header`,
`on_body`, ...), and the caller waits on `head`, then takes the body's parts
(`next_part`). It carries one answer at a time and goes back to its pool (`Pool`) only
when that answer was read to its end, nothing of it left unread and nothing after it
(`is_reusable`). A connection closed before a request is written on it is
`ClosedBeforeWrite` (nothing is sent); one closed after, or an answer that is not
HTTP, is `RemoteProtocolError`; a read in flight on a connection the caller closed is
`ReadError` (`kvduplex.router.client`).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol
from typing import cast

import httptools

from kvduplex.router.client import CallError
from kvduplex.router.client import ClosedBeforeWrite
from kvduplex.router.client import ReadError
from kvduplex.router.client import RemoteProtocolError


class Pool(Protocol):
    """Where a connection goes back to, and is forgotten from when it closes."""

    def put_back(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


HIGH_WATER_BYTES = 1 << 20
"""An answer's bytes read and not yet taken past which its connection stops reading."""


class Connection(asyncio.Protocol):
    """One connection to an instance and the answer being read on it (one at a time).

    httptools calls back into it as it parses (`on_header`, ...); the caller waits on
    `head`, then takes the body's parts (`next_part`). Reused (`release`) only once its
    answer was read to the end, nothing of it left unread and nothing after it."""

    def __init__(self, pool: Pool, key: tuple[str, int, bool]) -> None:
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
        self.error: CallError | None = None
        self.keeps_alive = False
        self.until_close = False
        """The body has no length and is not chunked: the connection's close ends it."""

    # asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # an idle connection: nothing should come
            self._fail(RemoteProtocolError("the instance sent data no call asked for"))
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
                self._fail(RemoteProtocolError(f"the instance's answer is not HTTP: {exc}"))

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
                self.error = RemoteProtocolError(f"the instance closed the connection{why}")
        self._wake()

    # httptools's callbacks

    def on_message_begin(self) -> None:
        if self.is_done:
            raise AfterTheAnswer  # stops the parser: see `data_received`

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

    def send(self, request: bytes) -> asyncio.Future[None]:
        """Write one request; its answer's head is then `head` (returned).

        A connection that closed or failed before the request was written (the instance
        closed it after it was made, or sent what no call asked for) is `ClosedBeforeWrite`
        at once and nothing is written: on a closed transport asyncio's `write` drops the
        request (its answer would never come) and uvloop's raises `RuntimeError`."""
        transport = self.transport
        assert transport is not None and self.head is None
        if self.is_closed or self.error is not None or transport.is_closing():
            why = f": {self.error}" if self.error is not None else ""
            error = ClosedBeforeWrite(f"the connection closed before the call was written{why}")
            self.close(error)
            raise error
        try:
            transport.write(request)
        except (RuntimeError, OSError) as exc:  # a transport that closed all the same
            error = ClosedBeforeWrite(f"the call could not be written: {exc!r}")
            self.close(error)
            raise error from exc
        head = self.head = asyncio.get_running_loop().create_future()
        return head

    async def next_part(self) -> bytes | None:
        """What came of the body since the last part, once there is some (all of it
        joined: a burst of events is relayed in one write); None
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
        `is_reusable`, else closes (a read in flight then ends with `ReadError`)."""
        if self.is_reusable() and self.waiter is None:  # no read in flight, nor its wake-up
            self._reset()
            self.pool.put_back(self)
        else:
            self.close(ReadError("the answer was closed before its end"))

    def close(self, error: CallError) -> None:
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

    def _fail(self, error: CallError) -> None:
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


class AfterTheAnswer(Exception):
    """A message began on a connection after its answer ended (not asked for)."""
