"""Relaying decode's answer to the client: unchanged, or with prefill's first token first.

In push mode P samples the answer's first token and the router streams it at
once; D, which continues from that token, emits its own copy of it in a chunk
of its own, which names its token id. `push_stream` writes P's token as the
first chunk, then D's stream with that copy dropped if, and only if, its id is
P's token's (`splice_first_token`); a D that fell back and sampled another
first token ends the stream with an error rather than a mixed answer. D's
events are parsed up to that copy (its ``data:`` lines, each event's JSON); the rest of
D's stream is relayed as its bytes come, unparsed.

A stream is relayed in whole events. If D's connection fails mid-answer (D
died), or the router marks D unhealthy meanwhile (D hung or partitioned: the
relay then closes D's response, which ends its read), the client's stream
ends as vLLM ends a stream that fails: one error event, ``data: {"error":
{"message", "type": "server_error", "code": "decode_failed"}}``, then
``data: [DONE]``. Tokens already sent stay sent; none is sent twice.

When the request asks for logprobs, P's answer carries the first token's (P
computed them, D never sees those logits): the first chunk has them, and D
has them too (they travel with the token in KVDone) for the answers it writes
whole.

`answers.tap_answer` learns each answer as it passes (its length, the ids
decode reports at its end, which it removes, and a chat answer's message as the
client received it): the session table records them for the next turn.

A chat answer's tool calls and reasoning are parsed after the splice, over the
whole answer in order (`parsing.py` says why there and not at decode).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import re
from collections.abc import AsyncGenerator
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Generator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.detokenizer import IncrementalDetokenizer
from kvduplex.common.openai import render
from kvduplex.common.openai.errors import REQUEST_ID_HEADER
from kvduplex.common.openai.protocol import error_body
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.router.calls import InstanceDown
from kvduplex.router.client import CallError
from kvduplex.router.client import StreamedAnswer

logger = logging.getLogger(__name__)


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
    (`relay`'s close, run in a `finally` however the body's own close ends).
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
                kept = [(k, v) for k, v in headers if k == _REQUEST_ID_KEY]
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
        (in a task of its own, which nothing cancels; see `push_stream`)."""
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
        `_RelayedResponse`)."""
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
    answer_id = upstream.header(_REQUEST_ID_KEY)
    if answer_id is not None:  # the answer's id (a client's own is echoed)
        headers.append((_REQUEST_ID_KEY, answer_id.encode("latin-1")))
    whole = None if is_sse else lambda: failure
    return RelayedResponse(body(), close, upstream.status_code, headers, whole)


_REQUEST_ID_KEY = REQUEST_ID_HEADER.encode("latin-1")


def _no_watch() -> None:
    pass


async def whole_events(parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`parts` regrouped at SSE event ends (a blank line), so that a stream cut mid-event
    never leaves half an event before the error event; a cut event is dropped."""
    buf = b""
    try:
        async for part in parts:
            buf += part
            end = buf.rfind(b"\n\n")
            if end >= 0:
                yield buf[: end + 2]
                buf = buf[end + 2 :]
    finally:
        await aclose_parts(parts)
    if buf:
        yield buf


async def aclose_parts(parts: AsyncIterator[bytes]) -> None:
    """Close `parts` now if it is a generator (else the garbage collector would, later)."""
    aclose = getattr(parts, "aclose", None)
    if aclose is not None:
        await aclose()


@dataclass(frozen=True)
class FirstToken:
    """What the router needs to write P's first token as the answer's first chunk."""

    head: render.ResponseHead
    tokenizer: Tokenizer
    xid: str = ""
    """The transfer, as log lines name it."""
    on_diverged: Callable[[], None] = field(default=lambda: None)
    """Called when D's first token is not the one sent (the stream then ends)."""

    def chunk(self, token: int, logprobs: TokenLogprobs | None = None) -> tuple[str, bytes]:
        """The token's text as D's detokenizer releases it (not the last token), and the chunk
        (with the token's `logprobs`, P's, when the request asks for them)."""
        text = IncrementalDetokenizer(self.tokenizer).update([token], is_final=False)
        entry = None
        if logprobs is not None:
            if self.head.is_chat:
                entry = render.chat_logprobs(self.tokenizer, [logprobs])
            else:
                entry = render.completion_logprobs(self.tokenizer, [logprobs])
        choice = render.stream_choice(self.head, text, [token], None, True, logprobs=entry)
        return text, render.sse_data(render.stream_chunk(self.head, choice)).encode()


