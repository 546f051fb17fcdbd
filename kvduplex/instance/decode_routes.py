"""Internal routes and the request hook of a decode instance.

The ``prepare`` hook reads ``kv_transfer_params`` from an OpenAI body before
the request reaches the engine (with a cluster secret configured, the OpenAI
routes took them only from a caller that sends it, `api._check_kv_params`: the
params name peers to handshake with, and so to send the secret to, and where
this turn's KV goes): it registers the push or pull of the prompt's
KV (mode ``local``: decode computes the prompt over its own cache, a short
append) with the push or pull flow's decode half, and has the return flow's
decode half name where the finished turn goes (``return_to``, or
``return_mode: pull`` to keep it for the next turn's READ).

Routes: ``POST /internal/push/cancel`` stops waiting for a push (the router:
prefill failed); ``POST /internal/kv/retained`` describes a session's retained
turn; ``POST /internal/kv/fetch`` leases a prompt's cached prefix for prefill to
READ (the router's fetch plan, `kvduplex.kvflow.fetch`) and ``POST
/internal/release`` ends such a lease (prefill, once its READ ended);
``GET /internal/kv/{pull,push,return}/stats`` count what moved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated
from typing import Any
from typing import Literal

from fastapi import APIRouter
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic import Field
from pydantic import model_validator

from kvduplex.common.config import ReturnMode
from kvduplex.common.openai.errors import APIError
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.instance.kv_routes import MAX_XID_CHARS
from kvduplex.instance.kv_routes import CancelRequest
from kvduplex.instance.kv_routes import ReleaseRequest
from kvduplex.instance.kv_routes import not_found
from kvduplex.instance.state import AdmitRefused
from kvduplex.instance.state import Generation
from kvduplex.instance.state import InstanceState
from kvduplex.kvflow.connectors import DecodeFlows
from kvduplex.kvflow.fetch import FetchDecodeSide
from kvduplex.kvflow.fetch import FetchRefusal
from kvduplex.kvflow.fetch import FetchRefused
from kvduplex.kvflow.fetch import PrefixLeases
from kvduplex.kvflow.inbox import XidInUseError
from kvduplex.kvflow.pull import PullSpec
from kvduplex.kvflow.pull_flow import PullDecodeSide
from kvduplex.kvflow.push import PushDecodeSide
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.return_flow import ReturnDecodeSide
from kvduplex.kvflow.return_flow import ReturnTarget
from kvduplex.kvflow.return_pull import RetainedTurnSide
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.protocol import IncompatibleLayoutError

logger = logging.getLogger(__name__)


class KVTransferParams(BaseModel):
    mode: Literal["pull", "push", "local"]
    """push/pull: the prompt's KV comes from ``prefill_url``; local: decode computes
    the prompt itself (a short append over its cached history)."""
    xid: str = Field(default="", max_length=MAX_XID_CHARS)
    prefill_url: str = ""
    block_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Pull: prefill's held blocks."""
    num_tokens: int = Field(default=0, ge=0)
    """Pull: tokens in them."""
    ids_digest: str = Field(default="", pattern=r"^([0-9a-f]{32})?$")
    """Pull: the ids digest of the prompt prefill computed (hex, prefill's answer). A pull
    without it, or whose digest is not the prompt's, reads nothing: decode computes."""
    engine_id: str | None = None
    """``prefill_url``'s KV engine id, if the caller knows it: a connection to that engine
    is used as it is, one to another engine is replaced (None: the address is asked,
    at most every ``--peer-recheck-s``)."""
    lease_s: float | None = Field(default=None, ge=0)
    """Seconds prefill keeps the blocks from its answer on (None: unknown)."""
    num_cached_tokens: int = Field(default=0, ge=0)
    """Pull: prompt tokens prefill served from its prefix cache."""
    session_id: str | None = None
    return_mode: Literal["push", "pull"] = "push"
    """push: offer the finished turn to ``return_to`` (duplex); pull: keep it held for
    the next turn's prefill to READ (vLLM-style, for comparison)."""
    return_to: str | None = None
    """Duplex return: the prefill instance that receives this turn's blocks when it ends."""
    return_engine_id: str | None = None
    """``return_to``'s KV engine id, if the caller knows it (as ``engine_id``)."""
    return_from_block: int | None = Field(default=None, ge=0)
    """First block to return (None: the first that is not wholly prompt)."""
    return_max_tokens: int | None = Field(default=None, ge=0)
    """The return covers at most this many of the turn's tokens (its prompt, then its
    answer), in whole blocks (None: every full block decode computed). The router limits
    it to what the next prompt will hold (an answer's reasoning that the client strips)."""
    mark_first_token: bool = False
    """A streamed answer names the ids of its first chunk with tokens (the router splices
    prefill's first token in by id; see `Generation.mark_first_token`)."""

    @model_validator(mode="after")
    def _check(self) -> KVTransferParams:
        if self.mode != "local" and (not self.xid or not self.prefill_url):
            raise ValueError(f"mode {self.mode} needs xid and prefill_url")
        if self.return_to is not None and not self.session_id:
            raise ValueError("return_to needs a session_id")
        return self


