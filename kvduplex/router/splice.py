"""Push mode's answer: prefill's first token first, then decode's stream without its copy.

In push mode P samples the answer's first token and the router streams it at
once; D, which continues from that token, emits its own copy of it in a chunk
of its own, which names its token id. `push_stream` writes P's token as the
first chunk, then D's stream with that copy dropped if, and only if, its id is
P's token's (`splice_first_token`); a D that fell back and sampled another
first token ends the stream with an error rather than a mixed answer. D's
events are parsed up to that copy (its ``data:`` lines, each event's JSON); the rest of
D's stream is relayed as its bytes come, unparsed.

When the request asks for logprobs, P's answer carries the first token's (P
computed them, D never sees those logits): the first chunk has them, and D
has them too (they travel with the token in KVDone) for the answers it writes
whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Generator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from kvduplex.common.detokenizer import IncrementalDetokenizer
from kvduplex.common.openai import render
from kvduplex.common.openai.protocol import error_body
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.router.client import StreamedAnswer
from kvduplex.router.sse import aclose_parts
from kvduplex.router.sse import event_data

logger = logging.getLogger(__name__)


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
    answer's tap, else `relay.relay`).
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
        # Shielded: a client that leaves cancels this task once (`RelayedResponse`); the
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
        # client's leaving brings ends the read in flight, and `relay.relay` closes D's response.
        while part is not None:  # the rest of D's stream passes as it is
            yield part
            part = await anext(parts, None)
    finally:  # `relay.relay`'s close closes D's response too, if this is cut short
        if not first_part.done():
            await upstream.aclose()  # ends the read (a no-op if it already ended)
        with contextlib.suppress(BaseException):
            await asyncio.shield(first_part)
        await aclose_parts(parts)


def first_events(sent: SentToken | None) -> Generator[tuple[bytes, Splice], bytes, None]:
    """Sent D's stream part by part, the bytes to relay of it and how the splice stands:
    `Splice.NOT_CONTENT` while D's first chunk with tokens is still ahead (only whole
    events are relayed, the first chunk as `splice_first_token` rewrites it); then the
    splice found and the rest of the part as it came (the caller relays what follows
    unparsed)."""
    buf = b""
    out = b""
    splice = Splice.NOT_CONTENT
    while True:
        buf += yield out, splice
        kept: list[bytes] = []
        while splice is Splice.NOT_CONTENT and (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[: end + 2], buf[end + 2 :]
            data = event_data(event)
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