async def push_stream(
    upstream: StreamedAnswer,
    prefill: asyncio.Task[dict[str, Any] | None],
    first: FirstToken,
) -> AsyncIterator[bytes]:
    """P's first token as soon as P answers, then D's stream without D's first token.

    D emits its first token in a chunk of its own (received from P, or sampled itself
    after a fallback), which names its token id (`render.FIRST_TOKEN_IDS_FIELD`, asked
    for with ``kv_transfer_params.mark_first_token``; removed here). That chunk is dropped
    only if its token is the one already sent. If it is another (D fell back and sampled
    differently), the answer cannot be both: the stream ends with a ``decode_diverged``
    error event, never with P's token followed by the rest of D's answer. If D's stream
    starts before P answers (or P failed), D's stream is relayed as it is, less the field.

    Only D's events up to that chunk are parsed (`first_events`); from there on D's bytes
    are relayed as they arrive, unparsed (regrouped in whole events after: the
    answer's tap, else `relay`).
    """
    parts = aiter(upstream)
    first_part = asyncio.ensure_future(anext(parts, None))
    try:
        if not prefill.done():
            await asyncio.wait({prefill, first_part}, return_when=asyncio.FIRST_COMPLETED)
        ans = prefill.result() if prefill.done() else None
        sent: SentToken | None = None
        if ans is not None and not first_part.done():
            token = int(ans["first_token"])
            text, chunk = first.chunk(token, _try_logprobs(ans.get("first_token_logprobs")))
            sent = SentToken(token, text)
            yield chunk
        splicing = first_events(sent)
        next(splicing)
        # Shielded: a client that leaves cancels this task once (`_RelayedResponse`); the
        # read in its own task is then left to `finally`, which closes D's response.
        part = await asyncio.shield(first_part)
        while part is not None:
            out, splice = splicing.send(part)
            if splice is Splice.DIVERGED:
                first.on_diverged()
                logger.warning(
                    "xid=%s: decode's first token is not prefill's %s (decode fell back "
                    "and sampled another); ending the stream", first.xid, sent,
                )  # fmt: skip
                message = "decode's answer diverged from the first token already sent"
                error = error_body(message, "server_error", code="decode_diverged")
                yield (render.sse_data(error) + render.SSE_DONE).encode()
                return
            if out:
                yield out
            part = await anext(parts, None)
            if splice is not Splice.NOT_CONTENT:
                break
        # Read in this task from here on, not one task a part: the one cancel that a
        # client's leaving brings ends the read in flight, and `relay` closes D's response.
        while part is not None:  # the rest of D's stream passes as it is
            yield part
            part = await anext(parts, None)
    finally:  # `relay`'s close closes D's response too, if this is cut short
        if not first_part.done():
            await upstream.aclose()  # ends the read (a no-op if it already ended)
        with contextlib.suppress(BaseException):
            await asyncio.shield(first_part)
        await aclose_parts(parts)


