"""Proof of the cluster secret, both ways, before the secret or the API key is sent.

A verifier (the router, before it trusts an address as an instance; an instance,
before it sends its secret to a peer the router named) and the instance at that
address prove to each other that they hold the cluster secret without sending
it, in two POSTs to the instance (the shape of SCRAM: the verifier proves first,
the instance last)::

    verifier V                                            instance I (role r)
    v: 32 fresh random bytes
      ── POST /internal/auth/challenge {v, url} ─────────► i: 32 fresh random bytes;
                                                           keeps i → (v, url, seen)
      ◄───────────────────────────────────── {i} ───────── for at most TTL_S
    pv = MAC(verifier, v, i, url)
      ── POST /internal/auth/proof {i, pv} ──────────────► takes i out (used once);
                                                           pv right? else 401
      ◄──── {r, seen, pi = MAC(instance, v, i, r, url, seen)} ─
    pi right, r one of the roles asked for, seen the address dialled? else refused

``MAC`` is HMAC-SHA256 keyed by the secret over a length-prefixed list of its
parts (so no two lists read alike), the first of them naming this protocol and
which side proves. ``url`` is the instance's URL as the verifier addresses it;
``seen`` is the instance's own address on the connection the challenge came in
on (IP:PORT, from its socket).

Why each part: I answers with a proof only to a verifier that proved the secret
first, so a stranger gets no MAC out of it. v is fresh for each exchange, so a
recorded ``pi`` answers no other; i is used once and only within ``TTL_S``, so a
recorded ``pv`` opens no other exchange (a replay is refused as an unknown
nonce). ``url`` and ``seen`` bind ``pi`` to the address: an impostor at address
X that relays both POSTs to a member at Y gets back ``seen = Y``, which the
verifier refuses when the URL names an IP (`address_matches`). A URL that names
a host by DNS name binds only the name: the verifier trusts the DNS answer of
each connection, so give such names fully qualified from a DNS you trust.
Instances must be addressed directly: an address translated on the way (a
ClusterIP, a published container port) fails the address check.

Both sides are plain functions over bytes (sans-IO): `Exchange` is the verifier's
(its HTTP is the caller's: the router's client, or an instance's httpx),
`Responder` the instance's.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
from collections.abc import Callable
from collections.abc import Collection
from dataclasses import dataclass
from dataclasses import field
from typing import Annotated
from urllib.parse import urlsplit

import msgspec

CHALLENGE_PATH = "/internal/auth/challenge"
PROOF_PATH = "/internal/auth/proof"
AUTH_PATHS = frozenset({CHALLENGE_PATH, PROOF_PATH})
"""Internal routes open to callers without the secret: the exchange is how they prove it."""
TTL_S = 10.0
"""How long an instance keeps the nonce of a challenge for the proof that must follow."""
MAX_PENDING = 1024
"""Challenges an instance keeps at once; past this the oldest is dropped."""
NO_SECRET_CODE = "no_cluster_secret"
"""The error code of an instance without a secret, asked to prove one."""
_PROTOCOL = b"kvduplex-auth-v1"

Hex32 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
"""32 bytes as lowercase hex: a nonce, or a MAC."""


class Challenge(msgspec.Struct, forbid_unknown_fields=True):
    nonce: Hex32
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]


class ChallengeAnswer(msgspec.Struct):
    nonce: Hex32


class Proof(msgspec.Struct, forbid_unknown_fields=True):
    nonce: Hex32
    proof: Hex32


class ProofAnswer(msgspec.Struct):
    role: Annotated[str, msgspec.Meta(max_length=64)]
    seen: Annotated[str, msgspec.Meta(max_length=64)]
    proof: Hex32


class Refusal(enum.StrEnum):
    """Why an address was not trusted (a label of the router's refusal counter)."""

    NO_CHALLENGE = "no_challenge"
    """It has no challenge route (404): not a kvduplex instance, or an older build."""
    NO_SECRET = "no_secret"
    """It is an instance without a cluster secret."""
    WRONG_SECRET = "wrong_secret"
    """A proof was wrong, or it refused the verifier's: another secret."""
    MALFORMED = "malformed"
    """It answered what the protocol does not say."""
    ROLE = "role"
    """It proved the secret as another role than the one asked for."""
    ADDRESS = "address"
    """Its proof names another address than the one dialled: a relay, or an address
    translated on the way."""


class Refused(Exception):
    """The address did not prove the secret (`refusal` says how)."""

    def __init__(self, refusal: Refusal, detail: str) -> None:
        super().__init__(f"{refusal.value}: {detail}")
        self.refusal = refusal


class NotAnswered(Exception):
    """The exchange did not complete for a reason that says nothing of trust (a 5xx, a
    draining or stalled instance); ask again later."""


def new_nonce() -> str:
    return secrets.token_hex(32)


def mac(secret: str, label: bytes, *parts: str) -> str:
    """HMAC-SHA256 keyed by `secret` over the protocol's name, `label` and `parts`, each
    prefixed by its length."""
    h = hmac.new(secret.encode("utf-8"), digestmod=hashlib.sha256)
    for part in (_PROTOCOL, label, *(p.encode("utf-8", "surrogateescape") for p in parts)):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.hexdigest()


def seen_address(server: tuple[str, int | None] | None) -> str:
    """An ASGI scope's ``server`` (this end of the connection) as ``IP:PORT`` (IPv6 in
    brackets, an IPv4-mapped IPv6 address as IPv4); empty if it is not an IP and port."""
    if server is None or server[1] is None:
        return ""
    try:
        ip = _plain(ipaddress.ip_address(server[0]))
    except ValueError:
        return ""
    return f"[{ip}]:{server[1]}" if ip.version == 6 else f"{ip}:{server[1]}"


def address_matches(url: str, seen: str) -> bool:
    """Whether `seen` (an instance's ``IP:PORT`` for a connection) is where `url` points.
    True whatever `seen` is when `url` names its host by DNS name (it cannot be compared);
    False if `url` cannot be read."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return False
    if host is None:
        return False
    try:
        want = _plain(ipaddress.ip_address(host))
    except ValueError:
        return True
    port = port if port is not None else (443 if parts.scheme == "https" else 80)
    got_host, _, got_port = seen.rpartition(":")
    try:
        got = _plain(ipaddress.ip_address(got_host.strip("[]")))
    except ValueError:
        return False
    return got == want and got_port == str(port)


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _plain(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def refusal_of_status(status: int, body: bytes) -> Refused | NotAnswered | None:
    """What an instance's HTTP status to either POST says: None for 200."""
    if status == 200:
        return None
    if status == 404:
        return Refused(Refusal.NO_CHALLENGE, "it has no challenge route (HTTP 404)")
    if status == 409 and NO_SECRET_CODE.encode() in body:
        return Refused(Refusal.NO_SECRET, "it has no cluster secret")
    if status == 401:
        return Refused(Refusal.WRONG_SECRET, "it refused this side's proof: another secret")
    if 400 <= status < 500:
        return Refused(Refusal.MALFORMED, f"HTTP {status}: {body[:200]!r}")
    return NotAnswered(f"HTTP {status}")


@dataclass
class Exchange:
    """The verifier's side of one exchange with the instance at `url`. Its nonce lives only
    here: make one per exchange.

        ex = Exchange(secret, url)
        status, body = POST url + CHALLENGE_PATH, ex.challenge()
        status, body = POST url + PROOF_PATH, ex.proof(status, body)
        role = ex.check(status, body, roles)

    `proof` and `check` raise `Refused` or `NotAnswered`.
    """

    secret: str
    url: str
    nonce: str = field(default_factory=new_nonce)
    _their_nonce: str = field(default="", init=False, repr=False)

    def challenge(self) -> bytes:
        return msgspec.json.encode(Challenge(self.nonce, self.url))

    def proof(self, status: int, body: bytes) -> bytes:
        """The second POST's body, from the instance's answer to the first."""
        _raise_for(status, body)
        try:
            answer = msgspec.json.decode(body, type=ChallengeAnswer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Refused(Refusal.MALFORMED, f"its challenge answer: {exc}") from None
        self._their_nonce = answer.nonce
        mine = mac(self.secret, b"verifier", self.nonce, answer.nonce, self.url)
        return msgspec.json.encode(Proof(answer.nonce, mine))

    def check(self, status: int, body: bytes, roles: Collection[str] | None = None) -> str:
        """The instance's role, once its proof is checked: right (constant-time), for a role
        in `roles` (None: any) and from the address `url` names."""
        assert self._their_nonce, "proof() first"
        _raise_for(status, body)
        try:
            answer = msgspec.json.decode(body, type=ProofAnswer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Refused(Refusal.MALFORMED, f"its proof: {exc}") from None
        want = mac(
            self.secret, b"instance", self.nonce, self._their_nonce, answer.role, self.url,
            answer.seen,
        )  # fmt: skip
        if not hmac.compare_digest(want, answer.proof):
            raise Refused(Refusal.WRONG_SECRET, "its proof is wrong: another secret")
        if roles is not None and answer.role not in roles:
            raise Refused(Refusal.ROLE, f"it is a {answer.role!r} instance, not {sorted(roles)}")
        if not address_matches(self.url, answer.seen):
            raise Refused(
                Refusal.ADDRESS, f"it answered from {answer.seen or 'no IP address'}: a relay, "
                "or an address translated on the way (address instances directly)",
            )  # fmt: skip
        return answer.role


def _raise_for(status: int, body: bytes) -> None:
    problem = refusal_of_status(status, body)
    if problem is not None:
        raise problem


@dataclass
class _Pending:
    their_nonce: str
    url: str
    seen: str
    expires_at: float


class Responder:
    """An instance's side of the exchange (`challenge`, then `prove`); any thread."""

    def __init__(
        self,
        secret: str,
        role: str,
        *,
        ttl_s: float = TTL_S,
        max_pending: int = MAX_PENDING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._secret = secret
        self.role = role
        self._ttl_s = ttl_s
        self._max_pending = max_pending
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: collections.OrderedDict[str, _Pending] = collections.OrderedDict()
        """By this side's nonce, oldest first (so the first to expire come first)."""

    def challenge(self, body: bytes, seen: str) -> bytes:
        """The answer to a challenge that came in on a connection whose local address is
        `seen` (`seen_address`). ValueError if the body is not one."""
        try:
            asked = msgspec.json.decode(body, type=Challenge)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"not a challenge: {exc}") from None
        nonce = new_nonce()
        now = self._clock()
        with self._lock:
            while self._pending:
                oldest = next(iter(self._pending.values()))
                if oldest.expires_at > now and len(self._pending) < self._max_pending:
                    break
                self._pending.popitem(last=False)
            self._pending[nonce] = _Pending(asked.nonce, asked.url, seen, now + self._ttl_s)
        return msgspec.json.encode(ChallengeAnswer(nonce))

    def prove(self, body: bytes) -> bytes:
        """This instance's proof, once the verifier's is right. ValueError if the body is
        not one; `Refused` (WRONG_SECRET) if its nonce is unknown, used or expired, or its
        proof wrong. The nonce is used up either way."""
        try:
            given = msgspec.json.decode(body, type=Proof)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"not a proof: {exc}") from None
        with self._lock:
            pending = self._pending.pop(given.nonce, None)
        if pending is None:
            raise Refused(Refusal.WRONG_SECRET, "unknown or used nonce")
        if pending.expires_at <= self._clock():
            raise Refused(Refusal.WRONG_SECRET, f"the challenge expired ({self._ttl_s:g} s)")
        want = mac(self._secret, b"verifier", pending.their_nonce, given.nonce, pending.url)
        if not hmac.compare_digest(want, given.proof):
            raise Refused(Refusal.WRONG_SECRET, "wrong proof: another secret")
        mine = mac(
            self._secret, b"instance", pending.their_nonce, given.nonce, self.role,
            pending.url, pending.seen,
        )  # fmt: skip
        return msgspec.json.encode(ProofAnswer(self.role, pending.seen, mine))

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)


__all__ = [
    "AUTH_PATHS",
    "CHALLENGE_PATH",
    "PROOF_PATH",
    "Exchange",
    "NotAnswered",
    "Refusal",
    "Refused",
    "Responder",
    "address_matches",
    "mac",
    "seen_address",
]
