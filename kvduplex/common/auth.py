"""The API key of the OpenAI routes, on the router and on an instance.

With a key configured (``--api-key``, else ``KVDUPLEX_API_KEY``), every
``/v1/*`` request must carry ``Authorization: Bearer <key>``, as with vLLM's
``--api-key``; anything else gets 401 in the OpenAI error format (code
``invalid_api_key``). The key is compared in constant time. ``/health`` and
``/metrics`` stay open for probes and scrapers; ``/internal/*`` routes are the
cluster secret's (`kvduplex.common.guard`)::

    request ── path /v1 or /v1/...? ── no ──────────────────► app
                    │ yes
                    ▼
          key set and not one "Bearer <key>" header ──► 401
          else ──────────────────────────────────────────────► app

Pure ASGI, like `InternalGuard`: streams and disconnects pass untouched.
"""

from __future__ import annotations

import hmac
import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.openai.protocol import error_body

logger = logging.getLogger(__name__)

PUBLIC_PREFIX = "/v1"


def resolve_api_key(flag: str, from_env: str | None) -> str | None:
    """The API key: the flag's value if given, else the environment's, else None (open)."""
    return flag or from_env or None


def api_key_headers(api_key: str | None) -> dict[str, str]:
    """Headers that present `api_key` to a server that requires it (none without a key)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def is_public_path(path: str) -> bool:
    return path == PUBLIC_PREFIX or path.startswith(PUBLIC_PREFIX + "/")


def bearer_matches(values: list[bytes], api_key: str) -> bool:
    """Whether the request's Authorization headers are exactly one ``Bearer <api_key>``
    (the scheme in any case; the key compared in constant time)."""
    if len(values) != 1:
        return False
    scheme, _, given = values[0].partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(given.strip(), api_key.encode("utf-8"))


class APIKeyGuard:
    """ASGI middleware: the API key on the OpenAI routes (see the module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is None or scope["type"] != "http" or not is_public_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        values = [value for key, value in scope["headers"] if key == b"authorization"]
        if bearer_matches(values, self.api_key):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        logger.info(
            "%s %s from %s refused: %s", scope["method"], scope["path"],
            client[0] if client else "?", "no API key" if not values else "wrong API key",
        )  # fmt: skip
        message = (
            "this server needs an API key: send the header Authorization: Bearer YOUR_KEY"
            if not values
            else "incorrect API key provided"
        )
        body = error_body(message, "invalid_request_error", code="invalid_api_key")
        headers = {"WWW-Authenticate": "Bearer"}
        await JSONResponse(body, status_code=401, headers=headers)(scope, receive, send)


__all__ = ["APIKeyGuard", "api_key_headers", "bearer_matches", "resolve_api_key"]
