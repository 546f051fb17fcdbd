"""The router's HTTP app: the OpenAI front door of a disaggregated deployment.

The app is plain ASGI (`RouterApp`): a path picks its handler from a table, and
every answer, a relayed stream's parts included, goes to the server's `send` as it
is. Around it three guards that wrap nothing of a response (`APIKeyGuard`,
`BodyCap`, `DrainGuard`). A POST to an OpenAI route is read, parsed and validated
as an instance's route does it, then served by `routing.route_request`. Its refusals
are the instances' (the same pydantic models, the same OpenAI error JSON; a
client's X-Request-ID echoed), and its ``/openapi.json`` describes its routes
(`openapi.py`).

Routes: /v1/completions, /v1/chat/completions, /v1/models (a decode
instance's), /health (liveness), /ready (readiness: a healthy decode instance, and
a healthy prefill one when any is configured; 503 ``draining`` after SIGTERM, when
new requests get 503 ``draining`` and those in flight finish), /metrics
(``kvduplex_router_*``), /sessions (the most recent sessions: turns, whether they
are returned, answer hits), /openapi.json. With an API key, the /v1 routes need it
(`kvduplex.common.auth`).

The app's lifespan runs the health prober (`health.py`) and, with DNS names, the
discovery (`discovery.py`), and closes the client to the instances at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import generate_latest
from pydantic import TypeAdapter
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.responses import Response
from starlette.types import ASGIApp
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.auth import APIKeyGuard
from kvduplex.common.auth import bearer_matches
from kvduplex.common.drain import DrainGuard
from kvduplex.common.drain import DrainingServer
from kvduplex.common.drain import exit_code
from kvduplex.common.drain import uvicorn_config
from kvduplex.common.guard import BodyCap
from kvduplex.common.model_source import load_tokenizer
from kvduplex.common.openai.errors import REQUEST_ID_HEADER
from kvduplex.common.openai.errors import APIError
from kvduplex.common.openai.errors import ErrorResponse
from kvduplex.common.openai.errors import body_parse_error
from kvduplex.common.openai.errors import client_request_id
from kvduplex.common.openai.errors import internal_error
from kvduplex.common.openai.errors import validation_message
from kvduplex.common.openai.protocol import ChatCompletionRequest
from kvduplex.common.openai.protocol import CompletionRequest
from kvduplex.common.openai.protocol import OpenAIRequest
from kvduplex.common.openai.protocol import error_body
from kvduplex.router.calls import failed_outcome
from kvduplex.router.calls import until_unhealthy
from kvduplex.router.client import CallError
from kvduplex.router.config import RouterConfig
from kvduplex.router.discovery import run_discovery
from kvduplex.router.flows import Answer
from kvduplex.router.health import run_prober
from kvduplex.router.openapi import openapi_json
from kvduplex.router.pairing import fingerprint_summary
from kvduplex.router.policy import NoHealthyInstance
from kvduplex.router.routing import ClientRequest
from kvduplex.router.routing import route_request
from kvduplex.router.routing import unavailable
from kvduplex.router.state import READ_TIMEOUT_S
from kvduplex.router.state import RouterState

logger = logging.getLogger(__name__)


def _sessions(state: RouterState, scope: Scope) -> JSONResponse:
    """GET /sessions: the ``limit`` (query; 100) most recently used sessions, most recent
    first: turns, whether their turns are returned to prefill, and their answer hits. It
    names clients' sessions: with an API key, it needs the key too."""
    if state.api_key is not None and not bearer_matches(
        [v for k, v in scope["headers"] if k == b"authorization"], state.api_key
    ):  # fmt: skip
        raise APIError(401, "GET /sessions needs the API key", code="invalid_api_key")
    limit = _query_int(scope, "limit", 100)
    recent = state.policy.sessions.sessions()[::-1][: max(0, limit)]
    return JSONResponse({
        "num_sessions": len(state.policy.sessions),
        "sessions": [
            {
                "session_id": s.session_id, "num_turns": s.num_turns,
                "is_returning": s.is_returning,
                "answer_tokens_hit": s.num_answer_tokens_hit,
                "answer_tokens_returnable": s.num_answer_tokens_returnable,
                "answer_hit_rate": s.answer_hit_rate,
            }
            for s in recent
        ],
    })  # fmt: skip


_INT = TypeAdapter(int)


def _query_int(scope: Scope, name: str, default: int) -> int:
    """The query parameter `name` as an integer (its last value), else `default`; 400 as
    the instances word a field that is not one."""
    query = scope.get("query_string", b"").decode("latin-1")
    values = [value for key, value in parse_qsl(query, keep_blank_values=True) if key == name]
    if not values:
        return default
    try:
        return _INT.validate_python(values[-1])
    except ValidationError as exc:
        errors = [{**err, "loc": ("query", name)} for err in exc.errors()]
        message, param = validation_message(errors)
        raise APIError(400, message, param=param) from None


