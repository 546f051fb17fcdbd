"""The cluster secret on the wire: the header every internal HTTP call carries.

An instance started with a cluster secret answers its ``/internal/*`` routes
only to callers that send it (`kvduplex.common.guard.InternalGuard`); its own
internal calls to peers (handshakes, pull releases) send it with
`secret_headers`. Without a secret, nothing is sent and nothing is checked.
"""

from __future__ import annotations

import hmac

SECRET_HEADER = "X-KVDuplex-Cluster-Secret"


def secret_headers(secret: str | None) -> dict[str, str]:
    """Headers of an internal call to a peer: the secret, or none if there is none."""
    return {} if secret is None else {SECRET_HEADER: secret}


def secret_matches(given: str | bytes | None, secret: str) -> bool:
    """Whether a caller's header value is the secret (constant time)."""
    if given is None:
        return False
    if isinstance(given, str):
        given = given.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, secret.encode("utf-8"))


__all__ = ["SECRET_HEADER", "secret_headers", "secret_matches"]
