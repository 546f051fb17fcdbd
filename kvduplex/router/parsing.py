"""Tool calls and reasoning of a routed chat answer, parsed at the router.

Where parsing runs, and why here. In push mode the answer reaches the client
from two places: prefill's first token, which the router writes at once (TTFT
is prefill's), then decode's stream (`splice.push_stream`). A parser at decode
would see the first token only as decode's own copy, which the router drops,
while the router would already have sent that token's text raw (``<think>``,
``<tool_call>``, or the ``{`` of a Llama call) as content. So the router,
which sees the whole answer in order in every flow (push, pull, decode
alone), parses it, with its own flags (``--tool-call-parser``,
``--reasoning-parser``, ``--enable-auto-tool-choice``) and the same torch-free
parser an instance runs (`kvduplex.common.openai.chat_output`). Decode is asked for
the model's raw text (`RAW_OUTPUT_HEADER`, on every routed chat request), so
an answer is never parsed twice, whatever flags the instances have.

`parse_stream` rewrites the relayed SSE chunks: each chunk's content goes
through the parser and the chunk carries what the parser released (nothing
held back is ever sent raw: a chunk left empty is dropped, unless it carries
token ids or the finish reason); the role goes on the first chunk sent; usage,
errors and ``[DONE]`` pass as they are. `parse_body` rewrites a whole answer's
message. Both run before `answers.tap_answer`, which records the answer as the client
receives it (and counts its tokens by decode's report of its ids).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from kvduplex.common.openai.chat_output import ChatOutputParser
from kvduplex.router.sse import aclose_parts


async def parse_stream(
    parts: AsyncIterator[bytes], parser: ChatOutputParser
) -> AsyncIterator[bytes]:
    """Decode's (or the spliced) chat stream with its chunks' text parsed, in whole events."""
    buf = b""
    role_sent = False
    try:
        async for part in parts:
            buf += part
            *events, buf = buf.split(b"\n\n")
            out: list[bytes] = []
            for event in events:
                chunk = _chunk_of(event)
                if chunk is None:
                    out.append(event + b"\n\n")
                    continue
                if not _parse_chunk(chunk, parser, add_role=not role_sent):
                    continue
                role_sent = True
                out.append(f"data: {json.dumps(chunk)}\n\n".encode())
            if out:
                yield b"".join(out)
    finally:
        await aclose_parts(parts)
    if buf:
        yield buf


def _chunk_of(event: bytes) -> dict[str, Any] | None:
    """A chat chunk with a choice (a dict), or None (usage, an error, [DONE], other)."""
    line = event.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return None
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return None
    if not isinstance(chunk, dict):
        return None
    choices = chunk.get("choices")
    if not choices or not isinstance(choices[0], dict) or "delta" not in choices[0]:
        return None
    return chunk


def _parse_chunk(chunk: dict[str, Any], parser: ChatOutputParser, add_role: bool) -> bool:
    """Rewrite `chunk`'s choice in place; False if nothing is left to send."""
    choice = chunk["choices"][0]
    text = (choice.get("delta") or {}).get("content") or ""
    reason = choice.get("finish_reason")
    delta, reason = parser.step(text, reason, is_final=reason is not None)
    has_tokens = choice.get("token_ids") or choice.get("logprobs")  # kept, as an instance does
    if delta.is_empty() and reason is None and not has_tokens:
        return False
    fields = delta.to_json()
    choice["delta"] = {"role": "assistant", **fields} if add_role else fields
    choice["finish_reason"] = reason
    return True


async def parse_body(parts: AsyncIterator[bytes], parser: ChatOutputParser) -> AsyncIterator[bytes]:
    """Decode's whole chat answer with its message parsed (a body that is no answer passes)."""
    buf = b""
    try:
        async for part in parts:
            buf += part
    finally:
        await aclose_parts(parts)
    try:
        body = json.loads(buf)
        choice = body["choices"][0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        yield buf
        return
    parsed = parser.parse(message.get("content") or "", choice.get("finish_reason"))
    choice["message"] = parsed.to_json()
    choice["finish_reason"] = parsed.finish_reason
    yield json.dumps(body).encode()
