"""What the router learns of each answer it relays, for the session's next turn.

Decode ends every routed answer with its generated ids (asked for with
``kv_transfer_params.report_answer``: the last event of a stream, or a field of
a whole body, `transcript.ANSWER_IDS_FIELD`). `tap_answer` takes them out
before the client sees the answer and reports, once the answer ended, its
length, those ids and a chat answer's message as the client received it (it
runs after the router's parsing). The session table keeps them: how much of
the next prompt decode holds (short appends), whether the next prompt sends
the answer back as returned (the adaptive return), and the ids to splice in
its place (`kvduplex.common.openai.transcript`).

`return_limit` says how much of a turn the duplex return should give prefill:
what the next prompt will hold. An answer's reasoning, which clients strip
before sending the answer back, would never be hit::

    turn       |---- prompt ----|<think> reasoning </think> content|
    next       |---- prompt ----|content|-- new message --|
    returned   |== whole blocks ==|   (up to the prompt's end, rounded down)
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvduplex.common.openai.transcript import ANSWER_IDS_FIELD
from kvduplex.common.openai.transcript import MessageAccumulator


@dataclass(frozen=True)
class RelayedAnswer:
    """What the router learnt of an answer it relayed, once it ended."""

    num_tokens: int
    """``usage.completion_tokens`` where the response carries it, else the tokens of its
    chunks (one per content chunk unless token ids say more)."""
    token_ids: list[int] | None
    """The generated ids, where decode reported them (`ANSWER_IDS_FIELD`)."""
    message: dict[str, Any] | None
    """A chat answer's message as the client received it."""


async def tap_answer(
    parts: AsyncIterator[bytes],
    is_stream: bool,
    is_chat: bool,
    on_answer: Callable[[RelayedAnswer], None],
) -> AsyncIterator[bytes]:
    """Relay `parts` without decode's report of the answer's ids (the last event of a
    stream, a field of a whole body), and call `on_answer` once the answer ended (not if
    the stream was cut or the client left). A completion stream's text chunks are relayed
    without being parsed (`_PARSED_MARKS`); a chat stream's deltas make its message. A
    stream is relayed in whole events (what follows the last one is relayed only when the
    stream ends, not when it is cut)."""
    if not is_stream:
        raw = b"".join([part async for part in parts])
        try:
            body = json.loads(raw)
            reported = body.pop(ANSWER_IDS_FIELD, None)
            num_tokens = int(body["usage"]["completion_tokens"])
            choice = body["choices"][0]
        except (ValueError, KeyError, TypeError, IndexError):
            yield raw
            return
        yield json.dumps(body).encode()
        message = choice.get("message") if is_chat else None
        on_answer(RelayedAnswer(num_tokens, _ids_or_none(reported), message))
        return
    buf = b""
    tally = _StreamTally(is_chat)
    async for part in parts:
        buf += part
        *events, buf = buf.split(b"\n\n")
        out = [event + b"\n\n" for event in events if tally.take(event)]
        if out:
            yield b"".join(out)
    if buf:
        yield buf
    on_answer(tally.answer())


class _StreamTally:
    """What a stream's events tell of its answer, event by event."""

    def __init__(self, is_chat: bool) -> None:
        self.is_chat = is_chat
        self.num_chunk_tokens = 0
        self.usage_tokens: int | None = None
        self.ids: list[int] | None = None
        self.message = MessageAccumulator()

    def take(self, event: bytes) -> bool:
        """Note one whole event; False if it is decode's report of the ids (not relayed)."""
        if not self.is_chat and _PARSED_MARKS.search(event) is None:
            self.num_chunk_tokens += _TEXT in event and _NO_TEXT not in event
            return True  # a completion chunk of text: counted, not parsed
        chunk = _event_json(event)
        if not isinstance(chunk, dict):
            return True
        if ANSWER_IDS_FIELD in chunk:
            self.ids = _ids_or_none(chunk[ANSWER_IDS_FIELD])
            return False
        usage = chunk.get("usage")
        used = usage.get("completion_tokens") if isinstance(usage, dict) else None
        self.usage_tokens = used if isinstance(used, int) else self.usage_tokens
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self.message.add_delta(delta)
            text = choice.get("text") or (delta or {}).get("content")
            n = choice.get("token_ids")
            self.num_chunk_tokens += len(n) if n else 1 if text else 0
        return True

    def answer(self) -> RelayedAnswer:
        num_tokens = self.usage_tokens if self.usage_tokens is not None else self.num_chunk_tokens
        if self.ids is not None:
            num_tokens = len(self.ids)
        return RelayedAnswer(num_tokens, self.ids, self.message.message() if self.is_chat else None)


_PARSED_MARKS = re.compile(b'"(?:%s|usage|token_ids)"' % re.escape(ANSWER_IDS_FIELD.encode()))
"""What makes a completion stream's event worth parsing: the report of the answer's ids,
usage, token ids (one search an event). Its other events are text chunks, counted by
their bytes (as an instance writes them: `json.dumps`'s separators); a quote in a text
is escaped, never a mark."""
_TEXT = b'"text": "'
_NO_TEXT = b'"text": ""'


def return_limit(
    may_start_with_reasoning: bool, sends_reasoning: bool, num_prompt_tokens: int
) -> int | None:
    """How many of a turn's tokens its duplex return covers (None: all that decode holds).

    An answer that may begin with reasoning (`ChatOutputParser.may_start_with_reasoning`:
    both parsers read reasoning only at an answer's start) in a session whose client has not
    shown that it sends reasoning back (`Session.sends_reasoning`) is returned up to the
    prompt's end: the rest is the reasoning and what follows it, which the next prompt
    does not hold where the answer left it. Decode rounds the limit down to whole blocks.
    """
    if may_start_with_reasoning and not sends_reasoning:
        return num_prompt_tokens
    return None


def _event_json(event: bytes) -> Any:
    line = event.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return None
    try:
        return json.loads(line[6:])
    except ValueError:
        return None


def _ids_or_none(ids: Any) -> list[int] | None:
    if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
        return ids
    return None
