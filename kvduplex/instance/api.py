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

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from fastapi import FastAPI
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest

from kvduplex.common.limits import RequestRejected
from kvduplex.common.openai import render
from kvduplex.common.openai import structured
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
from kvduplex.common.openai.transcript import ANSWER_IDS_FIELD
from kvduplex.common.openai.transcript import AnswerRecord
from kvduplex.common.openai.transcript import MessageAccumulator
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.engine.commands import EngineDeadError
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.report import pool_report
from kvduplex.engine.request import Request as EngineRequest
from kvduplex.instance.errors import install_error_handlers
from kvduplex.instance.health import add_health
from kvduplex.instance.state import AdmitRefused
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


async def serve_generation(
    state: InstanceState, raw: Request, gen: Generation, chat: bool
) -> Response:
    spec = structured.grammar_spec_of(gen.body)
    if spec is not None:
        gen.tool_calls = structured.forced_tool_calls(gen.body)
        param = "response_format" if gen.tool_calls is None else "tools"
        gen.request.grammar = await state.grammar(spec, gen.request.request_id, param)
    if state.prepare is not None:
        await state.prepare(raw, gen)
    if gen.on_admit is None:
        outputs = state.engine.generate(gen.request)
    else:
        outputs = await _admitted(state, gen)
    if gen.body.stream:
        include_usage = bool(gen.body.stream_options and gen.body.stream_options.include_usage)
        return StreamingResponse(
            _sse(state, gen, outputs, chat, include_usage), media_type="text/event-stream",
            headers=_id_header(gen),
        )  # fmt: skip
    return await _collect(state, raw, gen, outputs, chat)


async def _admitted(state: InstanceState, gen: Generation) -> AsyncIterator[RequestOutput]:
    """Submit a request with an ``on_admit`` and wait until the engine thread ran it:
    its outputs, or APIError (before any answer begins) for an AdmitRefused."""
    assert gen.on_admit is not None
    hook = gen.on_admit
    loop = asyncio.get_running_loop()
    admitted: asyncio.Future[None] = loop.create_future()

    def set_admitted() -> None:
        if not admitted.done():
            admitted.set_result(None)

    def on_admit() -> None:  # engine thread
        hook()
        loop.call_soon_threadsafe(set_admitted)

    outputs = state.engine.generate(gen.request, on_admit=on_admit)
    first: asyncio.Future[RequestOutput] = asyncio.ensure_future(outputs.__anext__())
    waits: set[asyncio.Future[Any]] = {first, admitted}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        first.cancel()
        admitted.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await outputs.aclose()  # type: ignore[attr-defined]
        raise
    admitted.cancel()
    if first.done() and isinstance(first.exception(), AdmitRefused):
        refused = first.exception()
        assert isinstance(refused, AdmitRefused)
        raise APIError(refused.status, str(refused), param=refused.param) from None
    return _chained(first, outputs)


