"""The trust boundary of an instance's internal routes.

Every ``/internal/*`` route (KV handshake, push and pull prefill, cancels,
releases, retained turns, stats) moves or describes KV memory: a handshake's
metadata lets its holder WRITE anywhere in the pool over NIXL, and a push or
a return puts KV into a prefix cache that later requests read. With a
cluster secret configured, `InternalGuard` answers these routes only to
callers that send it (header ``X-KVDuplex-Cluster-Secret``, compared in
constant time); everyone else gets 401 in the OpenAI error format. Bodies of
internal routes are capped (413 past the cap) whether or not a secret is set::

    request ── path /internal/...? ── no ──────────────────────────► app
                    │ yes
                    ▼
          secret set and header != secret ──► 401
          body > max_body_bytes ────────────► 413
          else ── body replayed ──────────────────────────────────► app

The middleware is pure ASGI (no buffering of other routes' streams), so the
OpenAI routes' disconnect detection is unchanged.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvduplex.openai.protocol import error_body
from kvduplex.transport.trust import SECRET_HEADER, secret_matches

logger = logging.getLogger(__name__)

INTERNAL_PREFIX = "/internal/"
MIN_SECRET_CHARS = 16
_HEADER_KEY = SECRET_HEADER.lower().encode("latin-1")


def new_cluster_secret() -> str:
    """A random secret for a cluster (`kvduplex up`)."""
    return secrets.token_hex(32)


def load_cluster_secret(path: str, from_env: str | None) -> str | None:
    """The cluster secret: the file at `path` if given, else `from_env`, else None.

    Raises ValueError saying what to fix (unreadable or empty file, too short).
    """
    secret = from_env
    where = "KVDUPLEX_CLUSTER_SECRET"
    if path:
        where = f"--cluster-secret-file {path}"
        try:
            secret = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the cluster secret from {path}: {exc}") from None
    if secret is None:
        return None
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the cluster secret from {where} has {len(secret)} characters; use at least "
            f"{MIN_SECRET_CHARS} (e.g. the output of `openssl rand -hex 32`)"
        )
    return secret


def _reject(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, code=code), status_code=status)


class InternalGuard:
    """ASGI middleware: the cluster secret and a body cap on ``/internal/*``."""

    def __init__(self, app: ASGIApp, secret: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.secret = secret
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope["path"]).startswith(INTERNAL_PREFIX):
            await self.app(scope, receive, send)
            return
        rejection = self._check_headers(scope)
        body = None if rejection is not None else await self._read_body(receive)
        if body is None:
            await (rejection or self._too_large())(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> JSONResponse:
        return _reject(
            413, f"the body of an internal request is limited to {self.max_body_bytes} bytes",
            "request_too_large",
        )  # fmt: skip

    def _check_headers(self, scope: Scope) -> JSONResponse | None:
        given: list[bytes] = []
        length: bytes | None = None
        for key, value in scope["headers"]:
            if key == _HEADER_KEY:
                given.append(value)
            elif key == b"content-length":
                length = value
        if self.secret is not None and (
            len(given) != 1 or not secret_matches(given[0], self.secret)
        ):
            client = scope.get("client")
            logger.warning(
                "%s %s from %s refused: %s", scope["method"], scope["path"],
                client[0] if client else "?", "no cluster secret" if not given else "wrong cluster secret",
            )  # fmt: skip
            return _reject(
                401, f"internal routes need the cluster secret in the {SECRET_HEADER} header",
                "invalid_cluster_secret",
            )  # fmt: skip
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()  # refused before reading a byte of it
        return None

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the cap (chunked bodies too)."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)  # disconnected: the app sees an empty body, then leaves
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields `body` once, then the client's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


__all__ = ["INTERNAL_PREFIX", "InternalGuard", "load_cluster_secret", "new_cluster_secret"]
