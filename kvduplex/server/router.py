"""The router of a disaggregated deployment: the OpenAI front door.

For each OpenAI request it tokenizes the prompt (with the model's own
tokenizer and chat template), picks a prefill (P) and a decode (D) instance,
and runs one of two flows:

* **push** (default): ``POST /internal/push/prefill`` on P and the OpenAI
  request with ``kv_transfer_params: {mode: push, xid, prefill_url}`` on D,
  at the same time. P streams the prompt's KV into D's blocks layer by layer
  and answers with its first token as soon as it is sampled; a streaming
  client gets that token at once, then D's tokens (D's own copy of the first
  token is dropped). If P fails, D is told to stop waiting and computes the
  prompt itself; if D refuses the request, P is told to stop.
* **pull** (baseline): ``POST /internal/prefill`` on P, then the request with
  ``kv_transfer_params: {mode: pull, ...}`` on D, which READs P's blocks; D's
  answer is relayed unchanged. If P fails, D computes the prompt itself.

Either way the client never sees a transfer fault, only a slower answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvduplex.engine.detokenizer import IncrementalDetokenizer
from kvduplex.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvduplex.openai.protocol import error_body

logger = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a preset or local HF folder, without loading weights."""
    from pathlib import Path

    from kvduplex.model.presets import PRESETS

    if model in PRESETS:
        return ByteTokenizer()
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"model {model!r} is neither a preset nor a local folder")
    return HFTokenizer(folder)


@dataclass
class Backend:
    url: str
    in_flight: int = 0


class Mode(enum.Enum):
    PUSH = "push"
    PULL = "pull"


@dataclass
class RouterState:
    prefill: list[Backend]
    decode: list[Backend]
    tokenizer: Tokenizer
    model: str
    mode: Mode = Mode.PUSH
    affinity: PrefixAffinity = field(default_factory=lambda: PrefixAffinity())
    client: httpx.AsyncClient = field(
        default_factory=lambda: httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
    )

    def pick(self, backends: list[Backend], ids: list[int] | None = None) -> Backend:
        """The backend whose cache likely holds the longest prefix of ``ids``, unless it is
        much busier than the least loaded one; else the least loaded."""
        least = min(backends, key=lambda b: b.in_flight)
        if ids and len(backends) > 1:
            best, matched = self.affinity.best(backends, ids)
            if best is not None and matched > 0 and best.in_flight <= least.in_flight + 1:
                return best
        return least

    def remember(self, backend: Backend, ids: list[int]) -> None:
        self.affinity.add(backend, ids)


class PrefixAffinity:
    """Which backend recently served which prompt prefixes (chunked hash chains, bounded LRU).

    A coarse mirror of the instances' prefix caches, good enough to send a
    conversation's next turn where its history is cached.
    """

    def __init__(self, chunk: int = 64, capacity: int = 65536) -> None:
        self.chunk = chunk
        self.capacity = capacity
        self._owner: OrderedDict[tuple[str, int], None] = OrderedDict()

    def _keys(self, ids: list[int]) -> list[int]:
        keys, h = [], 0
        for start in range(0, len(ids) - self.chunk + 1, self.chunk):
            h = hash((h, tuple(ids[start : start + self.chunk])))
            keys.append(h)
        return keys

    def add(self, backend: Backend, ids: list[int]) -> None:
        for key in self._keys(ids):
            self._owner[(backend.url, key)] = None
            self._owner.move_to_end((backend.url, key))
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def best(self, backends: list[Backend], ids: list[int]) -> tuple[Backend | None, int]:
        keys = self._keys(ids)
        best, best_n = None, 0
        for b in backends:
            n = 0
            for key in keys:
                if (b.url, key) not in self._owner:
                    break
                n += 1
            if n > best_n:
                best, best_n = b, n
        return best, best_n


