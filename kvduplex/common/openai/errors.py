"""Refusals and failures as OpenAI error JSON, the same on an instance and on the router.

Every validation failure, `APIError` and framework error (unparsable body, unknown
route) is answered with ``{"error": {"message", "type", "param", "code"}}``, and
every unexpected exception with that JSON too: a 500 whose message names the
request, never a traceback (the traceback is logged, with the request id;
`internal_error`). Error bodies are ASCII JSON (non-ASCII escaped), so a message
that quotes a client's input always encodes. An instance's FastAPI app installs
these as its handlers (`kvduplex.instance.errors`); the router answers them itself.

A client's ``X-Request-ID`` header is echoed on every response (`RequestIdEcho`
on an instance). The header is only echoed: an instance's engine request ids
are always its own (see `kvduplex.instance.openai_routes`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
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


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """The message and the first offending field of a body that failed validation, from
    its errors as pydantic lists them (their locations with or without ``body`` first)."""
    parts = []
    param = None
    for err in errors:
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


def client_request_id(scope: Scope) -> str | None:
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
    return client_request_id(scope) or "-"


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
        client_id = client_request_id(scope) if scope["type"] == "http" else None
        if client_id is None:
            await self.app(scope, receive, send)
            return

        async def send_echoing(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = client_id
            await send(message)

        await self.app(scope, receive, send_echoing)


BODY_PARSE_FAILED = "There was an error parsing the body"


def body_parse_error(exc: Exception, detail: str = BODY_PARSE_FAILED) -> str:
    """What to tell a client whose JSON body could not be parsed for `exc` (not a
    `json.JSONDecodeError`: nested too deeply, a number too long to convert)."""
    if isinstance(exc, RecursionError):  # JSON nested past the parser's reach
        return (
            f"the request body nests too deeply to parse; a request may nest at most "
            f"{MAX_NESTING_DEPTH} levels of lists and objects"
        )
    return f"{detail}: {exc}"
