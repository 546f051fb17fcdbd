"""The ASGI response that relays an instance's answer to the client.

It sends the head and first part from the request's own task and the rest from
a task that task awaits; it notices a client that leaves (`ClientWatch`, for
servers before ASGI 2.4) and runs its cleanup however the response ends.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncGenerator
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.openai.errors import REQUEST_ID_HEADER

REQUEST_ID_KEY = REQUEST_ID_HEADER.encode("latin-1")
"""The request id header's name, as ASGI headers spell it."""


class RelayedResponse:
    """An ASGI response that relays a body from an instance and runs `cleanup` however it
    ends.

    The head and first part are sent from the request's own task, the rest from a task
    that it awaits (`_send_rest`), and a task of its own waits for the client to leave
    (uvicorn's `send` says nothing once it has): then it cancels the request's task
    (which cancels the one it awaits), once. A stream cut short leaves the body generator
    suspended: its `finally` would run only when the garbage collector gets to it, and
    the upstream connection would wait in CLOSE-WAIT, out of the pool, until then. So
    the body is closed here.

    The cleanup is not shielded: the cancels are native (the client left: `ClientWatch`;
    the server's graceful shutdown ran out: uvicorn cancels what is left), and a shield
    would not stop those. What must happen happens before any await that a cancel could
    interrupt: the route is reported done and the upstream connection let go of
    (`relay.relay`'s close, run in a `finally` however the body's own close ends).
    """

    def __init__(
        self, body: AsyncGenerator[bytes, None], cleanup: Callable[[], Awaitable[None]],
        status_code: int, headers: list[tuple[bytes, bytes]],
        failure: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:  # fmt: skip
        self.status_code = status_code
        self.raw_headers = headers
        """The head's headers; the app adds to them before it sends the response."""
        self.has_started = False
        """Whether the head was sent (an error after it ends the connection)."""
        self.body_iterator = body
        """The body's parts, as relayed."""
        self._cleanup = cleanup
        self._failure = failure

    async def _stream(self, send: Send) -> None:
        """The head and first part, then the rest from a task of its own (`_send_rest`).
        A whole answer (one that says how it failed: `failure`) is read before its head,
        so that one cut short is answered 502 with that error, never 200 with part of a
        body."""
        if self._failure is not None:
            body = b"".join([part async for part in self.body_iterator])
            status, headers = self.status_code, self.raw_headers
            error = self._failure()
            if error is not None:  # the answer's own head goes, the request id stays
                kept = [(k, v) for k, v in headers if k == REQUEST_ID_KEY]
                status, headers = 502, [(b"content-type", b"application/json"), *kept]
                body = json.dumps(error).encode()
            self.has_started = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        self.has_started = True
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        first = await anext(self.body_iterator, None)
        if first is not None:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            await asyncio.ensure_future(self._send_rest(send))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_rest(self, send: Send) -> None:
        """The parts after the first, in a task of its own, which the request's task
        awaits (a cancel of the request's task cancels it). Each part wakes this task
        alone, not every frame the request's task awaits in (the server's, the
        middlewares'). The body's generators move to this task after their first part:
        none of them holds what is bound to a task (a timeout, a context variable's
        token) across a yield."""
        async for part in self.body_iterator:
            await send({"type": "http.response.body", "body": part, "more_body": True})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        # From ASGI 2.4 on, `send` raises OSError once the client has left: no watch.
        watch = None if _version(spec) >= (2, 4) else ClientWatch(receive)
        try:
            await self._stream(send)
        except OSError:
            raise ClientDisconnect() from None
        except asyncio.CancelledError:
            if watch is None or not watch.took_cancel():
                raise
        finally:
            if watch is not None:
                watch.stop()  # before any await: a completed response never cancels
            try:
                await self.body_iterator.aclose()  # runs the body's `finally` if it began
            finally:
                await self._cleanup()  # else this closes upstream


class ClientWatch:
    """Cancels the task that made it, once, when the client leaves (its `receive` says
    ``http.disconnect``): no server cancels a request's task when its client leaves.
    `stop` it when the task is done with the client (a response that completed reads as
    a disconnect)."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._left = False
        self._listener = asyncio.ensure_future(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._left = True
        self._task.cancel()

    def took_cancel(self) -> bool:
        """The task's cancel was this watch's and no other (it is withdrawn then): the
        client left."""
        return self._left and self._task.uncancel() == 0

    def stop(self) -> None:
        self._listener.cancel()


@functools.cache
def _version(spec: str) -> tuple[int, ...]:
    return tuple(int(n) for n in spec.split("."))
