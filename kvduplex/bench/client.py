"""A light streaming client: client-observed TTFT, TPOT and end-to-end latency.

Each call streams one OpenAI request and timestamps chunks as they arrive. The
client does no tokenization; token counts come from the server's usage.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import numpy as np
from httpx_sse import SSEError
from httpx_sse import aconnect_sse


@dataclass(frozen=True)
class KVUsage:
    """Non-standard ``usage.kv``: where the prompt was computed and the KV that moved for it."""

    prefill_computed_tokens: int
    """Prompt tokens computed on a prefill instance (0 when colocated)."""
    decode_computed_tokens: int
    """Prompt tokens computed on the instance that answered (D, or the colocated one)."""
    bytes_to_decode: int
    """KV bytes that arrived at the answering instance for this prompt."""


def try_kv_usage(usage: dict[str, Any]) -> KVUsage | None:
    """``usage.kv`` if the server sent it; None otherwise."""
    kv = usage.get("kv")
    if not isinstance(kv, dict):
        return None
    return KVUsage(
        prefill_computed_tokens=int(kv.get("prefill_computed_tokens") or 0),
        decode_computed_tokens=int(kv.get("decode_computed_tokens") or 0),
        bytes_to_decode=int(kv.get("bytes_to_decode") or 0),
    )


@dataclass
class RequestResult:
    """What one streamed request looked like from the client."""

    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    tpot_s: float = 0.0
    """Mean gap between content chunks after the first."""
    first_gap_s: float = 0.0
    """The gap between the first content chunk and the second (0 with fewer than two). In a
    push deployment the first token is prefill's and the second decode's: this gap holds
    the handoff, which `tpot_s` spreads over the answer."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    is_transport_error: bool = False
    """It failed below HTTP: no connection, or the connection broke before the answer
    ended (a client may send it again elsewhere); not an HTTP error status."""
    kv: KVUsage | None = None
    """``usage.kv`` when the server reports it."""
    response_id: str = ""
    """The response's ``id``: the request id the serving instances log and count under."""
    message: dict[str, Any] = field(default_factory=dict)
    """Chat: the assistant message as the stream built it (``content``, and
    ``reasoning_content`` and ``tool_calls`` when the server sent them), what a client
    sends back as history."""


class MessageBuilder:
    """Builds a chat answer's assistant message from its stream's deltas, as OpenAI's
    clients do: content and reasoning concatenated, each tool call by its ``index``
    (id, type and name from its first delta, the arguments' fragments joined)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: dict[str, Any]) -> None:
        if delta.get("content"):
            self.content.append(delta["content"])
        if delta.get("reasoning_content"):
            self.reasoning.append(delta["reasoning_content"])
        for part in delta.get("tool_calls") or ():
            call = self.calls.setdefault(
                int(part.get("index", 0)),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["id"] = part.get("id") or call["id"]
            call["type"] = part.get("type") or call["type"]
            fn = part.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST `body` with stream=True to url+path and time the answer."""
    body = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start = time.perf_counter()
    times: list[float] = []  # when each content chunk came
    text: list[str] = []
    ids: list[int] = []
    usage: dict[str, Any] = {}
    response_id = ""
    message = MessageBuilder()
    try:
        async with aconnect_sse(
            client, "POST", url + path, json=body, headers=dict(headers or {})
        ) as source:
            resp = source.response
            if resp.status_code != 200:
                await resp.aread()
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {resp.text[:300]}")
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    break
                msg = json.loads(event.data)
                if "error" in msg:
                    return RequestResult(ok=False, error=str(msg["error"]))
                response_id = response_id or str(msg.get("id") or "")
                if msg.get("usage"):
                    usage = msg["usage"]
                for choice in msg.get("choices", []):
                    new_ids = choice.get("token_ids") or []
                    delta = choice.get("delta") or {}
                    message.add(delta)
                    piece = choice.get("text") or delta.get("content") or ""
                    if not new_ids and not piece and not _has_output(delta):
                        continue
                    times.append(time.perf_counter())
                    text.append(piece)
                    ids.extend(new_ids)
    except httpx.TransportError as exc:
        return RequestResult(ok=False, error=repr(exc), is_transport_error=True)
    except (httpx.HTTPError, SSEError) as exc:
        return RequestResult(ok=False, error=repr(exc))
    if not times:
        return RequestResult(ok=False, error="no tokens received")
    first, last = times[0], times[-1]
    n = max(len(ids), len(times))
    return RequestResult(
        ok=True,
        ttft_s=first - start,
        e2e_s=last - start,
        tpot_s=(last - first) / (n - 1) if n > 1 else 0.0,
        first_gap_s=times[1] - first if len(times) > 1 else 0.0,
        text="".join(text),
        token_ids=ids,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", len(ids))),
        kv=try_kv_usage(usage),
        response_id=response_id,
        message=message.message() if "chat" in path else {},
    )


def _has_output(delta: dict[str, Any]) -> bool:
    """A chat delta that carries generated output other than content."""
    return bool(delta.get("reasoning_content") or delta.get("tool_calls"))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0
