"""Refusals as OpenAI error JSON, the same on an instance and on the router.

`install_error_handlers` makes a FastAPI app answer every validation failure,
`APIError` and framework error (unparsable body, unknown route) with
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvduplex.openai.protocol import error_body


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
        return JSONResponse(
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
        parts.append(f"{where}: {msg}")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation failures, `APIError` and framework errors with OpenAI error JSON."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """FastAPI's own errors (a body it cannot parse, e.g. nested too deeply or with
        a number too long to convert; unknown route; wrong method) as OpenAI JSON."""
        message = str(exc.detail)
        if exc.__cause__ is not None:
            message = f"{message}: {exc.__cause__}"
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(message, err_type), status_code=exc.status_code, headers=exc.headers
        )
