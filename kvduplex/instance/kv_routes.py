"""Internal KV routes of a disaggregated instance (pull and push flows).

Prefill:

* ``POST /internal/prefill`` (pull) runs a prompt to its first token and keeps
  its blocks under a lease; ``POST /internal/release`` drops the lease early.
* ``POST /internal/push/prefill`` (push) runs a prompt to its first token while
  `PushSender` writes its KV into the decode instance named in the body;
  answers with the first token as soon as it is sampled (and its logprobs, when the
  request asks for them).
* ``POST /internal/push/cancel`` stops a push (the router: decode refused it).

With ``pull_from`` (``--return-mode pull``), the push prefill first READs
the decode's retained turn blocks its prefix cache lacks. Decode's routes are
in `decode_routes`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from dataclasses import asdict
from typing import Annotated
from typing import Any
from typing import Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic import Field

from kvduplex.common.limits import RequestRejected
from kvduplex.common.openai.protocol import error_body
from kvduplex.common.sampling import MAX_LOGPROBS
from kvduplex.common.sampling import GrammarSpec
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.engine.request import Request
from kvduplex.engine.structured import RequestGrammar
from kvduplex.instance.api import APIError
from kvduplex.instance.api import InstanceState
from kvduplex.kvflow.connectors import PrefillFlows
from kvduplex.kvflow.lease import LeaseTable
from kvduplex.kvflow.pull import block_ids_of
from kvduplex.transport.base import Transport
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.protocol import IncompatibleLayoutError

logger = logging.getLogger(__name__)

MAX_XID_CHARS = 256
"""Longest transfer id an internal route takes (ids travel in every notification)."""


class GrammarBody(BaseModel):
    """A `GrammarSpec` as the router sends it (structured output)."""

    kind: Literal["json_object", "json_schema"]
    schema_: str | None = Field(default=None, alias="schema")

    def spec(self) -> GrammarSpec:
        return GrammarSpec.from_dict({"kind": self.kind, "schema": self.schema_})


class PrefillRequest(BaseModel):
    xid: str = Field(min_length=1, max_length=MAX_XID_CHARS)
    prompt_token_ids: list[int] = Field(min_length=1)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """The request's own penalties: repetition acts on the first token (over the prompt);
    presence and frequency, over an output still empty, only travel on."""
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default=[], max_length=256)
    ignore_eos: bool = False
    """The request's own: with min_tokens >= 1 the first token may be neither one of its
    stop_token_ids nor (unless ignore_eos) EOS."""
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """The request asks for logprobs, with this many alternatives: the first token's are
    computed here (the answer gives them, and KVDone carries them to decode)."""
    grammar: GrammarBody | None = None
    """The first token is sampled under this grammar (the request's structured output)."""


READ_PIN_MARGIN_S = 0.5
"""A READ of a retained turn ends this long before decode's pin does."""


class ReleaseRequest(BaseModel):
    xid: str = Field(min_length=1, max_length=MAX_XID_CHARS)


class RetainedTurn(BaseModel):
    """A decode's retained turn (``--return-mode pull``), as its /internal/kv/retained says."""

    decode_url: str = Field(min_length=1)
    engine_id: str | None = None
    block_ids: list[Annotated[int, Field(ge=0)]]
    keys: list[str]
    token_ids: list[int]
    pin_left_s: float | None = Field(default=None, ge=0)
    """How long decode still pins the blocks, from when the router sent this on: a READ
    must end within it (less the time this request took to be served here)."""


class PushPrefillRequest(PrefillRequest):
    decode_url: str = Field(min_length=1)
    decode_engine_id: str | None = None
    pull_from: RetainedTurn | None = None
    """Read these blocks (those this prefix cache lacks) before prefilling."""


class CancelRequest(BaseModel):
    xid: str = Field(min_length=1, max_length=MAX_XID_CHARS)
    reason: str = "cancelled by the router"


def not_found(xid: str) -> JSONResponse:
    return JSONResponse(
        error_body(f"no held KV for xid {xid!r}", code="not_found"), status_code=404
    )


def make_prefill_router(state: InstanceState, transport: Transport, lease_s: float) -> APIRouter:
    router = APIRouter()
    leases = LeaseTable(state.engine, lease_s)
    state.drain.owed_checks.append(lambda _e: {"pull_leases": len(leases)})
    engine = state.engine

    @router.post("/internal/prefill")
    async def prefill(body: PrefillRequest, raw: HTTPRequest) -> JSONResponse:
        grammar = await _grammar(state, body)
        try:
            held = Request(
                body.xid, body.prompt_token_ids, _first_token_params(body),
                hold_blocks_on_finish=True, grammar=grammar,
            )  # fmt: skip
            async for _ in engine.generate(held):
                pass
        except (RequestRejected, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        info = await engine.run_in_engine(lambda e: block_ids_of(e, body.xid))
        if info is None:
            raise APIError(500, f"xid {body.xid}: finished without held blocks")
        leases.start(body.xid)
        if await raw.is_disconnected():  # the router left (its client did): no READ will come
            logger.info("xid=%s: the caller left before the answer; lease released", body.xid)
            await leases.release(body.xid)
        return JSONResponse(
            {"xid": body.xid, "engine_id": transport.engine_id, "lease_s": leases.lease_s, **info}
        )

    @router.post("/internal/release")
    async def release(body: ReleaseRequest) -> JSONResponse:
        if not await leases.release(body.xid):
            return not_found(body.xid)
        return JSONResponse({"xid": body.xid, "released": True})

    return router


class PushPrefill:
    """``POST /internal/push/prefill``: prefill a prompt while `PushSender` streams its KV
    into the decode instance named in the body; answer with the first token."""

    def __init__(self, state: InstanceState, flows: PrefillFlows, directory: PeerDirectory) -> None:
        self.state = state
        self.engine = state.engine
        self.flows = flows
        self.directory = directory

    async def __call__(self, body: PushPrefillRequest) -> JSONResponse:
        arrived = time.monotonic()
        xid, sender = body.xid, self.flows.sender
        try:
            peer = await asyncio.to_thread(
                self.directory.get_peer, body.decode_url, body.decode_engine_id
            )
        except IncompatibleLayoutError as exc:  # serves another model, or another layout
            raise APIError(
                502, f"decode at {body.decode_url} cannot take this instance's KV: {exc}",
                code="incompatible_peer",
            ) from None
        except Exception as exc:
            raise APIError(502, f"cannot reach decode at {body.decode_url}: {exc}") from None
        grammar = await _grammar(self.state, body)
        if body.pull_from is not None:
            await self._read_retained(xid, body.pull_from, arrived)
        expected = False

        def admit() -> None:  # engine thread: no cancel can come between expect and add
            nonlocal expected
            sender.expect(xid, peer, len(body.prompt_token_ids))
            expected = True

        last, ids, text = None, [], []
        logprobs: list[TokenLogprobs | None] = []
        try:
            held = Request(
                xid, body.prompt_token_ids, _first_token_params(body), hold_blocks_on_finish=True,
                grammar=grammar,
            )  # fmt: skip
            async for out in self.engine.generate(held, on_admit=admit):
                last = out
                ids.extend(out.new_token_ids)
                text.append(out.new_text)
                logprobs.extend(out.new_logprobs or ())
        except (RequestRejected, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        finally:
            if expected and (last is None or not last.finished):  # the router left, engine failed
                self.engine.call(lambda _e: sender.cancel(xid, "prefill did not finish"))
        if last is not None and last.finish_reason == "abort":
            raise APIError(409, f"xid {xid}: the push was cancelled (by decode, or its deadline)")
        if last is None or not ids:
            raise APIError(500, f"xid {xid}: prefill finished without a token")
        answer: dict[str, Any] = {
            "xid": xid, "engine_id": sender.transport.engine_id, "first_token": ids[0],
            "text": "".join(text), "num_tokens": last.num_prompt_tokens,
            "num_cached_tokens": last.num_cached_tokens,
        }  # fmt: skip
        if logprobs and logprobs[0] is not None:
            answer["first_token_logprobs"] = logprobs[0].to_json()
        return JSONResponse(answer)

    async def _read_retained(self, xid: str, src: RetainedTurn, arrived: float) -> int:
        """``--return-mode pull``: READ the decode's retained blocks this cache lacks,
        ending while decode still pins them (else not at all).

        The READ's deadline counts from its post, so it gets what is left, at the post,
        of the pin counted from this request's arrival: the handshake and the wait for
        the engine thread (behind a prefill step) come out of it."""
        ends_at = None
        if src.pin_left_s is not None:
            ends_at = arrived + src.pin_left_s - READ_PIN_MARGIN_S
            if _pin_left_s(xid, ends_at) is None:
                return 0
        try:
            peer = await asyncio.to_thread(self.directory.get_peer, src.decode_url, src.engine_id)
        except Exception as exc:
            logger.warning("xid=%s: retained turn at %s unreachable: %s", xid, src.decode_url, exc)
            return 0
        bad = [b for b in src.block_ids if b >= peer.layout.num_blocks]
        if bad:
            raise APIError(
                400, f"pull_from.block_ids: block {bad[0]} is out of range; {src.decode_url} "
                f"has {peer.layout.num_blocks} blocks", param="pull_from",
            )  # fmt: skip
        reader = self.flows.reader

        def post(_e: object) -> Future[int]:  # engine thread
            deadline_s = None
            if ends_at is not None:
                deadline_s = _pin_left_s(xid, ends_at)
                if deadline_s is None:
                    skipped: Future[int] = Future()
                    skipped.set_result(0)
                    return skipped
            return reader.start(
                peer, f"{xid}-read", src.block_ids, src.keys, src.token_ids, deadline_s
            )

        done = await self.engine.run_in_engine(post)
        return await asyncio.wrap_future(done)


def _pin_left_s(xid: str, ends_at: float) -> float | None:
    """Seconds left until a retained-turn READ must end (``ends_at``, monotonic); None,
    logged, if none are."""
    left = ends_at - time.monotonic()
    if left <= 0:
        logger.info("xid=%s: decode's pin on the retained turn ran out; not read", xid)
        return None
    return left


def make_push_prefill_router(
    state: InstanceState, flows: PrefillFlows, directory: PeerDirectory
) -> APIRouter:
    router = APIRouter()
    engine = state.engine
    sender, acceptor = flows.sender, flows.acceptor
    router.add_api_route(
        "/internal/push/prefill", PushPrefill(state, flows, directory), methods=["POST"]
    )

    @router.post("/internal/push/cancel")
    async def push_cancel(body: CancelRequest) -> JSONResponse:
        found = await engine.run_in_engine(lambda _e: sender.cancel(body.xid, body.reason))
        if not found:
            return not_found(body.xid)
        return JSONResponse({"xid": body.xid, "cancelled": True})

    @router.get("/internal/kv/push/stats")
    async def push_stats() -> JSONResponse:
        return JSONResponse(asdict(sender.stats))

    @router.get("/internal/kv/return/stats")
    async def return_stats() -> JSONResponse:
        return JSONResponse(asdict(acceptor.stats))

    @router.get("/internal/kv/flows")
    async def flow_tables() -> JSONResponse:
        """Each flow table's size, read on the engine thread (0 when nothing moves)."""
        return JSONResponse(await engine.run_in_engine(lambda _e: flows.tables()))

    return router


async def _grammar(state: InstanceState, body: PrefillRequest) -> RequestGrammar | None:
    """The prefill's grammar matcher (compiled off the loop), or None; APIError 400 for a
    grammar that cannot be compiled."""
    if body.grammar is None:
        return None
    try:
        spec = body.grammar.spec()
    except ValueError as exc:
        raise APIError(400, str(exc), param="grammar") from None
    return await state.grammar(spec, body.xid, "grammar")


def _first_token_params(body: PrefillRequest) -> SamplingParams:
    """The first token's sampling: the request's own parameters, for one token.

    The prefill ends after its one token whatever it is (``max_tokens=1``). Under the
    request's ``min_tokens`` the sampler masks, for this token, the request's stop ids
    and (unless it ignores EOS) EOS, as a single instance would; without it nothing is
    masked, and an EOS or a stop id ends the prefill as any other token (``ignore_eos``,
    no stop ids: its end is "length").
    """
    is_banned = body.min_tokens >= 1
    return SamplingParams(
        max_tokens=1, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        seed=body.seed, logprobs=body.logprobs, min_tokens=int(is_banned),
        ignore_eos=body.ignore_eos or not is_banned,
        stop_token_ids=tuple(body.stop_token_ids) if is_banned else (),
    )  # fmt: skip
