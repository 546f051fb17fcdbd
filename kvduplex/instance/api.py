"""The OpenAI-compatible HTTP API of one instance.

Routes: /v1/completions, /v1/chat/completions (streaming SSE or not),
/v1/models, /health (liveness), /ready (readiness: not while draining, see
`kvduplex.common.drain`), /metrics. Extra routes (internal KV endpoints of a
disaggregated instance) are added by the caller through `extra_routers`.

Request ids: every request gets an engine request id of this instance's own
making (``cmpl-``/``chatcmpl-`` and a random hex), which is the answer's `id`
and its ``X-Request-ID`` response header, unless the client sent an
``X-Request-ID``: that one is echoed back in the header, and never becomes an
engine id (an id names what an abort or a held request's release acts on).

A dead engine (its loop crashed or stopped) answers 503 in OpenAI error JSON
(``code: engine_dead``) on every route but /health and /ready (503 with the reason) and
/metrics: at once for new requests (`DeadEngineGuard`), and for a request in
flight as soon as the engine call it awaits fails with EngineDeadError.

Chat answers are recorded in the instance's `AnswerBook` (their generated ids and
the message as returned), so a later request that sends one back unchanged gets
those ids in its prompt (`kvduplex.common.openai.transcript`). A router passes the ids it
built in ``kv_transfer_params.prompt_token_ids`` (used as they are) and asks with
``report_answer`` for the answer's ids at the end of the answer
(`transcript.ANSWER_IDS_FIELD`).

Trust: on an instance with a cluster secret, a request that carries
``kv_transfer_params`` (any role) needs the secret in its header, else 401
(``code: invalid_cluster_secret``): the params name the prompt's ids as they are
and, on decode, peers and where KV goes. /health and /ready name the KV engine id
only to callers that send the secret; what the instance serves (its model
fingerprint) they show to all.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from fastapi import FastAPI
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest

from kvduplex.common.openai.chat_output import RAW_OUTPUT_HEADER
from kvduplex.common.openai.chat_output import ChatOutputParser
from kvduplex.common.openai.chat_output import check_tool_choice
from kvduplex.common.openai.chat_output import output_parser
from kvduplex.common.openai.chat_output import prompt_tail
from kvduplex.common.openai.errors import REQUEST_ID_HEADER
from kvduplex.common.openai.errors import APIError
from kvduplex.common.openai.prompt import PromptError
from kvduplex.common.openai.prompt import prompt_token_ids
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import CompletionRequest
from kvduplex.common.openai.protocol import OpenAIRequest
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.engine.report import pool_report
from kvduplex.engine.request import Request as EngineRequest
from kvduplex.instance.answers import serve_generation
from kvduplex.instance.errors import install_error_handlers
from kvduplex.instance.health import add_health
from kvduplex.instance.state import Generation
from kvduplex.instance.state import InstanceState

logger = logging.getLogger(__name__)


def create_app(state: InstanceState, extra_routers: Sequence[APIRouter] = ()) -> FastAPI:
    """Build the FastAPI app of one instance."""
    app = FastAPI(title="kvduplex", version="0.1.0")
    app.state.instance = state
    install_error_handlers(app)
    add_health(app, state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/kv/stats")
    async def kv_stats() -> JSONResponse:
        """Block-pool accounting, checked in the engine thread (tests, operators)."""
        return JSONResponse(asdict(await state.engine.run_in_engine(pool_report)))

    add_openai_routes(app, state)
    for router in extra_routers:
        app.include_router(router)
    return app


def add_openai_routes(app: FastAPI, state: InstanceState) -> None:
    """/v1/models, /v1/completions and /v1/chat/completions."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name, "object": "model", "created": state.created,
                    "owned_by": "kvduplex", "max_model_len": state.max_model_len,
                }
                for name in state.served_model_names
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        _check_model(state, body.model)
        _check_kv_params(state, raw, body)
        ids = _prompt_ids(state, body)
        gen = _make_generation(state, raw, body, ids, body.max_tokens, "cmpl")
        return await serve_generation(state, raw, gen, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_model(state, body.model)
        _check_kv_params(state, raw, body)
        ids = _routed_prompt_ids(body) or _prompt_ids(state, body)
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, state.max_model_len - len(ids))
        gen = _make_generation(state, raw, body, ids, max_tokens, "chatcmpl")
        gen.parser = _chat_parser(state, raw, body, ids)
        return await serve_generation(state, raw, gen, chat=True)


