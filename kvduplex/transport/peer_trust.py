"""An instance's check of a peer before it sends the peer its cluster secret.

The router names the peers an instance calls (the decode URL of a push, the
prefill URL of a pull, where a turn goes back), and those calls carry the
cluster secret (a KV handshake, a lease's release). `PeerVerifier.ensure` has the
peer prove the secret first (`kvduplex.common.challenge`, over httpx, blocking:
call it off the event loop) and remembers a proof for ``ttl_s``, so a URL is
asked again at most that often, and at once after a call to it failed to
connect (`forget`): a process that took the address since must prove itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx

from kvduplex.common.challenge import CHALLENGE_PATH
from kvduplex.common.challenge import PROOF_PATH
from kvduplex.common.challenge import Exchange
from kvduplex.common.challenge import NotAnswered
from kvduplex.common.challenge import Refused
from kvduplex.transport.protocol import PeerUnavailableError

logger = logging.getLogger(__name__)

PROOF_TTL_S = 60.0
"""How long a peer's proof is trusted before the next call that sends it the secret
asks again."""


class PeerVerifier:
    """Proofs of the cluster secret by peers, by base URL. Thread-safe; calls block."""

    def __init__(
        self,
        secret: str,
        timeout_s: float = 2.0,
        client: httpx.Client | None = None,
        ttl_s: float = PROOF_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`client`: the HTTP client of the exchange (the instance's client for its peers;
        None: a one-off client per call, for tools and tests); each POST waits at most
        `timeout_s`."""
        self._secret = secret
        self._timeout_s = timeout_s
        self._client = client
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._proved_at: dict[str, float] = {}
        self._refused: set[str] = set()
        """URLs whose refusal was logged (once each, until one proves itself)."""

    def ensure(self, url: str, timeout_s: float | None = None) -> None:
        """Return once the peer at `url` proved the secret (now, or within ``ttl_s``);
        raise `PeerUnavailableError` saying why it did not (its cause: the `Refused`,
        `NotAnswered` or httpx error). `timeout_s`: each POST's deadline, in place of
        the verifier's."""
        key = url.rstrip("/")
        with self._lock:
            proved_at = self._proved_at.get(key)
        if proved_at is not None and self._clock() - proved_at < self._ttl_s:
            return
        try:
            self._exchange(key, self._timeout_s if timeout_s is None else timeout_s)
        except Refused as exc:
            self.forget(key)
            with self._lock:
                first = key not in self._refused
                self._refused.add(key)
            if first:
                logger.warning("peer at %s did not prove the cluster secret: %s", key, exc)
            raise PeerUnavailableError(
                f"{key} did not prove the cluster secret ({exc}); nothing was sent to it: "
                "give every instance and router the same cluster secret "
                "(KVDUPLEX_CLUSTER_SECRET or --cluster-secret-file)"
            ) from exc
        except (NotAnswered, httpx.HTTPError) as exc:
            self.forget(key)
            raise PeerUnavailableError(
                f"{key} did not answer the proof of the cluster secret: {type(exc).__name__}: {exc}"
            ) from exc
        with self._lock:
            self._proved_at[key] = self._clock()
            self._refused.discard(key)

    def forget(self, url: str) -> None:
        """Ask the peer at `url` to prove itself again before the next call."""
        with self._lock:
            self._proved_at.pop(url.rstrip("/"), None)

    def drop(self, url: str) -> None:
        """Forget all about the peer at `url` (it left): its proof and its logged refusal."""
        with self._lock:
            self._proved_at.pop(url.rstrip("/"), None)
            self._refused.discard(url.rstrip("/"))

    def _exchange(self, url: str, timeout_s: float) -> None:
        ex = Exchange(self._secret, url)
        status, body = self._post(url + CHALLENGE_PATH, ex.challenge(), timeout_s)
        status, body = self._post(url + PROOF_PATH, ex.proof(status, body), timeout_s)
        ex.check(status, body)

    def _post(self, url: str, content: bytes, timeout_s: float) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"}
        if self._client is not None and self._client.is_closed:
            raise NotAnswered("not asked: this instance is stopping")
        if self._client is None:
            resp = httpx.post(url, content=content, headers=headers, timeout=timeout_s)
        else:
            resp = self._client.post(url, content=content, headers=headers, timeout=timeout_s)
        return resp.status_code, resp.content


__all__ = ["PROOF_TTL_S", "PeerVerifier"]