def first_events(sent: SentToken | None) -> Generator[tuple[bytes, Splice], bytes, None]:
    """Sent D's stream part by part, the bytes to relay of it and how the splice stands:
    `Splice.NOT_CONTENT` while D's first chunk with tokens is still ahead (only whole
    events are relayed, the first chunk as `splice_first_token` rewrites it); then the splice found and the rest of the part as
    it came (the caller relays what follows unparsed)."""
    buf = b""
    out = b""
    splice = Splice.NOT_CONTENT
    while True:
        buf += yield out, splice
        kept: list[bytes] = []
        while splice is Splice.NOT_CONTENT and (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[: end + 2], buf[end + 2 :]
            data = _event_data(event)
            if data is None:  # a comment, or an event without data: passed on
                kept.append(event)
                continue
            splice, data = splice_first_token(data, sent)
            if data is not None:
                kept.append(f"data: {data}\n\n".encode())
        if splice is not Splice.NOT_CONTENT:
            kept.append(buf)
            buf = b""
        out = b"".join(kept)


def _event_data(event: bytes) -> str | None:
    """The data of one whole SSE event, its ``data:`` lines joined as the SSE spec joins
    them; None if it has none (a comment, say)."""
    text = event.decode("utf-8", "replace")
    lines = [
        line[5:].removeprefix(" ") for line in _SSE_LINE.split(text) if line.startswith("data:")
    ]
    return "\n".join(lines) if lines else None


_SSE_LINE = re.compile(r"\r\n|\r|\n")
"""Where an SSE line ends."""


def _try_logprobs(data: Any) -> TokenLogprobs | None:
    """P's first-token logprobs from its answer (None: not asked for, or not readable)."""
    if data is None:
        return None
    try:
        return TokenLogprobs.from_json(data)
    except ValueError:
        logger.warning("prefill's first-token logprobs are not readable: %r", data)
        return None


@dataclass(frozen=True)
class SentToken:
    """P's first token as the router sent it: its id and its text."""

    token_id: int
    text: str


class Splice(enum.Enum):
    """What `splice_first_token` found in one event of D's stream."""

    NOT_CONTENT = "not_content"
    """No token (usage, [DONE], an error): relayed as it is; the first chunk is still ahead."""
    RELAYED = "relayed"
    """D's first chunk with tokens, nothing sent before it: relayed (less the id field)."""
    DROPPED = "dropped"
    """D's first token is the one sent: the chunk is dropped, or what else it carries kept."""
    DIVERGED = "diverged"
    """D's first token is not the one sent."""


def splice_first_token(data: str, sent: SentToken | None) -> tuple[Splice, str | None]:
    """An event of D's stream (its data) while the router looks for D's first chunk with
    tokens, and what to relay of it (None: nothing).

    That chunk loses `render.FIRST_TOKEN_IDS_FIELD`. With `sent`, it is D's copy of the
    token sent if its first id is `sent`'s (a D that names no ids: if its text starts
    with `sent`'s): dropped, unless it also ends the answer or carries more text (a final
    flush), which is kept without the token's text and ids.
    """
    try:
        chunk = json.loads(data)
    except ValueError:
        return Splice.NOT_CONTENT, data
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return Splice.NOT_CONTENT, data
    ids = chunk.pop(render.FIRST_TOKEN_IDS_FIELD, None)
    if sent is None:
        return Splice.RELAYED, json.dumps(chunk)
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
    text = text or ""
    if isinstance(ids, list):
        same = bool(ids) and ids[0] == sent.token_id
    else:  # a decode instance that does not name ids
        same = text.startswith(sent.text)
    if not same:
        return Splice.DIVERGED, None
    rest = text[len(sent.text) :] if text.startswith(sent.text) else ""
    if choice.get("finish_reason") is None and not rest:
        return Splice.DROPPED, None
    if "delta" in choice:
        choice["delta"] = {"content": rest}
    else:
        choice["text"] = rest
    if "token_ids" in choice:
        choice["token_ids"] = choice["token_ids"][1:]
    _drop_first_logprobs(choice)
    return Splice.DROPPED, json.dumps(chunk)


def _drop_first_logprobs(choice: dict[str, Any]) -> None:
    """`choice` without its first token's logprobs entry (sent with that token already)."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return
    for key in ("content", "tokens", "token_logprobs", "top_logprobs", "text_offset"):
        if isinstance(lp.get(key), list):
            lp[key] = lp[key][1:]
