"""The OpenAI routes of an instance (/v1/models, /v1/completions,
/v1/chat/completions) and the checks that turn a request's body into a `Generation`:
the model served, the cluster secret for ``kv_transfer_params``, the prompt's ids (a
router's own, or built here), the engine's limits, the instance's own request id, the
chat answer's parser. `answers.serve_generation` serves it.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi import Request
from fastapi.responses import Response

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
from kvduplex.engine.request import Request as EngineRequest
from kvduplex.instance.answers import serve_generation
from kvduplex.instance.state import Generation
from kvduplex.instance.state import InstanceState

logger = logging.getLogger(__name__)


def add_openai_routes(app: FastAPI, state: InstanceState) -> None:
    """/v1/models, /v1/completions and /v1/chat/completions."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "kvduplex",
                    "max_model_len": state.max_model_len,
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
