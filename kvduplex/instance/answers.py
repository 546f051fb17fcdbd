"""One `Generation` served (`serve_generation`): its grammar compiled, the role's
`prepare` hook run, the request submitted (and, with an ``on_admit``, admitted or
refused before any answer begins), then its answer gathered whole (aborted if the
client leaves) or streamed as SSE, in OpenAI's shape. A chat answer goes to the
instance's answer book; the answer's ids end it when the router asked for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from fastapi.responses import StreamingResponse

from kvduplex.common.limits import RequestRejected
from kvduplex.common.openai import render
from kvduplex.common.openai import structured
from kvduplex.common.openai.errors import REQUEST_ID_HEADER
from kvduplex.common.openai.errors import APIError
from kvduplex.common.openai.transcript import ANSWER_IDS_FIELD
from kvduplex.common.openai.transcript import AnswerRecord
from kvduplex.common.openai.transcript import MessageAccumulator
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.engine.commands import EngineDeadError
from kvduplex.engine.engine import RequestOutput
from kvduplex.instance.state import AdmitRefused
from kvduplex.instance.state import Generation
from kvduplex.instance.state import InstanceState

logger = logging.getLogger(__name__)


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
    state: InstanceState,
    gen: Generation,
    text: str,
    ids: list[int],
    last: RequestOutput,
    chat: bool,
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
