"""The instances of one role as the router knows them: members, load, health.

Design note. Load is what the router itself assigned: requests in flight
(counted from the moment of choosing, so requests that arrive together see each
other) plus a count of recent assignments that decays with a half-life
(`BackendPool.load`). Equal loads are broken round-robin (`try_least_loaded`).
A session's rendezvous choice (`try_rendezvous`) is the first of its rank that is
not much busier than the least busy instance. Which of these a request gets is
the policy's (`policy`).

Members. The pools start with the configured URLs; discovery (`discovery`) adds
and removes instances as DNS answers change (`BackendPool.add`, `remove`). One
removed gets no new work; its calls in flight end as they would have: it leaves
the pool but stays among those probed until nothing is in flight to it or watches
it (`to_probe`), so one that goes silent with streams open is marked down as any
instance is, and they end. One that comes back while its calls still run rejoins
as the same `Backend` (`try_leaving`), its load and health as they were.

Health. An instance is presumed down after `health_failures` failed probes of
its /health in a row (`note_probe`, from the router's prober) until a probe
that began after the failure succeeds: it gets no new work, and whatever
watches it is called (`Backend.watch`): the flows abandon their calls in flight
to it there. A call whose connection failed once it was written (reset, closed,
an answer that is not HTTP) fails its own request only: one connection lost
says little of the instance, and presuming it down would fail every other call
to it. The instance is probed at once instead (`BackendPool.probe_soon`), and
leaves rotation only as its probes say. A call that never reached the instance
(the connection refused, timed out, or closed before the call was written)
takes it out of rotation at once, until a probe that began after succeeds; its
calls in flight go on until the probes presume it down. A 5xx answer is about
one request (a prompt that failed, a P that cannot reach one D): the instance
answered, so it stays in rotation; with one decode instance, marking it would
refuse every client until the next probe. Only healthy instances get work:
without a healthy prefill instance, decode computes whole requests; without a
healthy decode instance, `RoutingPolicy.route` raises `NoHealthyInstance`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

from kvduplex.router import rendezvous
from kvduplex.router.residency import PoolClock


class Outcome(enum.Enum):
    """How a call to an instance ended."""

    OK = "ok"
    REFUSED = "refused"
    """A 4xx, or a call abandoned: it says nothing of the instance."""
    ERROR = "error"
    """A 5xx: the instance answered but failed this call. Says nothing of its health:
    it keeps getting work (only unreachable instances and failed probes are taken out)."""
    FAILED = "failed"
    """Its connection failed once the call was written (reset, closed, an answer that is
    not HTTP): this request failed. The instance is probed at once and stays in rotation
    unless its probes say otherwise; its other calls go on."""
    UNREACHABLE = "unreachable"
    """The call never reached the instance (refused, timed out, closed before the call
    was written): no new work until a probe that began after says otherwise; its calls in
    flight go on until probes presume it down."""


@dataclass
class Backend:
    """One instance, and what the router knows of its load."""

    url: str
    in_flight: int = 0
    """Requests assigned and not done (P: until its prefill answer; D: until the stream ends)."""
    recent: float = 0.0
    """Assignments, decayed, as of `recent_at`."""
    recent_at: float = 0.0
    is_healthy: bool = True
    """Whether it gets new work; assumed until the first probe or call says otherwise."""
    failed_at: float = field(default=float("-inf"))
    """Clock time it was last marked unhealthy (a call that could not reach it, or a failed
    probe that made `health_failures` in a row): a probe that began before it cannot make
    the instance healthy again."""
    max_model_len: int | None = None
    """The longest request it serves, as its last good probe said (None: not yet known)."""
    engine_id: str | None = None
    """Its KV transport's engine id, as its last good probe said (None: not yet known). The
    router names it to the instance's peers, which then use their connection to it without
    asking the address who is there; a restart gives a new one."""
    block_size: int | None = None
    """Tokens per KV block, as its last good probe said (None: not yet known)."""
    fingerprint: str | None = None
    """The digest of its model fingerprint (`kvduplex.common.fingerprint`), as its last
    good probe said (None: not yet known, or it shows none). P and D are paired only when
    their digests are equal (`pairs_with`)."""
    kv_clock: PoolClock = field(default_factory=PoolClock, repr=False, compare=False)
    """Its pool's size and clock, as its probes and answers said (`residency`)."""
    num_failed_probes: int = 0
    """Probes failed in a row since the last good one."""
    is_probing: bool = field(default=False, compare=False)
    """A probe of it is in flight (one at a time: `health.probe`)."""
    is_down: bool = False
    """Presumed down (`health_failures` failed probes in a row): calls in flight to it are
    abandoned, and a call that starts watching it is at once."""
    watchers: dict[object, Callable[[], None]] = field(
        default_factory=dict, repr=False, compare=False
    )
    """What to call when it is next marked unhealthy (see `watch`)."""

    def watch(self, on_unhealthy: Callable[[], None]) -> Callable[[], None]:
        """Have `on_unhealthy` called once, when the instance is next presumed down, or now
        if it is already. A call to the instance watches it while in flight. Returns the
        function that ends the watch (idempotent): call it when the call ends.
        `on_unhealthy` runs inside `BackendPool.mark_failed`: it must not raise or block."""
        if self.is_down:
            on_unhealthy()
            return _no_watch
        key = object()
        self.watchers[key] = on_unhealthy

        def unwatch() -> None:
            self.watchers.pop(key, None)

        return unwatch


