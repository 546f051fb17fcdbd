"""An instance's FastAPI app answers its errors as OpenAI error JSON
(`kvduplex.common.openai.errors`)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvduplex.common.openai.errors import APIError
from kvduplex.common.openai.errors import CatchAll
from kvduplex.common.openai.errors import ErrorResponse
from kvduplex.common.openai.errors import RequestIdEcho
from kvduplex.common.openai.errors import body_parse_error
from kvduplex.common.openai.errors import internal_error
from kvduplex.common.openai.errors import validation_message
from kvduplex.common.openai.protocol import error_body


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation failures, `APIError`, framework errors and unexpected exceptions
    with OpenAI error JSON; echo X-Request-ID (middlewares added later wrap these two)."""
    app.add_middleware(CatchAll)
    app.add_middleware(RequestIdEcho)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return ErrorResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """FastAPI's own errors (a body it cannot parse, e.g. nested too deeply or with
        a number too long to convert; unknown route; wrong method) as OpenAI JSON."""
        message = str(exc.detail)
        cause = exc.__cause__
        if isinstance(cause, Exception):
            message = body_parse_error(cause, message)
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return ErrorResponse(
            error_body(message, err_type), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        """What escapes the middlewares outside `CatchAll` (Starlette re-raises it after
        this answer, for the server's log)."""
        return internal_error(request.scope, exc)
