"""Internal KV routes of a disaggregated instance (pull and push flows).

Prefill:

* ``POST /internal/prefill`` (pull) runs a prompt to its first token and keeps
  its blocks under a lease; ``POST /internal/release`` drops the lease early.
* ``POST /internal/push/prefill`` (push) runs a prompt to its first token while
  `PushSender` writes its KV into the decode instance named in the body;
  answers with the first token as soon as it is sampled.
* ``POST /internal/push/cancel`` stops a push (the router: decode refused it).

Decode: the ``prepare`` hook reads ``kv_transfer_params`` from an OpenAI body
and registers the pull or push before the request reaches the engine;
``POST /internal/push/cancel`` stops waiting for a push (the router: prefill
failed); ``GET /internal/kv/pull/stats`` and ``/internal/kv/push/stats``
count what moved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from kvduplex.engine.engine import RequestRejected
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.sampling import SamplingParams
from kvduplex.openai.protocol import error_body
from kvduplex.server.api import APIError, Generation, InstanceState
from kvduplex.transfer.handshake import PeerDirectory
from kvduplex.transfer.pull import LeaseTable, PullConnector, PullSpec, block_ids_of
from kvduplex.transfer.push import PushReceiver, PushSender, PushSpec
from kvduplex.transfer.transport import Transport

logger = logging.getLogger(__name__)


class PrefillRequest(BaseModel):
    xid: str = Field(min_length=1)
    prompt_token_ids: list[int] = Field(min_length=1)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None


class ReleaseRequest(BaseModel):
    xid: str = Field(min_length=1)


class PushPrefillRequest(PrefillRequest):
    decode_url: str = Field(min_length=1)
    decode_engine_id: str | None = None


class CancelRequest(BaseModel):
    xid: str = Field(min_length=1)
    reason: str = "cancelled by the router"


class KVTransferParams(BaseModel):
    mode: Literal["pull", "push"]
    xid: str = Field(min_length=1)
    prefill_url: str
    block_ids: list[int] = Field(default_factory=list)
    """Pull: prefill's held blocks."""
    num_tokens: int = 0
    """Pull: tokens in them."""
    engine_id: str | None = None
    lease_s: float | None = None
    """Seconds prefill keeps the blocks from its answer on (None: unknown)."""
    num_cached_tokens: int = Field(default=0, ge=0)
    """Pull: prompt tokens prefill served from its prefix cache."""


def _not_found(xid: str) -> JSONResponse:
    return JSONResponse(
        error_body(f"no held KV for xid {xid!r}", code="not_found"), status_code=404
    )


