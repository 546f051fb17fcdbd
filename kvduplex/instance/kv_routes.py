"""Internal KV routes of a disaggregated instance (pull and push flows).

Prefill:

* ``POST /internal/prefill`` (pull) runs a prompt to its first token and keeps
  its blocks under a lease; ``POST /internal/release`` drops the lease early.
* ``POST /internal/push/prefill`` (push) runs a prompt to its first token while
  `PushSender` writes its KV into the decode instance named in the body;
  answers with the first token as soon as it is sampled (and its logprobs, when the
  request asks for them).
* ``POST /internal/push/cancel`` stops a push (the router: decode refused it).
* ``GET /internal/kv/{push,return}/stats`` count what moved (the duplex return's
  offers, as `ReturnPrefillSide` answered them); ``GET /internal/kv/flows`` sizes
  each flow table.

With ``pull_from`` (``--return-mode pull``: a decode's retained turn), the push prefill
first READs the blocks its prefix cache lacks, caches them, then prefills. With a
prompt's prefix that decode leased (``pull_from`` with a ``lease_xid``: the router's
fetch plan, `kvduplex.kvflow.fetch`), it READs them layer by layer while it prefills
the new tokens (`kvduplex.kvflow.prefix_load`). Either answers how many tokens it read
(``num_read_tokens``); a leased prefix is released on decode once no READ of it can
land any more (``POST /internal/release`` there, from the flow I/O thread). Decode's
routes are in `decode_routes`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Annotated
from typing import Any
from typing import Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic import Field
from pydantic import model_validator

from kvduplex.common.limits import RequestRejected
from kvduplex.common.openai.errors import APIError
from kvduplex.common.openai.protocol import error_body
from kvduplex.common.sampling import MAX_LOGPROBS
from kvduplex.common.sampling import GrammarSpec
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.request import Request
from kvduplex.engine.structured import RequestGrammar
from kvduplex.instance.state import InstanceState
from kvduplex.instance.state import kv_clock
from kvduplex.kvflow.connectors import PrefillFlows
from kvduplex.kvflow.flow_io import ReleaseLease
from kvduplex.kvflow.inbox import EngineGoneError
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.lease import LeaseTable
from kvduplex.kvflow.prefix_load import PrefixLoadSpec
from kvduplex.kvflow.pull import http_release
from kvduplex.kvflow.pull_flow import PullPrefillSide
from kvduplex.kvflow.push import NoFirstToken
from kvduplex.kvflow.push import PushCancelled
from kvduplex.kvflow.push import PushPrefillSide
from kvduplex.kvflow.return_flow import ReturnPrefillSide
from kvduplex.kvflow.return_pull import READ_PIN_MARGIN_S
from kvduplex.kvflow.return_pull import RetainedReadSide
from kvduplex.kvflow.return_pull import RetainedTurnRef
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
    session_id: str | None = Field(default=None, max_length=512)
    """The router's session: the prompt's blocks are kept by session value."""


class ReleaseRequest(BaseModel):
    xid: str = Field(min_length=1, max_length=MAX_XID_CHARS)


class RetainedTurn(BaseModel):
    """Blocks of a decode to READ before the prefill: a retained turn (``--return-mode
    pull``, as decode's /internal/kv/retained says) or a leased prefix of the prompt (the
    fetch plan, as decode's /internal/kv/fetch says)."""

    decode_url: str = Field(min_length=1)
    engine_id: str | None = None
    block_ids: list[Annotated[int, Field(ge=0)]]
    keys: list[str]
    token_ids: list[int] | None = None
    """The blocks' tokens (a retained turn); None: the prompt's first ``num_tokens``."""
    num_tokens: int | None = Field(default=None, ge=0)
    """With no ``token_ids``: the blocks hold this many leading tokens of the prompt."""
    pin_left_s: float | None = Field(default=None, ge=0)
    """How long decode still pins the blocks, from when the router sent this on: a READ
    must end within it (less the time this request took to be served here)."""
    lease_xid: str | None = Field(default=None, min_length=1, max_length=MAX_XID_CHARS)
    """Decode's lease on the blocks (a fetch): released there once the READ ended."""

    @model_validator(mode="after")
    def _check_tokens(self) -> RetainedTurn:
        if (self.token_ids is None) == (self.num_tokens is None):
            raise ValueError("give either token_ids or num_tokens")
        return self

    def tokens(self, prompt: list[int]) -> list[int]:
        """The blocks' tokens; ValueError if ``num_tokens`` is longer than `prompt`."""
        if self.token_ids is not None:
            return self.token_ids
        assert self.num_tokens is not None
        if self.num_tokens > len(prompt):
            raise ValueError(f"num_tokens {self.num_tokens} is longer than the prompt")
        return prompt[: self.num_tokens]


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


def make_prefill_router(
    state: InstanceState, transport: Transport, lease_s: float, inbox: FlowInbox | None = None
) -> APIRouter:
    """The pull flow's prefill routes; ``inbox``: the prefill flows' inbox, which ticks
    the leases (expiry)."""
    router = APIRouter()
    leases = LeaseTable(EngineHandle(state.engine), lease_s, inbox)
    state.drain.owed_checks.append(lambda _e: {"pull_leases": len(leases)})
    pull = PullPrefillSide(state.engine, leases)

    @router.post("/internal/prefill")
    async def prefill(body: PrefillRequest, raw: HTTPRequest) -> JSONResponse:
        grammar = await _grammar(state, body)
        try:
            held = Request(
                body.xid, body.prompt_token_ids, _first_token_params(body),
                hold_blocks_on_finish=True, grammar=grammar, session_id=body.session_id,
            )  # fmt: skip
            info = await pull.prefill(held)
        except (RequestRejected, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        if info is None:
            raise APIError(500, f"xid {body.xid}: finished without held blocks")
        if await raw.is_disconnected():  # the router left (its client did): no READ will come
            logger.info("xid=%s: the caller left before the answer; lease released", body.xid)
            await pull.release(body.xid)
        return JSONResponse(
            {"xid": body.xid, "engine_id": transport.engine_id, "lease_s": leases.lease_s, **info}
        )

    @router.post("/internal/release")
    async def release(body: ReleaseRequest) -> JSONResponse:
        if not await pull.release(body.xid):
            return not_found(body.xid)
        return JSONResponse({"xid": body.xid, "released": True})

    return router


class PushPrefill:
    """``POST /internal/push/prefill``: parse, then the push flow's prefill half
    (`kvduplex.kvflow.push.PushPrefillSide`), after the READ of decode's blocks when the
    body names them (`kvduplex.kvflow.return_pull.RetainedReadSide`)."""

    def __init__(
        self, state: InstanceState, flows: PrefillFlows, directory: PeerDirectory,
        release: Callable[[str, str], None],
    ) -> None:  # fmt: skip
        """``release(decode_url, xid)``: end decode's lease on a fetched prefix (blocking;
        run on the flow I/O thread)."""
        self.state = state
        self.directory = directory
        self.io = flows.io
        self.inbox = flows.inbox
        self.release = release
        self.push = PushPrefillSide(state.engine, flows.sender)
        self.retained = RetainedReadSide(state.engine, flows.reader, directory.get_peer)

    async def __call__(self, body: PushPrefillRequest) -> JSONResponse:
        arrived = time.monotonic()
        try:
            peer = await asyncio.to_thread(
                self.directory.get_peer, body.decode_url, body.decode_engine_id
            )
        except IncompatibleLayoutError as exc:  # serves another model, or another layout
            self._release_lease(body.pull_from)
            raise APIError(
                502, f"decode at {body.decode_url} cannot take this instance's KV: {exc}",
                code="incompatible_peer",
            ) from None  # fmt: skip
        except Exception as exc:
            self._release_lease(body.pull_from)
            raise APIError(502, f"cannot reach decode at {body.decode_url}: {exc}") from None
        load, num_read_tokens, grammar = await self._before_prefill(body, arrived)
        try:
            held = Request(
                body.xid, body.prompt_token_ids, _first_token_params(body),
                hold_blocks_on_finish=True, grammar=grammar, session_id=body.session_id,
                connector_meta=load,
            )  # fmt: skip
            first = await self.push.prefill(held, peer)
        except (RequestRejected, ValueError) as exc:
            if load is not None:  # refused before the engine took it: the lease is ours
                self._release_lease(body.pull_from)
            raise APIError(400, str(exc)) from None
        except PushCancelled as exc:
            raise APIError(409, str(exc)) from None
        except NoFirstToken as exc:
            raise APIError(500, str(exc)) from None
        if load is not None:  # known once the first forward waited for every layer
            try:
                num_read_tokens = await asyncio.wrap_future(load.done)
            except EngineGoneError as exc:
                raise APIError(503, str(exc), code="engine_dead") from None
        answer: dict[str, Any] = {
            "xid": first.xid, "engine_id": self.push.sender.transport.engine_id,
            "first_token": first.first_token, "text": first.text,
            "num_tokens": first.num_tokens, "num_cached_tokens": first.num_cached_tokens,
            **kv_clock(self.state.engine.core),
        }  # fmt: skip
        if first.first_token_logprobs is not None:
            answer["first_token_logprobs"] = first.first_token_logprobs.to_json()
        if body.pull_from is not None:
            answer["num_read_tokens"] = num_read_tokens
        return JSONResponse(answer)

    async def _before_prefill(
        self, body: PushPrefillRequest, arrived: float
    ) -> tuple[PrefixLoadSpec | None, int, RequestGrammar | None]:
        """What the prefill needs first: a fetched prefix's load (READ under the prefill),
        or the tokens a retained turn's READ cached (READ before it), and the grammar."""
        src = body.pull_from
        if src is not None and src.lease_xid is not None:
            # A fetched prefix: READ layer by layer under the prefill's first forward.
            load = await self._load_spec(src, body, arrived)
            return load, 0, await _grammar(self.state, body)
        if src is not None and body.grammar is not None:
            # The grammar compiles (off the loop) while decode's blocks are read.
            num_read_tokens, grammar = await asyncio.gather(
                self._read(body, arrived), _grammar(self.state, body)
            )
            return None, num_read_tokens, grammar
        grammar = await _grammar(self.state, body)
        return None, await self._read(body, arrived), grammar

    async def _load_spec(
        self, src: RetainedTurn, body: PushPrefillRequest, arrived: float
    ) -> PrefixLoadSpec | None:
        """A fetched prefix to load layer by layer during the prefill (`PrefixLoads`);
        None (the lease released) if decode is unreachable or its lease ran out. The
        engine releases the lease once the load ended (or never began)."""
        try:
            src.tokens(body.prompt_token_ids)
        except ValueError as exc:
            self._release_lease(src)
            raise APIError(400, f"pull_from: {exc}", param="pull_from") from None
        ends_at = None
        if src.pin_left_s is not None:
            ends_at = arrived + src.pin_left_s - READ_PIN_MARGIN_S
            if ends_at <= time.monotonic():
                logger.info("xid=%s: decode's lease on the prefix ran out; not read", body.xid)
                self._release_lease(src)
                return None
        try:
            peer = await asyncio.to_thread(self.directory.get_peer, src.decode_url, src.engine_id)
        except Exception as exc:
            logger.warning("xid=%s: fetched prefix at %s unreachable: %s", body.xid, src.decode_url, exc)
            self._release_lease(src)
            return None
        bad = [b for b in src.block_ids if b >= peer.layout.num_blocks]
        if bad:
            self._release_lease(src)
            raise APIError(
                400, f"pull_from: block {bad[0]} is out of range; {src.decode_url} has "
                f"{peer.layout.num_blocks} blocks", param="pull_from",
            )  # fmt: skip
        spec = PrefixLoadSpec(
            peer, list(src.block_ids), list(src.keys), ends_at, partial(self._release_lease, src)
        )
        self.inbox.track(spec.done)  # fails if the engine ends first
        return spec

    async def _read(self, body: PushPrefillRequest, arrived: float) -> int:
        """READ and cache the blocks of ``pull_from`` this prefix cache lacks: the tokens
        read (0: none named, none missing, or the READ did not happen or failed; the
        prefill computes what it lacks). A leased prefix is released on decode once the
        READ ended, never while it may still run (a cancelled call leaves the lease to
        expire there)."""
        src = body.pull_from
        if src is None:
            return 0
        try:
            turn = RetainedTurnRef(
                src.decode_url, src.engine_id, src.block_ids, src.keys,
                src.tokens(body.prompt_token_ids), src.pin_left_s,
            )  # fmt: skip
            num_blocks = await self.retained.read(body.xid, turn, arrived)
        except ValueError as exc:
            self._release_lease(src)
            raise APIError(400, f"pull_from: {exc}", param="pull_from") from None
        except EngineGoneError as exc:
            self._release_lease(src)
            raise APIError(503, str(exc), code="engine_dead") from None
        self._release_lease(src)
        return num_blocks * self.retained.reader.engine.block_size

    def _release_lease(self, src: RetainedTurn | None) -> None:
        """End decode's lease on a fetched prefix (none: nothing), off this thread."""
        if src is not None and src.lease_xid is not None:
            self.io.submit(ReleaseLease(self.release, src.decode_url, src.lease_xid))


def make_push_prefill_router(
    state: InstanceState, flows: PrefillFlows, directory: PeerDirectory,
    release: Callable[[str, str], None] = http_release,
) -> APIRouter:  # fmt: skip
    """The push flow's prefill routes; ``release(decode_url, xid)`` ends decode's lease on
    a fetched prefix (default: over HTTP, without the cluster secret)."""
    router = APIRouter()
    engine = state.engine
    sender = flows.sender
    returns = ReturnPrefillSide(flows.acceptor)
    prefill = PushPrefill(state, flows, directory, release)
    router.add_api_route("/internal/push/prefill", prefill, methods=["POST"])

    @router.post("/internal/push/cancel")
    async def push_cancel(body: CancelRequest) -> JSONResponse:
        if not await prefill.push.cancel(body.xid, body.reason):
            return not_found(body.xid)
        return JSONResponse({"xid": body.xid, "cancelled": True})

    @router.get("/internal/kv/push/stats")
    async def push_stats() -> JSONResponse:
        return JSONResponse(asdict(sender.stats))

    @router.get("/internal/kv/return/stats")
    async def return_stats() -> JSONResponse:
        return JSONResponse(asdict(returns.stats()))

    @router.get("/internal/kv/flows")
    async def flow_tables() -> JSONResponse:
        """Each flow table's size, read on the engine thread (0 when nothing moves)."""
        return JSONResponse(await engine.run_in_engine(flows.read_tables))

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