def pairs_with(a: Backend, b: Backend) -> bool:
    """Whether `a` and `b` may exchange KV as far as the router knows: equal fingerprint
    digests, or either not known yet (it pairs as if it matched; the KV handshake still
    refuses a mismatch)."""
    return a.fingerprint is None or b.fingerprint is None or a.fingerprint == b.fingerprint


def _no_watch() -> None:
    pass


def _no_probe(b: Backend) -> None:
    pass


def _url(b: Backend) -> str:
    return b.url


def _is_busy(b: Backend) -> bool:
    """Whether a call is in flight to `b` or something watches it."""
    return b.in_flight > 0 or bool(b.watchers)


class BackendPool:
    """The instances of one role, their load and the round-robin cursor that breaks ties."""

    def __init__(self, urls: Sequence[str], half_life_s: float, health_failures: int = 2) -> None:
        self.backends = [Backend(url) for url in urls]
        self.half_life_s = half_life_s
        self.health_failures = health_failures
        self._index = {b.url: i for i, b in enumerate(self.backends)}
        self._cursor = 0
        self._leaving: dict[str, Backend] = {}
        """Instances removed with calls still in flight, by URL: never routed to, still
        probed (`to_probe`) until nothing is in flight to them or watches them."""
        self.probe_soon: Callable[[Backend], None] = _no_probe
        """Probe an instance now, a call to it having failed (`health.run_prober` sets it
        while it runs; it must not raise or block)."""

    def by_url(self, url: str | None) -> Backend | None:
        return None if url is None or url not in self._index else self.backends[self._index[url]]

    def add(self, backend: Backend) -> None:
        """`backend` joins the pool (an instance discovered); its URL must be new to it.
        An instance that left with calls still in flight comes back as the same backend
        (`try_leaving`), so that its calls stay watched."""
        if backend.url in self._index:
            raise ValueError(f"{backend.url} is already an instance of this pool")
        if self._leaving.get(backend.url, backend) is not backend:
            raise ValueError(f"{backend.url} left with calls in flight: add back its backend")
        self._leaving.pop(backend.url, None)
        self._index[backend.url] = len(self.backends)
        self.backends.append(backend)

    def remove(self, url: str) -> Backend | None:
        """The instance at `url` leaves the pool (it left DNS): no new work for it, its
        sessions go elsewhere at their next turn; its calls in flight end as they would
        have (their routes hold it), and it is probed until they have (`to_probe`), so
        that a silent one is still marked down. The backend removed, or None if it was
        not there."""
        b = self.by_url(url)
        if b is None:
            return None
        self.backends.remove(b)
        self._index = {x.url: i for i, x in enumerate(self.backends)}
        self._cursor = self._cursor % len(self.backends) if self.backends else 0
        if _is_busy(b):
            self._leaving[url] = b
        return b

    def try_leaving(self, url: str) -> Backend | None:
        """The instance at `url` that was removed and still has calls in flight (or
        watchers), or None."""
        return self._leaving.get(url)

    def to_probe(self) -> list[Backend]:
        """What the health prober probes: the pool's instances, then those removed that
        still have calls in flight or watchers (never routed to: probed only so that one
        gone silent is marked down and its calls abandoned). A removed one with neither
        is forgotten here."""
        self._leaving = {url: b for url, b in self._leaving.items() if _is_busy(b)}
        return [*self.backends, *self._leaving.values()]

    def _recent(self, b: Backend, now: float) -> float:
        return b.recent * 0.5 ** (max(0.0, now - b.recent_at) / self.half_life_s)

    def load(self, b: Backend, now: float) -> float:
        """Requests in flight plus recent assignments (decayed)."""
        return b.in_flight + self._recent(b, now)

    def healthy(self, peers: Sequence[Backend] | None = None) -> list[Backend]:
        """The healthy instances; with `peers`, only those that pair with one of them at
        least (`pairs_with`)."""
        return [
            b for b in self.backends
            if b.is_healthy and (peers is None or any(pairs_with(b, p) for p in peers))
        ]  # fmt: skip

    def try_least_loaded(
        self, now: float, peers: Sequence[Backend] | None = None
    ) -> Backend | None:
        """The healthy instance (that pairs with one of `peers`, if given) with the least
        load, equal loads (to 1/100) round-robin; None if none is."""
        up = self.healthy(peers)
        if not up:
            return None
        n = len(self.backends)
        best = min(
            up, key=lambda b: (round(self.load(b, now), 2), (self._index[b.url] - self._cursor) % n)
        )
        self._cursor = (self._index[best.url] + 1) % n
        return best

    def try_rendezvous(
        self, session_id: str, busy_margin: int, peers: Sequence[Backend] | None = None
    ) -> Backend | None:
        """The session's instance (`policy`'s module docstring): the first healthy instance
        (that pairs with one of `peers`, if given) of its rendezvous rank that is not much
        busier than the least busy of those; None if none is healthy."""
        up = self.healthy(peers)
        if not up:
            return None
        limit = min(b.in_flight for b in up) + busy_margin
        return next(b for b in rendezvous.rank(session_id, up, _url) if b.in_flight <= limit)

    def can_keep(
        self, b: Backend, busy_margin: int, peers: Sequence[Backend] | None = None
    ) -> bool:
        """Whether a session may stay on `b`: healthy (and pairs with one of `peers`, if
        given), and not much busier than the least of those."""
        up = self.healthy(peers)
        return b in up and b.in_flight <= min(x.in_flight for x in up) + busy_margin

    def mark_failed(self, b: Backend, now: float, *, is_down: bool = True) -> None:
        """`b` gets no new work from now. `is_down` (it is presumed down: its probes
        failed): everything that watches it is told (and stops watching); else (it could
        not be reached, or it drains) its calls in flight go on."""
        b.is_healthy = False
        b.failed_at = now
        if is_down:
            b.is_down = True
            watchers, b.watchers = b.watchers, {}
            for on_unhealthy in watchers.values():
                on_unhealthy()

    def note_probe(self, b: Backend, is_ok: bool, started_at: float, now: float) -> None:
        """A probe of `b` that began at `started_at` ended now: healthy if it succeeded and
        nothing failed since it began; unhealthy if it failed and so did the
        `health_failures` - 1 probes before it."""
        if not is_ok:
            b.num_failed_probes += 1
            if b.num_failed_probes >= self.health_failures:
                self.mark_failed(b, now)
            return
        b.num_failed_probes = 0
        if started_at >= b.failed_at:
            b.is_healthy = True
            b.is_down = False

    def assign(self, b: Backend, now: float) -> None:
        b.recent = self._recent(b, now) + 1.0
        b.recent_at = now
        b.in_flight += 1

    def done(self, b: Backend, outcome: Outcome, now: float) -> None:
        b.in_flight -= 1
        if outcome is Outcome.FAILED or outcome is Outcome.UNREACHABLE:
            self.note_failed_call(b, outcome, now)  # not ERROR: a 5xx is one request's

    def note_failed_call(self, b: Backend, outcome: Outcome, now: float) -> None:
        """A call to `b` failed as `outcome` says (`FAILED` or `UNREACHABLE`): its request
        failed, no other. An unreachable instance gets no new work from now (its calls in
        flight go on); one whose connection failed stays in rotation and is probed at
        once (`probe_soon`): only failed probes presume it down."""
        if outcome is Outcome.UNREACHABLE:
            self.mark_failed(b, now, is_down=False)
        elif not b.is_down:  # one presumed down already is probed in its rounds
            self.probe_soon(b)