def make_prefill_router(state: InstanceState, transport: Transport, lease_s: float) -> APIRouter:
    router = APIRouter()
    leases = LeaseTable(state.engine, lease_s)
    engine = state.engine

    @router.post("/internal/prefill")
    async def prefill(body: PrefillRequest) -> JSONResponse:
        params = _first_token_params(body)
        try:
            async for _ in engine.generate(
                body.xid, body.prompt_token_ids, params, hold_blocks_on_finish=True
            ):
                pass
        except (RequestRejected, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        info = await engine.run_in_engine(lambda e: block_ids_of(e, body.xid))
        if info is None:
            raise APIError(500, f"xid {body.xid}: finished without held blocks")
        leases.start(body.xid)
        return JSONResponse(
            {"xid": body.xid, "engine_id": transport.engine_id, "lease_s": lease_s, **info}
        )

    @router.post("/internal/release")
    async def release(body: ReleaseRequest) -> JSONResponse:
        if not await leases.release(body.xid):
            return _not_found(body.xid)
        return JSONResponse({"xid": body.xid, "released": True})

    return router


def make_push_prefill_router(
    state: InstanceState, sender: PushSender, directory: PeerDirectory
) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    @router.post("/internal/push/prefill")
    async def push_prefill(body: PushPrefillRequest) -> JSONResponse:
        xid = body.xid
        try:
            peer = await asyncio.to_thread(
                directory.get_peer, body.decode_url, body.decode_engine_id
            )
        except Exception as exc:
            raise APIError(502, f"cannot reach decode at {body.decode_url}: {exc}") from None
        params = _first_token_params(body)
        expected = False

        def admit() -> None:  # engine thread: no cancel can come between expect and add
            nonlocal expected
            sender.expect(xid, peer, len(body.prompt_token_ids))
            expected = True

        last, ids, text = None, [], []
        try:
            async for out in engine.generate(
                xid, body.prompt_token_ids, params, hold_blocks_on_finish=True, on_admit=admit
            ):
                last = out
                ids.extend(out.new_token_ids)
                text.append(out.new_text)
        except (RequestRejected, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        finally:
            if expected and (last is None or not last.finished):  # the router left, engine failed
                engine.call(lambda _e: sender.cancel(xid, "prefill did not finish"))
        if last is not None and last.finish_reason == "abort":
            raise APIError(409, f"xid {xid}: the push was cancelled (by decode, or its deadline)")
        if last is None or not ids:
            raise APIError(500, f"xid {xid}: prefill finished without a token")
        return JSONResponse({
            "xid": xid, "engine_id": sender.transport.engine_id, "first_token": ids[0],
            "text": "".join(text), "num_tokens": last.num_prompt_tokens,
            "num_cached_tokens": last.num_cached_tokens,
        })  # fmt: skip

    @router.post("/internal/push/cancel")
    async def push_cancel(body: CancelRequest) -> JSONResponse:
        found = await engine.run_in_engine(lambda _e: sender.cancel(body.xid, body.reason))
        if not found:
            return _not_found(body.xid)
        return JSONResponse({"xid": body.xid, "cancelled": True})

    @router.get("/internal/kv/push/stats")
    async def push_stats() -> JSONResponse:
        return JSONResponse(asdict(sender.stats))

    return router


def _first_token_params(body: PrefillRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=1, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        seed=body.seed, ignore_eos=True,
    )  # fmt: skip


def make_decode_hooks(
    state: InstanceState,
    connector: PullConnector,
    receiver: PushReceiver,
    directory: PeerDirectory,
) -> APIRouter:
    """Set `state.prepare` for pulls and pushes; return the decode-side routes."""

    async def prepare(raw: Request, gen: Generation) -> None:
        arrived = time.monotonic()
        body: Any = await raw.json()
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not params:
            return
        try:
            kv = KVTransferParams.model_validate(params)
        except ValueError as exc:
            raise APIError(400, f"kv_transfer_params: {exc}", param="kv_transfer_params") from None
        try:
            peer = await asyncio.to_thread(directory.get_peer, kv.prefill_url, kv.engine_id)
        except Exception as exc:  # no peer: compute the prompt here
            logger.warning(
                "xid=%s: no connection to %s (%s); computing locally", kv.xid, kv.prefill_url, exc
            )
            return
        if kv.mode == "push":
            receiver.register(PushSpec(kv.xid, peer, kv.prefill_url, gen.request_id))
        else:
            lease_ends_at = None if kv.lease_s is None else arrived + kv.lease_s
            connector.register(
                PullSpec(
                    kv.xid, peer, kv.prefill_url, kv.block_ids, kv.num_tokens, lease_ends_at,
                    kv.num_cached_tokens,
                )
            )
        gen.remote_kv = RemoteKVSpec(kv.xid, source_engine_id=peer.engine_id)

    state.prepare = prepare
    router = APIRouter()

    @router.get("/internal/kv/pull/stats")
    async def pull_stats() -> JSONResponse:
        return JSONResponse(asdict(connector.stats))

    @router.get("/internal/kv/push/stats")
    async def push_stats() -> JSONResponse:
        return JSONResponse(asdict(receiver.stats))

    @router.post("/internal/push/cancel")
    async def push_cancel(body: CancelRequest) -> JSONResponse:
        found = await state.engine.run_in_engine(lambda _e: receiver.cancel(body.xid, body.reason))
        if not found:
            return _not_found(body.xid)
        return JSONResponse({"xid": body.xid, "cancelled": True})

    return router
