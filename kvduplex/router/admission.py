"""Which instance addresses the router trusts with the cluster secret and the API key.

With a cluster secret, the router sends the secret and the API key (the flows'
calls, ``/v1/models``) only to an address that proved it holds the secret too
(`kvduplex.common.challenge`: a two-way proof in which neither side sends it).
`TrustedClient` holds the line: a call with credentials to any other address
raises `Untrusted`, a `client.ConnectError` (nothing was sent; the flows act as
on an instance they cannot reach). Who asks for the proof (`Admission.try_admit`):

* the DNS discovery (`discovery.py`), before an address joins its pool: one that
  does not prove the secret never joins;
* the health prober (`health.py`), before it probes an instance that has no
  proof yet (one given by URL, at first: it gets no work until then), one that
  was presumed down (whoever answers at its address when it is back may be
  another process), and one whose proof is older than `RENEW_S`.

An address that fails the proof (a wrong one, no secret, no challenge route,
another role than asked for, an address translated on the way) is logged once,
counted in ``kvduplex_router_instance_refusals_total{role, reason}``, sent
nothing, and asked again after a backoff that doubles from `BACKOFF_MIN_S` to
`BACKOFF_MAX_S`. One that does not answer (a refused connection, a timeout, a
5xx) is asked again at the next round, as it would be for its /health. Without
a secret there is nothing to prove: every address is trusted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client import Counter

from kvduplex.common.challenge import CHALLENGE_PATH
from kvduplex.common.challenge import PROOF_PATH
from kvduplex.common.challenge import Exchange
from kvduplex.common.challenge import NotAnswered
from kvduplex.common.challenge import Refusal
from kvduplex.common.challenge import Refused
from kvduplex.router.client import CallError
from kvduplex.router.client import ConnectError
from kvduplex.router.client import InstanceClient
from kvduplex.router.client import StreamedAnswer
from kvduplex.router.client import WholeAnswer

logger = logging.getLogger(__name__)

RENEW_S = 60.0
"""Age of a proof after which the health prober asks for a new one."""
BACKOFF_MIN_S = 5.0
BACKOFF_MAX_S = 300.0
"""Wait before an address that failed the proof is asked again: doubles from the first
to the second at each failure in a row."""


class Untrusted(ConnectError):
    """A call with credentials to an address that has not proved the cluster secret: it
    was not sent."""


def origin(url: str) -> str:
    """The scheme, host and port of `url`: what a proof is held for."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


@dataclass
class _Refused:
    refusal: Refusal
    retry_at: float
    backoff_s: float


