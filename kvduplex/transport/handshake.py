"""Handshake over HTTP and the per-URL peer cache.

Each instance serves ``GET /internal/kv/handshake`` (the router built by
`make_handshake_router`, mounted by the instance server). A peer fetches it
with `fetch_handshake` and passes it to `Transport.connect`. The answer lets
its holder read and write the whole KV pool, so an instance with a cluster
secret serves it only to callers that send the secret (`kvduplex.common.guard`);
`fetch_handshake` and `PeerDirectory` send it when given one, the directory only
to a peer that proved it holds the secret too (`peer_trust.PeerVerifier`).

`PeerDirectory` caches one `PeerHandle` per base URL. A restarted instance has
a new engine id at the same URL; the directory notices when told (a message or
HTTP answer naming another engine id: ``get_peer(url, engine_id=...)``), when
asked to `PeerDirectory.refresh` after a failure, or, with ``recheck_s`` set,
when a cached peer is used more than ``recheck_s`` after its engine id was
last checked; it then disconnects the old peer (its transfers in flight fail:
nothing meant for the old engine reaches the new one) and connects the new one::

    get_peer(url) ─ cached, same engine id, checked < recheck_s ago ──► PeerHandle
                       │ no / engine id differs / check due
                       ▼
              fetch_handshake(url) ─ same engine id ─────────────────► PeerHandle
                       │ another one              (a due check with no answer
                       ▼                           keeps the cached peer)
              disconnect(old) ─► connect(new) ───────────────────────► PeerHandle

Peers that leave are forgotten (`PeerDirectory.sweep`, run by the instance's
notification pump): one whose address refused the handshake, one a transfer or
notification to which failed, one unused for ``idle_s``, each once no transfer
with it is unsettled (`kvduplex.transport.peer_usage`), and one a flow already
tore down. Forgetting disconnects it (its agent removed, its prepared descriptor
list released) and drops its entry; a peer that comes back is handshaken afresh.
The engine ids of the last `REMEMBERED` forgotten peers keep their URL, so that a
flow may still reconnect to one by engine id (`reconnect`) and ask whether it is
gone (`is_gone`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import httpx
import msgspec
from fastapi import APIRouter
from fastapi import Response

from kvduplex.common.challenge import Refused
from kvduplex.common.trust import secret_headers
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import HandshakeInfo
from kvduplex.transport.messages import decode_handshake
from kvduplex.transport.messages import encode_handshake
from kvduplex.transport.peer_trust import PeerVerifier
from kvduplex.transport.peer_usage import ForgetReason
from kvduplex.transport.peer_usage import remember_last
from kvduplex.transport.peer_usage import why_forget
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import PeerUnavailableError

logger = logging.getLogger(__name__)

HANDSHAKE_PATH = "/internal/kv/handshake"
REMEMBERED = 1024
"""Forgotten and replaced engine ids whose URL the directory keeps (the latest ones)."""


class HandshakeRefused(PeerUnavailableError):
    """The address answered the handshake with a refusal (HTTP 401: no member)."""


def make_handshake_router(transport: Transport) -> APIRouter:
    """An APIRouter serving ``GET /internal/kv/handshake`` with ``transport``'s metadata."""
    router = APIRouter()
    body = encode_handshake(transport.local_metadata())

    @router.get(HANDSHAKE_PATH)
    def handshake() -> Response:
        return Response(content=body, media_type="application/json")

    return router


