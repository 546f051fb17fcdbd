"""How the router serves one OpenAI request: prompt, instances, flow.

Each request is validated with the instances' own models (`app.RouterApp`) and its
prompt built into token ids with the model's own tokenizer and chat template
(`kvduplex.common.openai`), so a bad request is refused in the words an instance
would use. Prompts are built in a small pool of threads (``--prompt-threads``), off
the event loop, which keeps health probes and relayed streams moving however long a
conversation's template takes; a request of at most `INLINE_PROMPT_BYTES` is built
on the loop, where its template and tokenizer take less than the hand-off to a thread
and back would. The router never imports torch: its tokenizer is
`kvduplex.common.model_source.load_tokenizer`'s. The policy then picks P and D
(sessions, load), and one of the flows (`flows.py`) forwards the body as the client
sent it.

A chat prompt is built with the session table's answer book: an answer the router
relayed that comes back unchanged keeps the ids decode generated
(`kvduplex.common.openai.transcript`).

Failures: without a healthy decode instance a request is refused at once (503,
``no_healthy_instance``). A request whose decode instance could not be reached is
routed once more, to another healthy one (`RoutingPolicy.try_reroute`). Calls in
flight to an instance that is marked unhealthy are abandoned (`calls.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Receive
from starlette.types import Scope

from kvduplex.common.config import TransferMode
from kvduplex.common.limits import RequestRejected
from kvduplex.common.limits import check_request_size
from kvduplex.common.openai.chat_output import ChatOutputParser
from kvduplex.common.openai.chat_output import check_tool_choice
from kvduplex.common.openai.chat_output import output_parser
from kvduplex.common.openai.chat_output import prompt_tail
from kvduplex.common.openai.errors import APIError
from kvduplex.common.openai.prompt import PromptError
from kvduplex.common.openai.prompt import build_prompt_ids
from kvduplex.common.openai.prompt import placed_answers
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import OpenAIRequest
from kvduplex.router.backends import Outcome
from kvduplex.router.flows import Answer
from kvduplex.router.flows import DecodeUnreachable
from kvduplex.router.flows import Forward
from kvduplex.router.flows import serve_decode_only
from kvduplex.router.flows import serve_short_append
from kvduplex.router.plans import turn_plan
from kvduplex.router.policy import NoHealthyInstance
from kvduplex.router.pull_flow import serve_pull
from kvduplex.router.push_flow import serve_push
from kvduplex.router.relayed_response import ClientWatch
from kvduplex.router.residency import Plan
from kvduplex.router.state import RouterState

logger = logging.getLogger(__name__)

INLINE_PROMPT_BYTES = 1024
"""A request body up to this size has its prompt built on the event loop: a short
template and tokenizer run cost less than a thread's hand-off, which under load waits for
the loop to let go of the GIL (up to `sys.getswitchinterval()`). Measured in
docs/benchmarks.md ("One router stack")."""
SESSION_HEADER = "x-session-id"
_SESSION_KEY = SESSION_HEADER.encode("latin-1")
MAX_SESSION_KEY_LEN = 512


@dataclass(frozen=True)
class ClientRequest:
    """What a request to route brings besides its validated model."""

    body: dict[str, Any]
    """Its JSON body, as the client sent it (the router's to forward: the flow takes
    out what is the router's to set)."""
    num_body_bytes: int
    session_header: str | None
    """Its ``X-Session-Id``."""
    receive: Receive
    """Its `receive`, which says when the client leaves."""

    @classmethod
    def of(cls, scope: Scope, receive: Receive, body: bytes, body_json: Any) -> ClientRequest:
        session = None
        for key, value in scope["headers"]:  # as `Headers.get` reads it, without a `Headers`
            if key == _SESSION_KEY:
                session = value.decode("latin-1")
                break
        return cls(dict(body_json), len(body), session, receive)


def session_key(client: ClientRequest, request: OpenAIRequest) -> str | None:
    """The client's name for its session: X-Session-Id, else prompt_cache_key, else session_id."""
    key = client.session_header or request.prompt_cache_key or request.session_id
    if key is not None and len(key) > MAX_SESSION_KEY_LEN:
        raise APIError(
            400,
            f"X-Session-Id must be at most {MAX_SESSION_KEY_LEN} characters",
            param="x-session-id",
        )
    return key or None


async def route_request(
    state: RouterState, client: ClientRequest, request: OpenAIRequest, path: str
) -> Answer:
    """Build the prompt, choose the instances and run the configured flow."""
    ids = await build_prompt(state, request, client.num_body_bytes)
    _check_size(state, request, len(ids))
    parser = _chat_parser(state, request, ids)
    key = session_key(client, request)
    body = client.body  # validated above; forwarded as the client sent it
    body.pop("kv_transfer_params", None)  # the router's to set, never the client's
    try:
        route = state.policy.route(ids, key)
    except NoHealthyInstance as exc:
        raise unavailable(state, exc) from None
    metrics = state.metrics
    (metrics.session_hits if route.is_session_hit else metrics.session_misses).inc()
    fwd = Forward(path=path, request=request, body=body, ids=ids, route=route, parser=parser)
    if request.stream:  # its relayed response notices a client that leaves (`RelayedResponse`)
        return await _serve(state, fwd)
    return await _unless_client_leaves(_serve(state, fwd), client.receive)


async def _serve(state: RouterState, fwd: Forward) -> Answer:
    """The flow for `fwd`, and once more on another decode instance if D was unreachable."""
    route = fwd.route
    try:
        return await _run_flow(state, fwd)
    except DecodeUnreachable as exc:
        logger.warning("session %s: %s; routing the request again", route.session_id, exc)
    rerouted = state.policy.try_reroute(route)
    if rerouted is None:
        raise unavailable(state, NoHealthyInstance("decode"))
    state.metrics.rerouted.inc()
    try:
        return await _run_flow(state, replace(fwd, route=rerouted))
    except DecodeUnreachable as exc:
        raise APIError(502, str(exc), code="decode_failed") from None


async def _unless_client_leaves(call: Coroutine[Any, Any, Answer], receive: Receive) -> Answer:
    """`call`'s response, unless the client leaves first: `call` is then cancelled (its
    calls to the instances are closed, and the instances abort the request) and
    `ClientDisconnect` raised. For a whole answer, which D sends only once it has
    generated all of it."""
    watch = ClientWatch(receive)
    try:
        return await call
    except asyncio.CancelledError:
        if watch.took_cancel():
            raise ClientDisconnect() from None
        raise
    finally:
        watch.stop()


async def build_prompt(
    state: RouterState, request: OpenAIRequest, num_body_bytes: int
) -> list[int]:
    """The prompt's ids as the instances compute them (400 if there is none to build).
    The answers sent back are looked up here, on the event loop that updates the session
    table; the template and the tokenizer run in `RouterState.prompts`, or here for a
    body of at most `INLINE_PROMPT_BYTES`."""
    answers = state.policy.sessions.answers
    try:
        placements = placed_answers(request, answers, state.policy.clock())
        if num_body_bytes <= INLINE_PROMPT_BYTES:
            return build_prompt_ids(request, state.tokenizer, placements, answers.heads)
        return await asyncio.get_running_loop().run_in_executor(
            state.prompts, build_prompt_ids, request, state.tokenizer, placements, answers.heads
        )
    except PromptError as exc:
        raise APIError(400, exc.message, param=exc.param) from None


def _chat_parser(
    state: RouterState, request: OpenAIRequest, ids: list[int]
) -> ChatOutputParser | None:
    """A chat answer's parser by the router's flags (400 for a tool_choice they cannot
    serve); the router, not decode, parses routed answers (see `parsing.py`)."""
    if not isinstance(request, ChatCompletionRequest):
        return None
    try:
        check_tool_choice(request, state.config.parsing)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None
    return output_parser(request, state.config.parsing, prompt_tail(state.tokenizer, ids))


def _check_size(state: RouterState, request: OpenAIRequest, num_prompt_tokens: int) -> None:
    """400 for a request no instance can serve, before P or D sees it (as D would answer)."""
    limit = state.policy.max_model_len()
    if limit is None:  # no probe has answered yet: D checks
        return
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.requested_max_tokens()
    else:
        max_tokens = request.max_tokens
    try:
        check_request_size(limit, num_prompt_tokens, 1 if max_tokens is None else max_tokens)
    except RequestRejected as exc:
        raise APIError(400, str(exc), param="max_tokens") from None


def unavailable(state: RouterState, exc: NoHealthyInstance) -> APIError:
    """The 503 for a request no healthy instance of a role can serve (counted)."""
    state.metrics.unavailable.inc()
    return APIError(
        503, f"{exc}: every one failed its last call or health probe; retry later",
        code="no_healthy_instance",
    )  # fmt: skip


async def _run_flow(state: RouterState, fwd: Forward) -> Answer:
    """The flow for `fwd`'s route and the request; releases the route if no relay took it."""
    route, metrics = fwd.route, state.metrics
    flow: Callable[[RouterState, Forward], Awaitable[Answer]]
    if route.prefill is None:
        mode, flow = "decode", serve_decode_only
        if route.is_unpaired:
            metrics.decode_alone_unpaired.inc()
    elif state.config.mode is TransferMode.PUSH:
        plan = turn_plan(state.config, route, len(fwd.ids))
        if plan is Plan.DECODE_LOCAL:
            mode, flow = "short_append", serve_short_append
        else:  # "push" or "fetch"
            mode, flow = plan.value, functools.partial(serve_push, plan=plan)
    else:
        mode, flow = "pull", serve_pull
    metrics.note_request(mode)
    try:
        return await flow(state, fwd)
    except BaseException:  # no relay took the route over: release what it holds
        state.policy.prefill_done(route, Outcome.REFUSED)
        state.policy.decode_done(route, Outcome.REFUSED)
        raise