def _prompt_ids(state: RouterState, body: dict[str, Any], chat: bool) -> list[int] | None:
    """The prompt's token ids as the instance computes them, or None (let D decide)."""
    tok = state.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        plain = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                return None
            plain.append({"role": str(m.get("role", "user")), "content": content})
        try:
            text = tok.apply_chat_template(plain, add_generation_prompt=True)
        except ValueError:
            return None  # the instance answers with the error
        return list(tok.encode(text, add_special_tokens=False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(tok.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    return None


_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed")


def _prefill_body(xid: str, ids: list[int], body: dict[str, Any]) -> dict[str, Any]:
    req: dict[str, Any] = {"xid": xid, "prompt_token_ids": ids}
    for key in _SAMPLING_KEYS:
        if body.get(key) is not None:
            req[key] = body[key]
    return req


async def _post_prefill(
    state: RouterState, p: Backend, path: str, req: dict[str, Any]
) -> dict[str, Any] | None:
    """POST to a prefill instance; its JSON answer, or None (logged) if it failed."""
    p.in_flight += 1
    try:
        resp = await state.client.post(p.url + path, json=req)
        if resp.status_code != 200:
            logger.warning(
                "prefill at %s answered %d: %s", p.url, resp.status_code, resp.text[:200]
            )
            return None
        ans: dict[str, Any] = resp.json()
        return ans
    except httpx.HTTPError as exc:
        logger.warning("prefill at %s failed: %s; decode computes the prompt", p.url, exc)
        return None
    finally:
        p.in_flight -= 1


async def _pull_params(
    state: RouterState, ids: list[int], body: dict[str, Any]
) -> dict[str, Any] | None:
    p = state.pick(state.prefill, ids)
    xid = f"pull-{uuid.uuid4().hex}"
    ans = await _post_prefill(state, p, "/internal/prefill", _prefill_body(xid, ids, body))
    if ans is None:
        return None
    state.remember(p, ids)
    return {
        "mode": "pull", "xid": xid, "prefill_url": p.url, "engine_id": ans.get("engine_id"),
        "block_ids": ans["block_ids"], "num_tokens": ans["num_tokens"],
        "lease_s": ans.get("lease_s"), "num_cached_tokens": ans.get("num_cached_tokens", 0),
    }  # fmt: skip


async def _cancel(state: RouterState, url: str, xid: str, reason: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        await state.client.post(url + "/internal/push/cancel", json={"xid": xid, "reason": reason})


async def _read_body(raw: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await raw.json()
    except ValueError:
        return JSONResponse(error_body("the request body is not valid JSON"), status_code=400)
    if not isinstance(body, dict):
        return JSONResponse(error_body("the request body must be a JSON object"), status_code=400)
    return body


async def _route(state: RouterState, raw: Request, path: str, chat: bool) -> Response:
    body = await _read_body(raw)
    if isinstance(body, JSONResponse):
        return body
    ids = _prompt_ids(state, body, chat)
    if ids and state.prefill and state.mode is Mode.PUSH:
        return await _route_push(state, path, chat, body, ids)
    if ids and state.prefill:
        params = await _pull_params(state, ids, body)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
    d = state.pick(state.decode, ids)
    upstream = await _open_decode(state, d, path, body, {})
    if isinstance(upstream, Response):
        return upstream
    if ids:
        state.remember(d, ids)
    return _relay(upstream, d, _raw_parts(upstream))


async def _open_decode(
    state: RouterState, d: Backend, path: str, body: dict[str, Any], headers: dict[str, str]
) -> httpx.Response | Response:
    d.in_flight += 1
    try:
        return await state.client.send(
            state.client.build_request("POST", d.url + path, json=body, headers=headers),
            stream=True,
        )
    except httpx.HTTPError as exc:
        d.in_flight -= 1
        return JSONResponse(error_body(f"decode at {d.url} failed: {exc}", "server_error"), 502)


async def _raw_parts(upstream: httpx.Response) -> AsyncIterator[bytes]:
    async for part in upstream.aiter_raw():
        yield part


def _relay(upstream: httpx.Response, d: Backend, parts: AsyncIterator[bytes]) -> StreamingResponse:
    async def relay() -> AsyncIterator[bytes]:
        try:
            async for part in parts:
                yield part
        finally:
            await upstream.aclose()
            d.in_flight -= 1

    headers = {"content-type": upstream.headers.get("content-type", "application/json")}
    return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)


async def _route_push(
    state: RouterState, path: str, chat: bool, body: dict[str, Any], ids: list[int]
) -> Response:
    p = state.pick(state.prefill, ids)
    d = state.pick(state.decode, ids)
    xid = f"push-{uuid.uuid4().hex}"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.get("temperature", 1.0) != 0 and body.get("seed") is None:
        # P samples the first token, D the rest (or all, if it falls back): one seed
        # keeps a fallback's first token equal to the one already streamed.
        body = {**body, "seed": random.getrandbits(31)}
    p_req = {**_prefill_body(xid, ids, body), "decode_url": d.url}
    prefill = asyncio.create_task(_post_prefill(state, p, "/internal/push/prefill", p_req))
    d_body = {**body, "kv_transfer_params": {"mode": "push", "xid": xid, "prefill_url": p.url}}
    upstream = await _open_decode(state, d, path, d_body, {"x-request-id": rid})

    async def watch_prefill() -> dict[str, Any] | None:
        ans = await prefill
        if ans is None:
            await _cancel(state, d.url, xid, "prefill failed")
        return ans

    watcher = asyncio.create_task(watch_prefill())
    if isinstance(upstream, Response) or upstream.status_code != 200:
        await _cancel(state, p.url, xid, "decode refused the request")
        if isinstance(upstream, Response):
            return upstream
        return _relay(upstream, d, _raw_parts(upstream))
    state.remember(p, ids)
    state.remember(d, ids)
    if not body.get("stream") or body.get("stop"):
        # Stop strings act on text: only D, which sees the whole answer, can apply them.
        return _relay(upstream, d, _raw_parts(upstream))
    first = _FirstChunk(
        rid=rid, chat=chat, model=str(body.get("model") or state.model),
        token_ids=bool(body.get("return_token_ids")), tokenizer=state.tokenizer,
    )  # fmt: skip
    return _relay(upstream, d, _push_stream(upstream, watcher, first))


@dataclass
class _FirstChunk:
    """What the router needs to write P's first token as the answer's first SSE chunk."""

    rid: str
    chat: bool
    model: str
    token_ids: bool
    tokenizer: Tokenizer

    def render(self, token: int, text: str) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.token_ids:
            choice["token_ids"] = [token]
        chunk = {
            "id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()), "model": self.model, "choices": [choice],
        }  # fmt: skip
        return f"data: {json.dumps(chunk)}\n\n".encode()


async def _push_stream(
    upstream: httpx.Response, prefill: asyncio.Task[dict[str, Any] | None], first: _FirstChunk
) -> AsyncIterator[bytes]:
    """P's first token as soon as P answers, then D's stream without D's first token.

    D emits its first token in a chunk of its own (received or computed), so
    dropping D's first content chunk drops exactly that token. If D's stream
    starts before P answers, D's stream is relayed unchanged.
    """
    events = _sse_events(upstream)
    next_event = asyncio.ensure_future(anext(events, None))
    sent_first = False
    try:
        if not prefill.done():
            await asyncio.wait({prefill, next_event}, return_when=asyncio.FIRST_COMPLETED)
        ans = prefill.result() if prefill.done() else None
        sent_text = ""
        if ans is not None and not next_event.done():
            token = int(ans["first_token"])
            # Text as D's detokenizer releases it for a first token that is not the last.
            sent_text = IncrementalDetokenizer(first.tokenizer).update([token], is_final=False)
            yield first.render(token, sent_text)
            sent_first = True
        skip = sent_first
        while True:
            event = await next_event
            if event is None:
                return
            next_event = asyncio.ensure_future(anext(events, None))
            if skip:
                dropped = _drop_first_token(event, sent_text)
                if dropped is not _NOT_CONTENT:
                    skip = False
                    if dropped is None:
                        continue
                    event = dropped
            yield event
    finally:
        next_event.cancel()
        with contextlib.suppress(BaseException):
            await next_event


_NOT_CONTENT = b""


def _drop_first_token(event: bytes, sent_text: str) -> bytes | None:
    """D's first content chunk minus what the router already sent for the first token.

    None to drop it; the rest of its text (a final flush) and its finish reason
    if there is any; `_NOT_CONTENT` if the event carries no token.
    """
    line = event.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return _NOT_CONTENT
    try:
        chunk = json.loads(line[len(b"data: ") :])
    except ValueError:
        return _NOT_CONTENT
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return _NOT_CONTENT
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
    text = text or ""
    rest = text[len(sent_text) :] if text.startswith(sent_text) else ""
    if choice.get("finish_reason") is None and not rest:
        return None
    if "delta" in choice:
        choice["delta"] = {"content": rest}
    else:
        choice["text"] = rest
    if "token_ids" in choice:
        choice["token_ids"] = []
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _sse_events(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """Whole SSE events (each ends with a blank line) of a streaming response."""
    buf = b""
    async for part in upstream.aiter_raw():
        buf += part
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buf.strip():
        yield buf


def create_router_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="kvduplex-router")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "role": "router"})

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        d = state.pick(state.decode)
        resp = await state.client.get(d.url + "/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")

    @app.post("/v1/completions", response_model=None)
    async def completions(raw: Request) -> Response:
        return await _route(state, raw, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(raw: Request) -> Response:
        return await _route(state, raw, "/v1/chat/completions", chat=True)

    return app


def serve_router(
    prefill: list[str], decode: list[str], model: str, host: str, port: int, mode: str = "push"
) -> None:
    if not decode:
        raise ValueError("give at least one --decode URL")
    try:
        kv_mode = Mode(mode)
    except ValueError:
        raise ValueError(f"--mode must be push or pull, got {mode!r}") from None
    state = RouterState(
        prefill=[Backend(u.rstrip("/")) for u in prefill],
        decode=[Backend(u.rstrip("/")) for u in decode],
        tokenizer=load_tokenizer(model),
        model=model,
        mode=kv_mode,
    )
    logger.info(
        "router (%s) on http://%s:%d: prefill %s, decode %s", mode, host, port, prefill, decode
    )
    uvicorn.run(create_router_app(state), host=host, port=port, log_level="warning")
