"""The router of a disaggregated deployment (pull mode).

For each OpenAI request: tokenize, ``POST /internal/prefill`` on the least
loaded prefill instance, then forward the body with ``kv_transfer_params`` to
the least loaded decode instance and relay its answer unchanged (SSE or
JSON). If prefill fails, decode gets the request alone and computes it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvduplex.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvduplex.server.protocol import error_body

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


@dataclass
class RouterState:
    prefill: list[Backend]
    decode: list[Backend]
    tokenizer: Tokenizer
    model: str
    client: httpx.AsyncClient = field(
        default_factory=lambda: httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
    )

    @staticmethod
    def pick(backends: list[Backend]) -> Backend:
        return min(backends, key=lambda b: b.in_flight)


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
        text = tok.apply_chat_template(plain, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(tok.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    return None


async def _prefill(state: RouterState, ids: list[int], body: dict[str, Any]) -> dict[str, Any] | None:
    p = state.pick(state.prefill)
    xid = f"pull-{uuid.uuid4().hex}"
    req: dict[str, Any] = {"xid": xid, "prompt_token_ids": ids}
    for key in ("temperature", "top_p", "top_k", "seed"):
        if body.get(key) is not None:
            req[key] = body[key]
    p.in_flight += 1
    try:
        resp = await state.client.post(p.url + "/internal/prefill", json=req)
        if resp.status_code != 200:
            logger.warning("prefill at %s answered %d: %s", p.url, resp.status_code, resp.text[:200])
            return None
        ans = resp.json()
    except httpx.HTTPError as exc:
        logger.warning("prefill at %s failed: %s; decode computes the prompt", p.url, exc)
        return None
    finally:
        p.in_flight -= 1
    return {
        "mode": "pull", "xid": xid, "prefill_url": p.url, "engine_id": ans.get("engine_id"),
        "block_ids": ans["block_ids"], "num_tokens": ans["num_tokens"],
        "lease_s": ans.get("lease_s"),
    }  # fmt: skip


async def _route(state: RouterState, raw: Request, path: str, chat: bool) -> Response:
    try:
        body = await raw.json()
    except ValueError:
        return JSONResponse(error_body("the request body is not valid JSON"), status_code=400)
    if not isinstance(body, dict):
        return JSONResponse(error_body("the request body must be a JSON object"), status_code=400)
    ids = _prompt_ids(state, body, chat)
    if ids:
        params = await _prefill(state, ids, body)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
    d = state.pick(state.decode)
    d.in_flight += 1
    try:
        upstream = await state.client.send(
            state.client.build_request("POST", d.url + path, json=body), stream=True
        )
    except httpx.HTTPError as exc:
        d.in_flight -= 1
        return JSONResponse(error_body(f"decode at {d.url} failed: {exc}", "server_error"), 502)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for part in upstream.aiter_raw():
                yield part
        finally:
            await upstream.aclose()
            d.in_flight -= 1

    headers = {"content-type": upstream.headers.get("content-type", "application/json")}
    return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)


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
    prefill: list[str], decode: list[str], model: str, host: str, port: int
) -> None:
    if not decode:
        raise ValueError("give at least one --decode URL")
    state = RouterState(
        prefill=[Backend(u.rstrip("/")) for u in prefill],
        decode=[Backend(u.rstrip("/")) for u in decode],
        tokenizer=load_tokenizer(model),
        model=model,
    )
    logger.info("router on http://%s:%d: prefill %s, decode %s", host, port, prefill, decode)
    uvicorn.run(create_router_app(state), host=host, port=port, log_level="warning")