def _start_background(state: RouterState) -> list[asyncio.Task[None]]:
    """The lifespan's tasks: the health prober and, with DNS names, the discovery."""
    config = state.config
    prober = run_prober(
        state.client, state.policy, config.health_interval_s, config.health_timeout_s,
        on_round=state.note_probe_round, admission=state.admission,
    )  # fmt: skip
    tasks = [asyncio.create_task(prober)]
    if state.discovery is not None:
        tasks.append(asyncio.create_task(run_discovery(state.discovery, config.dns_interval_s)))
    return tasks


async def _stop_background(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


Handler = Callable[[Scope, Receive], Awaitable[Answer]]


class RouterApp:
    """The router's ASGI app: its lifespan (the health prober and the DNS discovery,
    then the client's close) and its routes, each a handler by method and path. A
    handler's `APIError` is answered as OpenAI error JSON, any other exception as a 500
    that names the request (`internal_error`); a client's X-Request-ID is echoed on
    every answer. An exception once an answer's head was sent ends the connection."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.posts: dict[str, TypeAdapter[OpenAIRequest]] = {
            "/v1/completions": TypeAdapter(CompletionRequest),
            "/v1/chat/completions": TypeAdapter(ChatCompletionRequest),
        }
        self.gets: dict[str, Handler] = {
            "/health": self._health, "/ready": self._ready, "/metrics": self._metrics,
            "/sessions": self._sessions, "/v1/models": self._models,
            "/openapi.json": self._openapi,
        }  # fmt: skip

    def paths(self) -> set[str]:
        """The paths it serves."""
        return {*self.posts, *self.gets}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # a websocket: none is served
            await send({"type": "websocket.close", "code": 1000})
            return
        try:
            response = await self._answer(scope, receive)
        except APIError as exc:
            response = exc.response()
        except ClientDisconnect:  # the client left before its answer began
            return
        except Exception as exc:
            response = internal_error(scope, exc)
        rid = client_request_id(scope)
        if rid is not None:
            _set_header(response, _REQUEST_ID_KEY, rid)
        try:
            await response(scope, receive, send)
        except ClientDisconnect:
            if getattr(response, "has_started", True):
                raise
        except Exception as exc:
            if getattr(response, "has_started", True):
                raise
            fallback = internal_error(scope, exc)
            if rid is not None:
                _set_header(fallback, _REQUEST_ID_KEY, rid)
            await fallback(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive) -> Answer:
        path, method = _route_path(scope), scope["method"]
        route = self.posts.get(path)
        if route is not None:
            if method != "POST":
                raise _HTTPError(405, "Method Not Allowed", allow="POST")
            return await self._route(scope, receive, route, path)
        handler = self.gets.get(path)
        if handler is None:
            raise _HTTPError(404, "Not Found")
        if method != "GET":
            raise _HTTPError(405, "Method Not Allowed", allow="GET")
        return await handler(scope, receive)

    async def _route(
        self, scope: Scope, receive: Receive, adapter: TypeAdapter[OpenAIRequest], path: str
    ) -> Answer:
        """A POST to one of the OpenAI routes: its body read, parsed and validated as an
        instance's FastAPI route does, then routed (`route_request`)."""
        body = await _read_body(receive)
        body_json = _parse_body(scope, body)
        try:
            request = adapter.validate_python(body_json, from_attributes=True)
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(400, message, param=param) from None
        client = ClientRequest.of(scope, receive, body, body_json)
        return await route_request(self.state, client, request, path)

    async def _health(self, scope: Scope, receive: Receive) -> Answer:
        """The router is up; each instance as its probes last saw it (its fingerprint's
        digest included), and which serve the same model (`pairing.fingerprint_summary`)."""
        policy = self.state.policy
        instances = [
            {"url": b.url, "role": role, "healthy": b.is_healthy, "engine_id": b.engine_id,
             "fingerprint": b.fingerprint}
            for role, pool in (("prefill", policy.prefill), ("decode", policy.decode))
            for b in pool.backends
        ]  # fmt: skip
        return JSONResponse({
            "status": "ok", "role": "router", "instances": instances,
            "fingerprints": fingerprint_summary(policy),
        })  # fmt: skip

    async def _ready(self, scope: Scope, receive: Receive) -> Answer:
        """200 when the router can serve: a healthy decode instance and, with prefill
        instances configured, a healthy prefill one (after the first probe round); else
        503 with why."""
        state = self.state
        reason = state.unready_reason()
        if reason is None:
            return JSONResponse({"status": "ready", "role": "router"})
        status = "draining" if state.drain.is_draining else "unavailable"
        return JSONResponse({"status": status, "role": "router", "reason": reason}, 503)

    async def _metrics(self, scope: Scope, receive: Receive) -> Answer:
        return Response(generate_latest(self.state.registry), media_type=CONTENT_TYPE_LATEST)

    async def _sessions(self, scope: Scope, receive: Receive) -> Answer:
        return _sessions(self.state, scope)

    async def _models(self, scope: Scope, receive: Receive) -> Answer:
        """A healthy decode instance's /v1/models, as it answered."""
        state = self.state
        pool = state.policy.decode
        up = pool.healthy()
        if not up:
            raise unavailable(state, NoHealthyInstance("decode"))
        d = up[0]
        try:
            call = state.client.get(d.url + "/v1/models", READ_TIMEOUT_S, credentials=True)
            resp = await until_unhealthy(d, call)
        except CallError as exc:
            pool.note_failed_call(d, failed_outcome(exc), state.policy.clock())
            message = f"decode at {d.url} failed: {exc!r}"
            raise APIError(502, message, code="decode_failed") from None
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def _openapi(self, scope: Scope, receive: Receive) -> Answer:
        return Response(openapi_json(), media_type="application/json")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Start the background tasks, then, at shutdown, stop them and close the client."""
        state = self.state
        await receive()  # lifespan.startup
        tasks = _start_background(state)
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await _stop_background(tasks)
            await state.aclose()
        finally:
            state.prompts.shutdown(wait=False, cancel_futures=True)
        await send({"type": "lifespan.shutdown.complete"})


_REQUEST_ID_KEY = REQUEST_ID_HEADER.encode("latin-1")


class _HTTPError(APIError):
    """A request no route takes (404, 405), worded as the instances word it."""

    def __init__(self, status: int, message: str, allow: str | None = None) -> None:
        super().__init__(status, message)
        self.allow = allow

    def response(self) -> JSONResponse:
        headers = None if self.allow is None else {"allow": self.allow}
        return ErrorResponse(error_body(self.message), status_code=self.status, headers=headers)


def _set_header(response: Answer, name: bytes, value: str) -> None:
    """`name` set to `value` on `response`'s head, in place of any before."""
    headers = response.raw_headers
    headers[:] = [(k, v) for k, v in headers if k != name]
    headers.append((name, value.encode("latin-1")))


def _route_path(scope: Scope) -> str:
    """The request's path below the app's ``root_path``, as Starlette's routes match it."""
    path: str = scope["path"]
    root = scope.get("root_path")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


async def _read_body(receive: Receive) -> bytes:
    """The request's whole body (`ClientDisconnect` if the client left before it was all
    sent)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _parse_body(scope: Scope, body: bytes) -> Any:
    """A request's body as an instance's route takes it: JSON if its content type says so
    (``application/json`` or ``application/*+json``), else its bytes (which fail
    validation); 400 if it is empty or is not JSON."""
    if not body:
        raise APIError(400, "body: Field required", param="body")
    if not _says_json(scope):
        return body
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise APIError(400, "the request body is not valid JSON") from None
    except Exception as exc:  # nested too deeply, a number too long to convert
        raise APIError(400, body_parse_error(exc)) from None


def _says_json(scope: Scope) -> bool:
    """The request's content type is ``application/json`` or ``application/*+json``."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            kind = value.partition(b";")[0].strip().lower()
            main, _, sub = kind.partition(b"/")
            return main == b"application" and (sub == b"json" or sub.endswith(b"+json"))
    return False


def create_router_app(state: RouterState) -> ASGIApp:
    """The router's app (`RouterApp`) inside its guards: the API key, the body cap, the
    drain (outermost first)."""
    app: ASGIApp = RouterApp(state)
    app = DrainGuard(app, drain=state.drain)
    app = BodyCap(app, max_body_bytes=state.config.max_body_mb << 20)
    return APIKeyGuard(app, api_key=state.api_key)


def _dns_note(target: str, config: RouterConfig) -> str:
    """For the start log: `target`'s DNS discovery, if any."""
    if not target:
        return ""
    server = config.dns_server or "the system's DNS"
    return f" and DNS {target} (via {server}, every {config.dns_interval_s:g} s)"


GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two collections of the youngest generation (Python's default: 700)."""


def settle_heap() -> None:
    """Before serving: what the process holds for its life (modules, the tokenizer, the
    app) is collected once and frozen out of the garbage collector's scans, and the young
    generation collected less often than by default (as vLLM's engine core freezes its
    heap after start-up): a full collection stalls every stream the router relays. What
    it saves is measured in docs/benchmarks.md ("One router stack"). Not in the app: a
    test process's heap is its own."""
    gc.collect()
    gc.freeze()
    _, *older = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *older)


def serve_router(config: RouterConfig) -> int:
    """Serve until a signal, draining first (`kvduplex.common.drain`); the exit code."""
    state = RouterState.create(config, load_tokenizer(config.model))
    logger.info(
        "router (%s) on http://%s:%d: prefill %s%s, decode %s%s; sessions: ttl %.0f s, at most "
        "%d; return %s, short appends up to %d tokens; health probes every %.1f s; API key %s",
        config.mode.value, config.host, config.port,
        list(config.prefill), _dns_note(config.prefill_dns, config),
        list(config.decode), _dns_note(config.decode_dns, config),
        config.session_ttl_s, config.max_sessions, config.return_mode.value,
        config.short_append_tokens, config.health_interval_s,
        "required" if state.api_key else "not set (open)",
    )  # fmt: skip
    server_config = uvicorn_config(
        create_router_app(state), config.host, config.port, config.keep_alive_s,
        loop="uvloop", http="httptools",
    )  # fmt: skip
    server = DrainingServer(server_config, state.drain)
    settle_heap()
    server.run()
    return exit_code(server)