class RetainedRequest(BaseModel):
    session_id: str = Field(min_length=1)


MAX_TOKEN_ID = 2**31 - 1
"""Largest token id a fetch takes (any model's vocabulary is far smaller)."""


class FetchRequest(BaseModel):
    """Lease the cached prefix of a prompt for prefill's READ (the router's fetch plan)."""

    xid: str = Field(min_length=1, max_length=MAX_XID_CHARS)
    """The lease's key: prefill releases it under this xid."""
    session_id: str | None = Field(default=None, max_length=512)
    """The session whose history this is (logged)."""
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = Field(min_length=1)
    """The turn's whole prompt: its cached prefix is leased, its last token never."""


_FETCH_STATUS = {
    FetchRefusal.NOT_CACHED: 404, FetchRefusal.NO_ROOM: 503, FetchRefusal.XID_IN_USE: 409,
}  # fmt: skip


class DecodePreparer:
    """`InstanceState.prepare` of a decode instance: what a request's KV params ask for."""

    def __init__(
        self, returns: ReturnDecodeSide, push: PushDecodeSide, pull: PullDecodeSide,
        directory: PeerDirectory, release: Callable[[str, str], None],
    ) -> None:  # fmt: skip
        """``returns``, ``push``, ``pull``: the return, push and pull flows' decode halves;
        ``release(prefill_url, xid)`` ends a pull's lease on prefill (over HTTP)."""
        self.returns = returns
        self.pull = pull
        self.directory = directory
        self.release = release
        self.push = push

    async def __call__(self, raw: Request, gen: Generation) -> None:
        arrived = time.monotonic()
        body: Any = await raw.json()
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not params:
            return
        try:
            kv = KVTransferParams.model_validate(params)
        except ValueError as exc:
            raise APIError(400, f"kv_transfer_params: {exc}", param="kv_transfer_params") from None
        gen.mark_first_token = kv.mark_first_token
        if kv.session_id:
            gen.request.session_id = kv.session_id
            target = ReturnTarget(
                kv.session_id, ReturnMode(kv.return_mode), kv.return_to, kv.return_engine_id,
                kv.return_from_block, kv.return_max_tokens,
            )  # fmt: skip
            await self.returns.prepare(gen.request, target)
        if kv.mode == "local":
            return
        try:
            peer = await asyncio.to_thread(self.directory.get_peer, kv.prefill_url, kv.engine_id)
        except Exception as exc:  # no peer: compute the prompt here
            logger.warning(
                "xid=%s: no connection to %s (%s); computing locally", kv.xid, kv.prefill_url, exc
            )
            if kv.mode == "pull" and isinstance(exc, IncompatibleLayoutError):
                # Prefill answered, but serves another model: nothing will read its lease.
                await asyncio.to_thread(self.release, kv.prefill_url, kv.xid)
            return
        bad = [b for b in kv.block_ids if b >= peer.layout.num_blocks]
        if bad:
            raise APIError(
                400, f"kv_transfer_params.block_ids: block {bad[0]} is out of range; "
                f"{kv.prefill_url} has {peer.layout.num_blocks} blocks",
                param="kv_transfer_params",
            )  # fmt: skip
        # The spec is registered on the engine thread with the request's add (a duplicate
        # xid rejects the request: 409), so that the request's first step sends KVRegister.
        if kv.mode == "push":
            spec = PushSpec(kv.xid, peer, kv.prefill_url, gen.request.request_id)
            gen.on_admit = _refusing_duplicates(self.push.admit(spec))
        else:
            lease_ends_at = None if kv.lease_s is None else arrived + kv.lease_s
            gen.on_admit = _refusing_duplicates(self.pull.admit(PullSpec(
                kv.xid, peer, kv.prefill_url, kv.block_ids, kv.num_tokens,
                bytes.fromhex(kv.ids_digest), lease_ends_at, kv.num_cached_tokens, gen.request.request_id,
            )))  # fmt: skip
        gen.request.remote_kv = RemoteKVSpec(kv.xid, source_engine_id=peer.engine_id)


