"""OpenAI response bodies and stream chunks, written the same by the instance and the router.

One answer shares a `ResponseHead` (id, model, endpoint, whether token ids are
returned). Non-streamed: `completion_body`. Streamed: `stream_chunk` around a
`stream_choice` per step, a usage-only chunk at the end when asked for, then
`SSE_DONE`; each chunk is framed with `sse_data`. The chat completion's first
delta carries ``role: assistant``.

Logprobs, when asked for, in OpenAI's two shapes: `chat_logprobs` (``content``:
per token its text, logprob, UTF-8 bytes and ``top_logprobs``, the k most likely
alternatives, most likely first) and `completion_logprobs` (``tokens``,
``token_logprobs``, ``top_logprobs``: per token a map of the k most likely
alternatives and the token itself, as vLLM's, ``text_offset``). They describe
the model's raw distribution (see `kvduplex.common.sampling`). A token's text is
its own decoding; JSON has no -inf, so a logprob of -inf is `JSON_LOGPROB_FLOOR`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from kvduplex.common.openai.protocol import error_body
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.common.sampling import json_logprob
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import Tokenizer

SSE_DONE = "data: [DONE]\n\n"
"""The last event of a stream."""

FIRST_TOKEN_IDS_FIELD = "kvduplex_first_token_ids"
"""Not OpenAI's: on the first chunk that carries tokens, their ids, when the router asks
for them (``kv_transfer_params.mark_first_token``) to splice prefill's first token in by
id; the router removes the field before a client sees the chunk."""


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one answer shares."""

    request_id: str
    """``id`` of the answer (cmpl-... or chatcmpl-...)."""
    model: str
    """The model name the client sees."""
    is_chat: bool
    """Chat completion (message / delta) or text completion (text)."""
    return_token_ids: bool = False
    """Non-standard: add ``token_ids`` to choices (and ``prompt_token_ids`` to bodies)."""
    created: int = field(default_factory=lambda: int(time.time()))
    """Unix time of the answer."""

    @property
    def object(self) -> str:
        return "chat.completion" if self.is_chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.is_chat else "text_completion"


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object; cached tokens are prompt tokens served from a prefix cache."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def token_text_and_bytes(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's own text (special tokens written out) and its bytes: those of the text,
    but a byte-level token that is part of a multi-byte character is its own byte."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if isinstance(tokenizer, ByteTokenizer) and token_id < 256:
        return text, [token_id]
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
    """``choice.logprobs`` of a chat completion (or of a chunk: its tokens only). Tokens
    without logprobs (None) are left out."""
    content = []
    for e in entries:
        if e is None:
            continue
        text, raw = token_text_and_bytes(tokenizer, e.token_id)
        top = []
        for tid, lp in e.top:
            alt_text, alt_raw = token_text_and_bytes(tokenizer, tid)
            top.append({"token": alt_text, "logprob": json_logprob(lp), "bytes": alt_raw})
        content.append(
            {"token": text, "logprob": json_logprob(e.logprob), "bytes": raw, "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprobs | None], text_offset: int = 0
) -> dict[str, Any]:
    """``choice.logprobs`` of a text completion (or of a chunk: its tokens only, their
    offsets counted from `text_offset`, the length of the text before them). Tokens
    without logprobs (None) are left out."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for e in entries:
        if e is None:
            continue
        text = tokenizer.decode([e.token_id], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(json_logprob(e.logprob))
        alternatives: dict[str, float] = {}
        for tid, lp in e.top:  # two ids of one text (bytes of a split character): the likelier
            alternatives.setdefault(
                tokenizer.decode([tid], skip_special_tokens=False), json_logprob(lp)
            )
        alternatives.setdefault(text, json_logprob(e.logprob))
        top_logprobs.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }  # fmt: skip


def completion_body(
    head: ResponseHead,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    usage_: dict[str, Any],
    prompt_token_ids: list[int],
    message: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) answer; a chat answer's `message` when it was parsed
    (`chat_output.ParsedMessage`), else the text as its content; `logprobs` from
    `chat_logprobs` or `completion_logprobs` when asked for."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if head.is_chat:
        choice["message"] = message or {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if head.return_token_ids:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {
        "id": head.request_id, "object": head.object, "created": head.created,
        "model": head.model, "choices": [choice], "usage": usage_,
    }  # fmt: skip
    if head.return_token_ids:
        body["prompt_token_ids"] = prompt_token_ids
    return body


def stream_choice(
    head: ResponseHead,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    is_first: bool,
    delta: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The choice of one stream chunk: new text (and ids, and their `logprobs` when asked
    for), the finish reason once finished; a chat chunk's `delta` when the answer is
    parsed (`chat_output.DeltaMessage`), else the text as its content."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if head.is_chat:
        fields = {"content": text} if delta is None else delta
        choice["delta"] = {"role": "assistant", **fields} if is_first else fields
    else:
        choice["text"] = text
    if head.return_token_ids:
        choice["token_ids"] = token_ids
    return choice


def stream_chunk(
    head: ResponseHead, choice: dict[str, Any] | None, usage_: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One chunk: a choice, or none (the usage chunk at the end)."""
    chunk: dict[str, Any] = {
        "id": head.request_id, "object": head.chunk_object, "created": head.created,
        "model": head.model, "choices": [choice] if choice is not None else [],
    }  # fmt: skip
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def sse_data(payload: dict[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


def sse_error(message: str) -> str:
    """An error event ending a stream that has already begun (status 200 was sent)."""
    return sse_data(error_body(message))
