"""Refusals and failures as OpenAI error JSON, the same on an instance and on the router.

`install_error_handlers` makes a FastAPI app answer every validation failure,
`APIError` and framework error (unparsable body, unknown route) with
``{"error": {"message", "type", "param", "code"}}``, and every unexpected
exception with that JSON too: a 500 whose message names the request, never a
traceback (the traceback is logged, with the request id). Error bodies are
ASCII JSON (non-ASCII escaped), so a message that quotes a client's input
always encodes.

It also echoes a client's ``X-Request-ID`` header on every response
(`RequestIdEcho`). The header is only echoed: an instance's engine request ids
are always its own (see `kvduplex.instance.api`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp
from starlette.types import Message
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.openai.protocol import MAX_NESTING_DEPTH
from kvduplex.common.openai.protocol import error_body

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
"""The client's name for a request: echoed on the response, never used as an id here."""


class ErrorResponse(JSONResponse):
    """An OpenAI error body as ASCII JSON (lone surrogates and all non-ASCII escaped)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error to send to the client as OpenAI error JSON."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def response(self) -> JSONResponse:
        err_type = "invalid_request_error" if self.status < 500 else "server_error"
        return ErrorResponse(
            error_body(self.message, err_type, self.param, self.code), status_code=self.status
        )


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and the first offending field of a body that failed validation."""
    parts = []
    param = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        where = ".".join(loc) or "body"
        param = param or where
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field; this server does not support it (refused, not ignored)"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts) or "invalid request", param


_REQUEST_ID_KEY = REQUEST_ID_HEADER.encode("latin-1")


def _client_request_id(scope: Scope) -> str | None:
    """The request's ``X-Request-ID``, as `Headers.get` reads it (the first; ASGI header
    names are lowercase), without making a `Headers` for every request."""
    for key, value in scope["headers"]:
        if key == _REQUEST_ID_KEY:
            value_text: str = value.decode("latin-1")
            return value_text
    return None


def request_id_of(scope: Scope) -> str:
    """How a log line names a request: the instance's own id once it has one (set as
    ``request.state.request_id`` by the route), else the client's X-Request-ID, else "-"."""
    own = (scope.get("state") or {}).get("request_id")
    if own:
        return str(own)
    return _client_request_id(scope) or "-"


def internal_error(scope: Scope, exc: BaseException) -> JSONResponse:
    """Log `exc` (traceback included) with the request's id; the client's 500 names the
    request and nothing of the failure's inside."""
    rid = request_id_of(scope)
    logger.error(
        "request %s (%s %s) failed: %s", rid, scope.get("method"), scope.get("path"),
        type(exc).__name__, exc_info=exc,
    )  # fmt: skip
    message = f"the server failed to handle request {rid}; the error is logged there"
    return ErrorResponse(
        error_body(message, "server_error", code="internal_error"), status_code=500
    )


class CatchAll:
    """Pure ASGI: an exception that escapes the routes becomes a 500 in OpenAI error JSON
    (see `internal_error`) instead of Starlette's plain-text one. An exception after the
    response began is re-raised: the server ends the connection, as before. A client
    that left before its answer began (`ClientDisconnect`) gets none, and no error is
    logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})  # shared with the route's `request.state`
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except ClientDisconnect:
            if started:
                raise
        except Exception as exc:
            if started:
                raise
            await internal_error(scope, exc)(scope, receive, send)


class RequestIdEcho:
    """Pure ASGI: a response to a request with an ``X-Request-ID`` header carries that
    header back, whatever the route set."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_id = _client_request_id(scope) if scope["type"] == "http" else None
        if client_id is None:
            await self.app(scope, receive, send)
            return

        async def send_echoing(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = client_id
            await send(message)

        await self.app(scope, receive, send_echoing)


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation failures, `APIError`, framework errors and unexpected exceptions
    with OpenAI error JSON; echo X-Request-ID (middlewares added later wrap these two)."""
    app.add_middleware(CatchAll)
    app.add_middleware(RequestIdEcho)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return ErrorResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """FastAPI's own errors (a body it cannot parse, e.g. nested too deeply or with
        a number too long to convert; unknown route; wrong method) as OpenAI JSON."""
        message = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # JSON nested past the parser's reach
            message = (
                f"the request body nests too deeply to parse; a request may nest at most "
                f"{MAX_NESTING_DEPTH} levels of lists and objects"
            )
        elif exc.__cause__ is not None:
            message = f"{message}: {exc.__cause__}"
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return ErrorResponse(
            error_body(message, err_type), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        """What escapes the middlewares outside `CatchAll` (Starlette re-raises it after
        this answer, for the server's log)."""
        return internal_error(request.scope, exc)
