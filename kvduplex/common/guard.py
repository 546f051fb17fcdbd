"""Two ASGI middlewares at an HTTP server's door: body caps and the trust boundary.

`BodyCap` answers a request whose body passes a cap with 413 (OpenAI error
JSON) before the app parses it: announced (Content-Length) bodies before a
byte is read, chunked ones as soon as the cap is passed. The router wraps its
whole app in one; an instance caps its public routes through `InternalGuard`.

Every ``/internal/*`` route of an instance (KV handshake, push and pull
prefill, cancels, releases, retained turns, stats) moves or describes KV
memory: a handshake's metadata lets its holder WRITE anywhere in the pool over
NIXL, and a push or a return puts KV into a prefix cache that later requests
read. With a cluster secret configured, `InternalGuard` answers these routes
only to callers that send it (header ``X-KVDuplex-Cluster-Secret``, compared
in constant time); everyone else gets 401 in the OpenAI error format. The two
routes of the proof of the secret (`kvduplex.common.challenge.AUTH_PATHS`) are
the exception: a caller proves the secret there without sending it, before
anyone sends it the secret. Bodies of internal routes have their own cap,
whether or not a secret is set::

    request ── path /internal/...? ── no ── body > public cap ──► 413
                    │ yes                    else ─────────────────► app
                    ▼
          secret set, header != secret
          and not a proof route ────────────► 401
          body > internal cap ──────────────► 413
          else ── body replayed ──────────────────────────────────► app

Both are pure ASGI (no buffering of responses), and a body is replayed to the
app followed by the client's own messages, so the OpenAI routes' disconnect
detection is unchanged.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp
from starlette.types import Message
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from kvduplex.common.challenge import AUTH_PATHS
from kvduplex.common.openai.protocol import error_body
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.common.trust import secret_matches

logger = logging.getLogger(__name__)

INTERNAL_PREFIX = "/internal/"
MIN_SECRET_CHARS = 16
_HEADER_KEY = SECRET_HEADER.lower().encode("latin-1")


def new_cluster_secret() -> str:
    """A random secret for a cluster (`kvduplex up`)."""
    return secrets.token_hex(32)


def load_cluster_secret(path: str, from_env: str | None) -> str | None:
    """The cluster secret: the file at `path` if given, else `from_env`, else None.

    Raises ValueError saying what to fix (unreadable or empty file, too short, or
    characters that cannot travel in an HTTP header: anything but printable ASCII).
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
    if not (secret.isascii() and secret.isprintable()):
        raise ValueError(
            f"the cluster secret from {where} has characters other than printable ASCII, "
            "which an HTTP header cannot carry; use letters, digits and punctuation only "
            "(e.g. the output of `openssl rand -hex 32`)"
        )
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the cluster secret from {where} has {len(secret)} characters; use at least "
            f"{MIN_SECRET_CHARS} (e.g. the output of `openssl rand -hex 32`)"
        )
    return secret


def _reject(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, code=code), status_code=status)


class BodyCap:
    """ASGI middleware: an HTTP request body over `max_body_bytes` is answered 413.

    `what` names the request in the error message ("a request", "an internal
    request"). The body is read here (at most the cap plus one chunk) and
    replayed to the app.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, what: str = "a request") -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.what = what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        announced_too_large = (
            length is not None and length.isdigit() and int(length) > self.max_body_bytes
        )
        body = None if announced_too_large else await self._read_body(receive)
        if body is None:  # refused before reading a byte of it, or once past the cap
            await self._too_large()(scope, receive, send)
            return
        await self.app(scope, replay_body(body, receive), send)

    def _too_large(self) -> JSONResponse:
        cap = self.max_body_bytes
        size = f"{cap >> 20} MiB" if cap % (1 << 20) == 0 else f"{cap} bytes"
        return _reject(
            413, f"the body of {self.what} is limited to {size} ({cap} bytes)", "request_too_large"
        )

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


class InternalGuard:
    """ASGI middleware: the cluster secret and a body cap on ``/internal/*``; a body cap
    of its own (`public_max_body_bytes`, None for none) on every other route."""

    def __init__(
        self,
        app: ASGIApp,
        secret: str | None,
        max_body_bytes: int,
        public_max_body_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.secret = secret
        self.internal = BodyCap(app, max_body_bytes, "an internal request")
        self.public: ASGIApp = (
            app if public_max_body_bytes is None else BodyCap(app, public_max_body_bytes)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope["path"]).startswith(INTERNAL_PREFIX):
            await self.public(scope, receive, send)
            return
        rejection = self._check_secret(scope)
        if rejection is not None:
            await rejection(scope, receive, send)
            return
        await self.internal(scope, receive, send)

    def _check_secret(self, scope: Scope) -> JSONResponse | None:
        if self.secret is None or scope["path"] in AUTH_PATHS:
            return None
        given = [value for key, value in scope["headers"] if key == _HEADER_KEY]
        if len(given) == 1 and secret_matches(given[0], self.secret):
            return None
        client = scope.get("client")
        logger.warning(
            "%s %s from %s refused: %s", scope["method"], scope["path"],
            client[0] if client else "?", "no cluster secret" if not given else "wrong cluster secret",
        )  # fmt: skip
        return _reject(
            401, f"internal routes need the cluster secret in the {SECRET_HEADER} header",
            "invalid_cluster_secret",
        )  # fmt: skip


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields `body` once, then the client's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


__all__ = [
    "INTERNAL_PREFIX",
    "BodyCap",
    "InternalGuard",
    "load_cluster_secret",
    "new_cluster_secret",
    "replay_body",
]
