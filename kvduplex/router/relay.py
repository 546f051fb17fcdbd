"""Relaying an instance's answer to the client: in whole events, ending with an error
event if the instance fails mid-answer.

A stream is relayed in whole events. If D's connection fails mid-answer (D
died), or the router marks D unhealthy meanwhile (D hung or partitioned: the
relay then closes D's response, which ends its read), the client's stream
ends as vLLM ends a stream that fails: one error event, ``data: {"error":
{"message", "type": "server_error", "code": "decode_failed"}}``, then
``data: [DONE]``. Tokens already sent stay sent; none is sent twice.

In push mode the parts relayed are `splice.push_stream`'s: prefill's first token
first, then decode's stream without its copy of it.

`answers.tap_answer` learns each answer as it passes (its length, the ids
decode reports at its end, which it removes, and a chat answer's message as the
client received it): the session table records them for the next turn.

A chat answer's tool calls and reasoning are parsed after the splice, over the
whole answer in order (`parsing.py` says why there and not at decode).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Any

from kvduplex.common.openai import render
from kvduplex.common.openai.protocol import error_body
from kvduplex.router.calls import InstanceDown
from kvduplex.router.client import CallError
from kvduplex.router.client import StreamedAnswer
from kvduplex.router.relayed_response import REQUEST_ID_KEY
from kvduplex.router.relayed_response import RelayedResponse
from kvduplex.router.splice import FirstToken
from kvduplex.router.splice import SentToken
from kvduplex.router.splice import Splice
from kvduplex.router.splice import first_events
from kvduplex.router.splice import push_stream
from kvduplex.router.splice import splice_first_token
from kvduplex.router.sse import aclose_parts
from kvduplex.router.sse import whole_events

logger = logging.getLogger(__name__)


def relay(
    upstream: StreamedAnswer,
    parts: AsyncIterator[bytes],
    on_close: Callable[[bool], None],
    source: str,
    watch: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
    *,
    in_whole_events: bool = False,
) -> RelayedResponse:
    """Stream `parts` with `upstream`'s status and content type; close it and call
    ``on_close(failed)`` once, when the stream ends or the client leaves (`failed`:
    `source`'s connection failed mid-answer, or `source` was marked unhealthy; a stream
    then ends with an error event). `watch` is `source`'s `Backend.watch`: when it calls
    back, `upstream` is closed and the answer abandoned. `in_whole_events`: `parts` come
    in whole SSE events already (`answers.tap_answer`'s), not regrouped again."""
    content_type = upstream.header(b"content-type") or "application/json"
    is_sse = content_type.startswith("text/event-stream")
    closed = False
    abandoned: InstanceDown | None = None
    failure: dict[str, Any] | None = None  # a whole answer's, to answer in its place
    closing: set[asyncio.Task[None]] = set()

    def abandon() -> None:
        """`source` was marked unhealthy: closing its response ends the read in flight
        (in a task of its own, which nothing cancels; see `splice.push_stream`)."""
        nonlocal abandoned
        abandoned = InstanceDown(source)
        if not closed:
            task = asyncio.ensure_future(upstream.aclose())
            closing.add(task)
            task.add_done_callback(closing.discard)

    unwatch = watch(abandon) if watch is not None else _no_watch

    async def close(failed: bool = False) -> None:
        """Called by the body's `finally`, and as the response's cleanup: the route is
        reported done and D's stream let go of before the first await (see
        `RelayedResponse`)."""
        nonlocal closed
        if not closed:
            closed = True
            unwatch()
            on_close(failed)
            await upstream.aclose()

    async def body() -> AsyncGenerator[bytes, None]:
        failed = False
        source_parts = whole_events(parts) if is_sse and not in_whole_events else parts
        try:
            async for part in source_parts:
                if abandoned is not None:  # what D sent after the router gave up on it
                    raise abandoned
                yield part
        except Exception as exc:
            if abandoned is None and not isinstance(exc, CallError):
                raise
            exc = abandoned or exc  # a closed response's read ends with its own error
            failed = True
            logger.warning("%s failed mid-answer: %r", source, exc)
            message = f"{source} failed mid-answer: {exc!r}"
            error = error_body(message, "server_error", code="decode_failed")
            if is_sse:
                yield (render.sse_data(error) + render.SSE_DONE).encode()
            else:
                nonlocal failure
                failure = error
        finally:
            try:
                await aclose_parts(source_parts)  # stops their readers before upstream closes
            finally:
                await close(failed)

    headers = [(b"content-type", content_type.encode("latin-1"))]
    answer_id = upstream.header(REQUEST_ID_KEY)
    if answer_id is not None:  # the answer's id (a client's own is echoed)
        headers.append((REQUEST_ID_KEY, answer_id.encode("latin-1")))
    whole = None if is_sse else lambda: failure
    return RelayedResponse(body(), close, upstream.status_code, headers, whole)


def _no_watch() -> None:
    pass


# Imported from here by the flows and by tests: the splice's names and the response.
__all__ = [
    "FirstToken",
    "RelayedResponse",
    "SentToken",
    "Splice",
    "first_events",
    "push_stream",
    "relay",
    "splice_first_token",
]