def _prompt_ids(state: InstanceState, body: OpenAIRequest) -> list[int]:
    try:
        return prompt_token_ids(body, state.tokenizer, state.answers, time.monotonic())
    except PromptError as exc:
        raise APIError(400, exc.message, param=exc.param) from None


def _check_kv_params(state: InstanceState, raw: Request, body: OpenAIRequest) -> None:
    """APIError 401 for ``kv_transfer_params`` from a caller that did not prove the
    cluster secret (`InstanceState.is_member`), whatever the role: they set the prompt's
    ids as they are, ask for the answer's ids, and on decode name peers to handshake
    with and where the turn's KV goes."""
    if body.kv_transfer_params and not state.is_member(raw):
        raise APIError(
            401, f"kv_transfer_params need the cluster secret in the {SECRET_HEADER} header",
            code="invalid_cluster_secret", param="kv_transfer_params",
        )  # fmt: skip


def _routed_prompt_ids(body: ChatCompletionRequest) -> list[int] | None:
    """The ids a router built for this chat prompt (``kv_transfer_params.prompt_token_ids``),
    if it sent them: prefill computes those, so decode must too. Checked like any prompt's
    ids (`_make_generation`); an instance with a cluster secret takes
    ``kv_transfer_params`` only from a caller that sends it (`_check_kv_params`)."""
    ids = (body.kv_transfer_params or {}).get("prompt_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise APIError(
            400, "kv_transfer_params.prompt_token_ids must be a non-empty list of token ids",
            param="kv_transfer_params",
        )  # fmt: skip
    return ids


def _chat_parser(
    state: InstanceState, raw: Request, body: ChatCompletionRequest, ids: list[int]
) -> ChatOutputParser | None:
    """The answer's parser, by this instance's flags; none when the caller (a router, which
    parses by its own flags) asks for raw text (`RAW_OUTPUT_HEADER`)."""
    if raw.headers.get(RAW_OUTPUT_HEADER):
        return None
    try:
        check_tool_choice(body, state.parsing)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None
    return output_parser(body, state.parsing, prompt_tail(state.tokenizer, ids))


def _check_model(state: InstanceState, model: str | None) -> None:
    if model is not None and model not in state.served_model_names:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.served_model_names}",
            code="model_not_found",
            param="model",
        )


def _make_generation(
    state: InstanceState,
    raw: Request,
    body: OpenAIRequest,
    ids: list[int],
    max_tokens: int,
    prefix: str,
) -> Generation:
    vocab = state.engine.core.loaded.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    try:
        params = body.to_sampling_params(max_tokens)
        state.engine.core.check_request(len(ids), max_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), param="max_tokens") from None
    # The engine's id is always this instance's own: a client's X-Request-ID is only
    # echoed back (`RequestIdEcho`), so no client can name, abort or collide with another
    # request, a held one (a pull lease, a retained turn) included.
    rid = f"{prefix}-{uuid.uuid4().hex}"
    raw.state.request_id = rid  # names the request in the log of an unexpected failure
    client_id = raw.headers.get(REQUEST_ID_HEADER)
    if client_id is not None:
        logger.debug("request %s: the client's X-Request-ID is %r", rid, client_id)
    report = bool((body.kv_transfer_params or {}).get("report_answer"))
    # The conversation it names (a router's session id, in kv_transfer_params, replaces
    # this in the decode role's `prepare`): its blocks are kept by session value.
    session = body.prompt_cache_key or body.session_id or None
    request = EngineRequest(rid, ids, params, session_id=session)
    return Generation(request, body, report_answer=report)