async def _chained(
    first: asyncio.Future[RequestOutput], rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    try:
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for out in rest:
            yield out
    finally:
        if not first.done():
            first.cancel()
        await rest.aclose()  # type: ignore[attr-defined]


def _id_header(gen: Generation) -> dict[str, str]:
    """The request's own id (a client's X-Request-ID replaces it: `RequestIdEcho`)."""
    return {REQUEST_ID_HEADER: gen.request.request_id}


async def _collect(
    state: InstanceState,
    raw: Request,
    gen: Generation,
    outputs: AsyncIterator[RequestOutput],
    chat: bool,
) -> Response:
    """Gather a whole answer; abort if the client disconnects first."""

    async def gather() -> tuple[str, list[int], RequestOutput | None]:
        text, ids, last = [], [], None
        async for out in outputs:
            text.append(out.new_text)
            ids.extend(out.new_token_ids)
            gen.logprobs.extend(out.new_logprobs or ())
            last = out
        return "".join(text), ids, last

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    gather_task = asyncio.ensure_future(gather())
    watch_task = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({gather_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if gather_task not in done:
        gather_task.cancel()
        await asyncio.gather(gather_task, return_exceptions=True)
        await outputs.aclose()  # type: ignore[attr-defined]
        logger.info("request %s aborted: client disconnected", gen.request.request_id)
        return Response(status_code=499)
    try:
        text, ids, last = gather_task.result()
    except RequestRejected as exc:
        raise APIError(400, str(exc)) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    assert last is not None
    body = _final_body(state, gen, text, ids, last, chat)
    if chat and last.finish_reason != "abort":
        _record_answer(state, ids, body["choices"][0]["message"])
    if gen.report_answer:
        body[ANSWER_IDS_FIELD] = ids
    return JSONResponse(body, headers=_id_header(gen))


def _record_answer(state: InstanceState, ids: list[int], message: dict[str, Any]) -> None:
    """Remember a chat answer as returned, for prompts that send it back."""
    state.answers.add(AnswerRecord(tuple(ids), message), time.monotonic())


def _head(state: InstanceState, gen: Generation, chat: bool) -> render.ResponseHead:
    return render.ResponseHead(
        request_id=gen.request.request_id, model=gen.body.model or state.served_model_names[0],
        is_chat=chat, return_token_ids=gen.body.return_token_ids,
    )  # fmt: skip


def _usage(last: RequestOutput) -> dict[str, Any]:
    out = render.usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    # Not OpenAI's: where the prompt was computed, and the KV that moved for it.
    out["kv"] = {
        "prefill_computed_tokens": last.num_prompt_computed_remotely,
        "decode_computed_tokens": last.num_prompt_computed_here,
        "bytes_to_decode": last.num_remote_kv_bytes,
    }
    return out


def _logprobs(
    state: InstanceState,
    gen: Generation,
    entries: list[TokenLogprobs | None],
    chat: bool,
    text_offset: int,
) -> dict[str, Any] | None:
    """``choice.logprobs`` for `entries` in the endpoint's shape; None unless asked for."""
    if gen.request.sampling_params.logprobs is None:
        return None
    if chat:
        return render.chat_logprobs(state.tokenizer, entries)
    return render.completion_logprobs(state.tokenizer, entries, text_offset)


def _final_body(
    state: InstanceState, gen: Generation, text: str, ids: list[int], last: RequestOutput, chat: bool
) -> dict[str, Any]:
    reason, message = last.finish_reason, None
    if gen.parser is not None:
        parsed = gen.parser.parse(text, reason)
        reason, message = parsed.finish_reason, parsed.to_json()
    body = render.completion_body(
        _head(state, gen, chat), text, ids, reason, _usage(last),
        gen.request.prompt_token_ids, message, _logprobs(state, gen, gen.logprobs, chat, 0),
    )  # fmt: skip
    if gen.tool_calls is not None:
        choice = body["choices"][0]
        choice["message"], choice["finish_reason"] = structured.tool_call_message(
            gen.tool_calls, text, last.finish_reason
        )
    body.update(gen.extra)
    return body


async def _sse(
    state: InstanceState,
    gen: Generation,
    outputs: AsyncIterator[RequestOutput],
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    head = _head(state, gen, chat)
    first = True
    to_mark = gen.mark_first_token
    last: RequestOutput | None = None
    text_offset = 0  # of the text sent so far (completions' logprobs count from it)
    ids: list[int] = []
    message = MessageAccumulator()  # the chat answer as returned, for the answer book
    calls = structured.ToolCallStream(gen.tool_calls) if gen.tool_calls is not None else None
    try:
        async for out in outputs:
            last = out
            ids.extend(out.new_token_ids)
            logprobs = _logprobs(state, gen, out.new_logprobs or [], chat, text_offset)
            if logprobs is not None and not chat:
                text_offset += sum(len(t) for t in logprobs["tokens"])
            if calls is not None:
                deltas = calls.push(out.new_text)
                reason = structured.finish_reason_of(calls.forced, out.finish_reason, calls)
                choice = structured.stream_choice(deltas, reason, first)
                choice["logprobs"] = logprobs
                if head.return_token_ids:
                    choice["token_ids"] = out.new_token_ids
            else:
                reason, delta = out.finish_reason, None
                if gen.parser is not None:
                    parsed, reason = gen.parser.step(out.new_text, reason, out.finished)
                    has_ids = head.return_token_ids or (to_mark and bool(out.new_token_ids))
                    if parsed.is_empty() and reason is None and not has_ids and logprobs is None:
                        continue  # all held back (e.g. a tag not complete yet)
                    delta = parsed.to_json()
                choice = render.stream_choice(
                    head, out.new_text, out.new_token_ids, reason, is_first=first, delta=delta,
                    logprobs=logprobs,
                )  # fmt: skip
            message.add_delta(choice.get("delta") or {})  # completions: none
            chunk = render.stream_chunk(head, choice)
            if to_mark and out.new_token_ids:
                chunk[render.FIRST_TOKEN_IDS_FIELD] = list(out.new_token_ids)
                to_mark = False
            yield render.sse_data(chunk)
            first = False
    except (RequestRejected, EngineDeadError) as exc:
        yield render.sse_error(str(exc))
        return
    if include_usage and last is not None:
        yield render.sse_data(render.stream_chunk(head, None, _usage(last)))
    yield _stream_answer_end(state, gen, chat, last, ids, message)
    yield render.SSE_DONE


def _stream_answer_end(
    state: InstanceState, gen: Generation, chat: bool, last: RequestOutput | None,
    ids: list[int], message: MessageAccumulator,
) -> str:  # fmt: skip
    """A finished stream's chat answer goes to the answer book; the event that reports its
    ids when the router asked (`ANSWER_IDS_FIELD`), else ""."""
    if chat and last is not None and last.finish_reason != "abort":
        _record_answer(state, ids, message.message())
    return render.sse_data({ANSWER_IDS_FIELD: ids}) if gen.report_answer else ""