class Admission:
    """Proofs of the cluster secret by address (see the module docstring)."""

    def __init__(
        self,
        secret: str | None,
        client: InstanceClient,
        timeout_s: float,
        refusals: Counter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`client`: the proof's calls, without credentials; `timeout_s`: each call's
        deadline; `refusals`: the counter of refused attempts (labels role, reason)."""
        self._secret = secret
        self.client = client
        self._timeout_s = timeout_s
        self._refusals = refusals
        self._clock = clock
        self._proved_at: dict[str, float] = {}
        self._refused: dict[str, _Refused] = {}

    @property
    def is_active(self) -> bool:
        """Whether there is a secret to prove."""
        return self._secret is not None

    def is_trusted(self, url: str) -> bool:
        """Whether credentials may be sent to `url` (an instance's, or one of its routes)."""
        return self._secret is None or origin(url) in self._proved_at

    def distrust(self, url: str) -> None:
        """No credentials to `url` until it proves the secret again."""
        self._proved_at.pop(origin(url), None)

    def forget(self, url: str) -> None:
        """Drop all that is known of `url` (it left DNS): its proof, its refusals."""
        self._proved_at.pop(origin(url), None)
        self._refused.pop(origin(url), None)

    def count(self, role: str, refusal: Refusal) -> None:
        """One refused attempt to admit a `role` instance."""
        if self._refusals is not None:
            self._refusals.labels(role=role, reason=refusal.value).inc()

    async def try_admit(
        self, url: str, role: str, roles: Collection[str] | None = None
    ) -> str | None:
        """Ask the `role` instance at `url` for a proof unless it has a recent one (or
        failed recently: then wait for its backoff); None if it is trusted after that,
        else why not. `roles`: the roles it may prove (None: any)."""
        if self._secret is None:
            return None
        key, now = origin(url), self._clock()
        proved_at = self._proved_at.get(key)
        if proved_at is not None and now - proved_at < RENEW_S:
            return None
        held = self._refused.get(key)
        if held is not None and now < held.retry_at:
            left = held.retry_at - now
            return f"refused ({held.refusal.value}); asked again in {left:.0f} s"
        try:
            await self._exchange(self._secret, url, roles)
        except Refused as exc:
            self._proved_at.pop(key, None)
            self._note_refused(key, url, role, exc, now)
            return f"did not prove the cluster secret: {exc}"
        except Exception as exc:  # not answered (CallError, NotAnswered, a timeout), or worse
            if not isinstance(exc, CallError | NotAnswered | TimeoutError):
                logger.warning("%s instance %s: its proof failed", role, url, exc_info=True)
            if key in self._proved_at:  # a renewal not answered: the proof held so far stays
                return None
            return f"did not answer the proof of the cluster secret: {exc!r}"
        self._proved_at[key] = self._clock()
        if self._refused.pop(key, None) is not None:
            logger.warning("%s instance %s proved the cluster secret: trusted now", role, url)
        return None

    async def _exchange(self, secret: str, url: str, roles: Collection[str] | None) -> None:
        ex = Exchange(secret, url)
        async with asyncio.timeout(self._timeout_s):
            first = await self.client.post_whole(url + CHALLENGE_PATH, ex.challenge())
        async with asyncio.timeout(self._timeout_s):
            body = ex.proof(first.status_code, first.content)
            second = await self.client.post_whole(url + PROOF_PATH, body)
        ex.check(second.status_code, second.content, roles)

    def _note_refused(self, key: str, url: str, role: str, exc: Refused, now: float) -> None:
        held = self._refused.get(key)
        backoff_s = BACKOFF_MIN_S if held is None else min(BACKOFF_MAX_S, 2 * held.backoff_s)
        self._refused[key] = _Refused(exc.refusal, now + backoff_s, backoff_s)
        self.count(role, exc.refusal)
        if held is None or held.refusal is not exc.refusal:
            logger.warning(
                "%s instance %s is not used: it did not prove the cluster secret (%s); "
                "nothing is sent to it; asked again in %.0f s, then less often",
                role, url, exc, backoff_s,
            )  # fmt: skip
        else:
            logger.debug("%s instance %s refused again: %s", role, url, exc)

    def close(self) -> None:
        self.client.close()


class TrustedClient:
    """`client.InstanceClient` that makes a call with credentials (every POST, a GET that
    asks for them) only to an address `admission` trusts; else `Untrusted`."""

    def __init__(self, inner: InstanceClient, admission: Admission) -> None:
        self.inner = inner
        self.admission = admission

    def _check(self, url: str) -> None:
        if not self.admission.is_trusted(url):
            raise Untrusted(
                f"{origin(url)} has not proved the cluster secret: nothing was sent to it"
            )

    async def post_whole(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> WholeAnswer:
        self._check(url)
        return await self.inner.post_whole(url, content, headers)

    async def post_stream(
        self, url: str, content: bytes, headers: dict[str, str] | None = None
    ) -> StreamedAnswer:
        self._check(url)
        return await self.inner.post_stream(url, content, headers)

    async def get(self, url: str, timeout_s: float, *, credentials: bool = False) -> WholeAnswer:
        if credentials:
            self._check(url)
        return await self.inner.get(url, timeout_s, credentials=credentials)

    def close(self) -> None:
        self.inner.close()


__all__ = ["RENEW_S", "Admission", "TrustedClient", "Untrusted", "origin"]