def fetch_handshake(
    base_url: str,
    timeout: float = 2.0,
    client: httpx.Client | None = None,
    secret: str | None = None,
) -> HandshakeInfo:
    """GET a peer's handshake (sending the cluster ``secret``, if any) within ``timeout``
    seconds; raises PeerUnavailableError saying why it failed.

    ``client``: the instance's HTTP client for its peers (None: a one-off client, for
    tools and tests; building one costs tens of milliseconds of CPU and memory the
    process keeps).
    """
    url = base_url.rstrip("/") + HANDSHAKE_PATH
    headers = secret_headers(secret)
    if client is not None and client.is_closed:
        raise PeerUnavailableError(f"handshake with {base_url} not tried: this instance is stopping")
    try:
        if client is None:
            resp = httpx.get(url, timeout=timeout, headers=headers)
        else:
            resp = client.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise PeerUnavailableError(
            f"handshake with {base_url} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if resp.status_code == 401:
        raise HandshakeRefused(
            f"handshake with {base_url} refused (HTTP 401): give both instances the same "
            "cluster secret (KVDUPLEX_CLUSTER_SECRET or --cluster-secret-file)"
        )
    if resp.status_code != 200:
        raise PeerUnavailableError(
            f"handshake with {base_url} failed: HTTP {resp.status_code} from {url}; "
            "is it a kvduplex instance with KV transfer enabled?"
        )
    try:
        return decode_handshake(resp.content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerUnavailableError(f"handshake with {base_url}: malformed answer: {exc}") from exc


class PeerDirectory:
    """Connections by peer base URL, re-handshaking when the engine at a URL changed.

    Thread-safe; calls block on HTTP (run them off the event loop). The peers
    are the engines this instance handshook with itself (sending ``secret``, once
    the peer proved it: `PeerVerifier.ensure`): flows accept control messages that
    need trust (a return offer) only from them (`peer_by_engine`).
    """

    def __init__(
        self,
        transport: Transport,
        timeout_s: float = 2.0,
        client: httpx.Client | None = None,
        secret: str | None = None,
        recheck_s: float | None = None,
        recheck_timeout_s: float = 0.5,
        verifier: PeerVerifier | None = None,
        idle_s: float | None = None,
        sweep_interval_s: float = 1.0,
    ) -> None:
        """``recheck_s``: how long a cached peer is used without checking the engine id
        at its URL again (None: until told otherwise); ``recheck_timeout_s``: how long
        such a check waits for an answer before keeping the cached peer. ``verifier``:
        the proofs of peers (None with a ``secret``: one of the directory's own).
        ``idle_s``: how long a peer with nothing in flight stays unused before `sweep`
        forgets it (None: never for idleness); ``sweep_interval_s``: how often `tick`
        sweeps at most."""
        self.transport = transport
        self.timeout_s = timeout_s
        self.recheck_s = recheck_s
        self.recheck_timeout_s = recheck_timeout_s
        self._client = client
        self._secret = secret
        if verifier is None and secret is not None:
            verifier = PeerVerifier(secret, timeout_s, client)
        self._verifier = verifier
        self._lock = threading.Lock()
        self._peers: dict[str, PeerHandle] = {}
        self._checked_at: dict[str, float] = {}  # url -> when its engine id was last seen
        self.idle_s = idle_s
        self.sweep_interval_s = sweep_interval_s
        self._swept_at = 0.0
        self._replaced: OrderedDict[str, None] = OrderedDict()
        """Engine ids another engine took the URL of: their processes no longer listen
        there, so they are gone (`is_gone`); the latest `REMEMBERED` (a receiver asks
        about a replaced sender only while its quarantine lasts)."""
        self._refused: set[str] = set()
        """URLs of cached peers whose handshake was refused since: `sweep` forgets them."""
        self._forgotten: OrderedDict[str, str] = OrderedDict()
        """Engine id -> URL of the latest `REMEMBERED` forgotten peers (`url_of`)."""
        self.num_forgotten = 0
        self._met: OrderedDict[str, None] = OrderedDict()
        """Engine ids of the latest `REMEMBERED` peers connected: one connected again (a
        forgotten peer met again, a flow's reconnect) is no new peer."""
        self.num_met = 0
        """Distinct peers connected to (``kvduplex_kv_peers_met_total``)."""

    @staticmethod
    def _key(url: str) -> str:
        return url.rstrip("/")

    def get_peer(self, url: str, engine_id: str | None = None) -> PeerHandle:
        """The peer at ``url``, connecting on first use.

        If ``engine_id`` is given and differs from the cached peer's (the
        instance restarted), re-handshakes. Raises PeerUnavailableError,
        IncompatibleLayoutError.
        """
        key = self._key(url)
        with self._lock:
            cached = self._peers.get(key)
            checked_at = self._checked_at.get(key, 0.0)
            if cached is not None and not self.transport.is_connected(cached.engine_id):
                cached = None  # a flow tore its endpoint down: connect afresh (`_adopt`)
        if cached is not None:
            if engine_id is not None and cached.engine_id == engine_id:
                return cached
            if engine_id is None:
                due = self.recheck_s is not None and time.monotonic() - checked_at >= self.recheck_s
                return self._recheck(key, cached) if due else cached
        return self.refresh(url)

    def _recheck(self, key: str, cached: PeerHandle) -> PeerHandle:
        """A due check of a cached peer: reconnect if another engine answers at its URL.

        A peer that does not answer within ``recheck_timeout_s`` (stalled, dead, or
        unreachable) stays cached: its transfers fail or time out, and the flows'
        deadlines handle that, as they would have without the check.
        """
        try:
            info = self._fetch(key, self.recheck_timeout_s)
        except PeerUnavailableError as exc:
            with self._lock:
                self._checked_at[key] = time.monotonic()
            logger.info("peer at %s did not answer its check (%s); keeping %s", key, exc, cached.engine_id)
            return cached
        return self._adopt(key, info)

    def refresh(self, url: str) -> PeerHandle:
        """Fetch the handshake again; reconnect if the engine id changed. Returns the current peer."""
        key = self._key(url)
        return self._adopt(key, self._fetch(key, self.timeout_s))

    def _fetch(self, key: str, timeout_s: float) -> HandshakeInfo:
        """The handshake at `key`, fetched with the secret once the peer proved it holds
        it too. A peer that cannot be reached is asked to prove itself again next time:
        whoever answers there later may be another process."""
        try:
            if self._verifier is not None:
                self._verifier.ensure(key, timeout_s)
            return fetch_handshake(key, timeout_s, self._client, self._secret)
        except PeerUnavailableError as exc:
            if self._verifier is not None and isinstance(exc.__cause__, httpx.TransportError):
                self._verifier.forget(key)
            if is_refusal(exc):
                with self._lock:
                    if key in self._peers:
                        self._refused.add(key)
            raise

    def _adopt(self, key: str, info: HandshakeInfo) -> PeerHandle:
        """The peer `info` describes at `key`: the cached one if its engine is the same."""
        with self._lock:
            self._checked_at[key] = time.monotonic()
            cached = self._peers.get(key)
            if cached is not None and cached.engine_id != info.engine_id:
                logger.info(
                    "peer at %s restarted: engine %s -> %s; re-handshaking",
                    key, cached.engine_id, info.engine_id,
                )  # fmt: skip
                remember_last(self._replaced, cached.engine_id, None, REMEMBERED)
                if self.transport.is_connected(cached.engine_id):
                    self.transport.disconnect(cached)
                del self._peers[key]
                cached = None
            if cached is not None and not self.transport.is_connected(cached.engine_id):
                del self._peers[key]
                cached = None
            self._refused.discard(key)  # it answered
            if cached is not None:
                return cached
            peer = self.transport.connect(info)
            self._peers[key] = peer
            is_new = peer.engine_id not in self._met
            remember_last(self._met, peer.engine_id, None, REMEMBERED)
            if is_new:
                self.num_met += 1
        if is_new:
            self.transport.metrics.on_peer_met()
        self._publish()
        return peer

    def forget(self, url: str) -> None:
        """Disconnect and drop the peer at ``url`` at once, in flight or not (no-op if
        unknown): its transfers in flight fail."""
        key = self._key(url)
        with self._lock:
            peer = self._peers.get(key)
            if peer is not None:
                self._drop(key, peer)
        if peer is not None:
            self.transport.disconnect(peer)
        self._publish()

    def tick(self, now: float) -> None:
        """`sweep`, at most every ``sweep_interval_s`` (a notification pump's tick)."""
        if now - self._swept_at >= self.sweep_interval_s:
            self._swept_at = now
            self.sweep(now)

    def sweep(self, now: float | None = None) -> int:
        """Forget the peers that left (see the module docstring); returns how many.

        A peer with a transfer that is not settled stays: it is forgotten at a later
        sweep, once nothing with it can land any more."""
        now = time.monotonic() if now is None else now
        gone: list[tuple[str, PeerHandle, ForgetReason]] = []
        with self._lock:
            for key, peer in list(self._peers.items()):
                if not self.transport.is_connected(peer.engine_id):
                    reason: ForgetReason | None = ForgetReason.TORN_DOWN
                else:
                    use = self.transport.peer_usage.get(peer.engine_id)
                    reason = why_forget(use, key in self._refused, self.idle_s, now)
                if reason is not None:
                    self._drop(key, peer)
                    gone.append((key, peer, reason))
            self._refused &= self._peers.keys()
            for key in self._checked_at.keys() - self._peers.keys():
                del self._checked_at[key]
            for _, peer, _ in gone:  # under the lock, as `_adopt` does: never beside a connect
                self.transport.disconnect(peer)
        for key, peer, reason in gone:
            if self._verifier is not None:
                self._verifier.drop(key)
            self.transport.metrics.on_peer_forgotten(reason)
            logger.info("forgot peer %s at %s (%s)", peer.engine_id, key, reason.value)
        self._publish()
        return len(gone)

    def _drop(self, key: str, peer: PeerHandle) -> None:
        """Drop the entry of ``peer`` at ``key``, keeping its URL by engine id (``_lock`` held)."""
        del self._peers[key]
        self._checked_at.pop(key, None)
        self._refused.discard(key)
        remember_last(self._forgotten, peer.engine_id, key, REMEMBERED)
        self.num_forgotten += 1

    def _publish(self) -> None:
        """The peer tables' sizes, to the transport's metrics."""
        with self._lock:
            num = len(self._peers)
        self.transport.metrics.on_peers(self.transport.num_peers(), num)

    def reconnect(self, engine_id: str) -> PeerHandle | None:
        """The peer with this engine id, connected afresh if a flow tore its endpoint
        down (blocking: a handshake over HTTP); None if its URL is unknown, it cannot be
        reached, or another engine answers there now."""
        url = self.url_of(engine_id, forgotten=True)
        if url is None:
            return None
        try:
            peer = self.get_peer(url, engine_id)
        except Exception as exc:
            logger.info("cannot reconnect to %s at %s: %s", engine_id, url, exc)
            return None
        return peer if peer.engine_id == engine_id else None

    def is_gone(self, engine_id: str) -> bool:
        """Whether the process of the engine with this id is known to be gone: its address
        refuses connections, or another engine answers there (blocking), now or when
        this directory last handshook there. A peer that does not answer (stalled,
        partitioned) is not known to be gone.

        Each process draws a fresh engine id, so another one at the URL is another
        process bound to its port: the old one was killed, or stopped listening on
        its way out (`kvduplex.common.drain`: its server stops once it owes nothing
        or its drain deadline passed, then it closes its transport and exits)."""
        with self._lock:
            if engine_id in self._replaced:
                return True
        url = self.url_of(engine_id, forgotten=True)
        if url is None:
            return False
        try:
            if self._verifier is not None:
                self._verifier.ensure(url)
            info = fetch_handshake(url, self.timeout_s, self._client, self._secret)
        except PeerUnavailableError as exc:
            cause = exc.__cause__
            gone = isinstance(cause, Refused) or (  # Refused: whoever holds it is no member
                isinstance(cause, httpx.ConnectError) and "refused" in str(cause).lower()
            )
        else:
            gone = info.engine_id != engine_id
        if gone:
            with self._lock:
                cached = self._peers.get(url)
                if cached is not None and cached.engine_id == engine_id:
                    self._refused.add(url)  # `sweep` forgets it
        return gone

    def url_of(self, engine_id: str, *, forgotten: bool = False) -> str | None:
        """The URL of a connected engine (``forgotten``: or of one forgotten lately), or None."""
        with self._lock:
            for url, peer in self._peers.items():
                if peer.engine_id == engine_id:
                    return url
            return self._forgotten.get(engine_id) if forgotten else None

    def peer_by_engine(self, engine_id: str) -> PeerHandle | None:
        """The connected peer with this engine id, or None."""
        with self._lock:
            for peer in self._peers.values():
                if peer.engine_id == engine_id and self.transport.is_connected(engine_id):
                    return peer
        return None

    def peers(self) -> dict[str, PeerHandle]:
        with self._lock:
            return dict(self._peers)


def is_refusal(exc: PeerUnavailableError) -> bool:
    """Whether a failed handshake says that the peer left its address: nothing listens
    there (connection refused, unreachable), or whoever does is no member."""
    return isinstance(exc, HandshakeRefused) or isinstance(exc.__cause__, Refused | httpx.ConnectError)


__all__ = [
    "HANDSHAKE_PATH", "HandshakeRefused", "PeerDirectory", "fetch_handshake", "is_refusal",
    "make_handshake_router",
]  # fmt: skip