def _refusing_duplicates(register: Callable[[], None]) -> Callable[[], None]:
    """``register`` as an ``on_admit`` whose duplicate xid refuses the request with 409."""

    def on_admit() -> None:  # engine thread
        try:
            register()
        except XidInUseError as exc:
            raise AdmitRefused(409, str(exc), param="kv_transfer_params") from None

    return on_admit


def make_decode_hooks(
    state: InstanceState,
    flows: DecodeFlows,
    directory: PeerDirectory,
    release: Callable[[str, str], None],
    fetch_lease_s: float = 10.0,
) -> APIRouter:
    """Set `state.prepare` for pulls, pushes and returns (`release` ends a pull's lease on
    prefill, see `DecodePreparer`); return the decode-side routes (``fetch_lease_s``: the
    lease on a prefix lent to prefill, `kvduplex.kvflow.fetch`)."""
    push = PushDecodeSide(state.engine, flows.push)
    returns = ReturnDecodeSide(flows.offerer, flows.retainer, directory.get_peer)
    state.prepare = DecodePreparer(returns, push, PullDecodeSide(flows.pull), directory, release)
    router = APIRouter()

    @router.get("/internal/kv/pull/stats")
    async def pull_stats() -> JSONResponse:
        return JSONResponse(asdict(flows.pull.stats))

    @router.get("/internal/kv/push/stats")
    async def push_stats() -> JSONResponse:
        waits = flows.receiver.stats
        return JSONResponse(
            {
                **asdict(flows.push.stats),
                "num_alive_received": waits.num_alive_received,
                "num_late": waits.num_late,
                "num_teardowns": waits.num_teardowns,
                "num_quarantine_asks": waits.num_quarantine_asks,
            }
        )

    @router.get("/internal/kv/return/stats")
    async def return_stats() -> JSONResponse:
        return JSONResponse({**asdict(returns.stats()), "num_retained": returns.num_retained()})

    @router.get("/internal/kv/return/records")
    async def return_records() -> JSONResponse:
        """The recent returns by request id: blocks offered and sent, bytes, outcome."""
        return JSONResponse(returns.records())

    @router.get("/internal/kv/flows")
    async def flow_tables() -> JSONResponse:
        """Each flow table's size, read on the engine thread (0 when nothing moves)."""
        return JSONResponse(await state.engine.run_in_engine(flows.read_tables))

    retained_turns = RetainedTurnSide(state.engine, flows.retainer)

    @router.post("/internal/kv/retained")
    async def retained(body: RetainedRequest) -> JSONResponse:
        info = await retained_turns.describe(body.session_id)
        if info is None:
            return not_found(body.session_id)
        return JSONResponse({"engine_id": flows.sender.transport.engine_id, **info})

    @router.post("/internal/push/cancel")
    async def push_cancel(body: CancelRequest) -> JSONResponse:
        if not await push.cancel(body.xid, body.reason):
            return not_found(body.xid)
        return JSONResponse({"xid": body.xid, "cancelled": True})

    _add_fetch_routes(router, state, flows, fetch_lease_s)
    return router


def _add_fetch_routes(
    router: APIRouter, state: InstanceState, flows: DecodeFlows, lease_s: float
) -> None:
    """``POST /internal/kv/fetch`` and ``POST /internal/release``: lend a prompt's cached
    prefix to prefill under a lease of ``lease_s``, and end one."""
    leases = PrefixLeases(EngineHandle(state.engine), lease_s, flows.inbox)
    state.drain.owed_checks.append(lambda _e: {"fetch_leases": len(leases)})
    fetches = FetchDecodeSide(state.engine, leases)

    @router.post("/internal/kv/fetch")
    async def fetch(body: FetchRequest) -> JSONResponse:
        try:
            lease = await fetches.grant(body.xid, body.prompt_token_ids)
        except FetchRefused as exc:
            logger.info("session %s: no fetch: %s", body.session_id, exc)
            status = _FETCH_STATUS[exc.reason]
            raise APIError(status, str(exc), code=exc.reason.value) from None
        return JSONResponse({
            "xid": body.xid, "engine_id": flows.sender.transport.engine_id,
            "block_ids": lease.block_ids, "keys": [bytes(k).hex() for k in lease.keys],
            "num_tokens": lease.num_tokens, "lease_s": lease.lease_s,
        })  # fmt: skip

    @router.post("/internal/release")
    async def release_fetch(body: ReleaseRequest) -> JSONResponse:
        """Prefill's READ of a leased prefix ended: the lease goes now."""
        if not await fetches.release(body.xid):
            return not_found(body.xid)
        return JSONResponse({"xid": body.xid, "released": True})
