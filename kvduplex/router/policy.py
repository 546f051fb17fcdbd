"""Which prefill (P) and decode (D) instance serves a request.

Design note. A session the client names (``X-Session-Id``, ``prompt_cache_key``)
goes to its rendezvous choice (`rendezvous`): the healthy instance that its id
ranks first, so that every router replica, and a router after its restart, sends
its turns to the P and D that hold its history without sharing memory. Load is the
escape: when that instance is much busier than the least busy one (more than
`busy_margin` requests in flight beyond it), the turn goes to the next in the
session's rank that is not, which replicas that see the same loads agree on too;
the next turn goes back to the first once it is not. An instance that leaves (or
turns unhealthy) moves only the sessions that ranked it first; one that joins
takes only those that rank it first (about 1/n of them), which recompute their
history there once.

A session the router recognises by its prompt (no name) is the router's own: its
next turn goes back to the P and D that served its last turn, where its history
is cached, unless that instance is much busier than the least busy one (as
above) or unhealthy; then it goes where a new session would, and the session
moves there.

A new unnamed session goes to the least loaded instance. Load is what the router
itself assigned: requests in flight (counted from the moment of choosing,
so requests that arrive together see each other) plus a count of recent
assignments that decays with a half-life, so sessions that will come back
spread as well as the requests of the moment. Equal loads are broken
round-robin. The prompt's prefix alone never attracts a new session: a
system prompt shared by every conversation would send them all to one place.

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
healthy decode instance, `route` raises `NoHealthyInstance`.

Pairing. A prefill and a decode instance are paired only when they serve the same
model: equal fingerprint digests, as their probes showed them (`Backend.fingerprint`;
an instance whose fingerprint is not known yet pairs with any, as the KV handshake
still refuses a mismatch). Decode is chosen first, as above, among the healthy
instances that pair with a healthy prefill instance; prefill then among the instances
that pair with the decode chosen, by the same rules. Only when no healthy decode
instance pairs with a healthy prefill instance (or none of either is healthy) is
decode chosen among all the healthy ones and the request goes to decode alone
(`Route.is_unpaired`), which computes the prompt itself: slower, never refused. With
prefill instances of one model and decode instances of two, the second model's decode
instances thus get no requests while the first model's serve (`pairing` says which
are unpaired)::

    healthy D that pair with a healthy P ── some ──► D among them, P among D's pairs
                                         └─ none ──► D among all healthy D, decode alone

The policy is plain Python over its own counters; the flows report back
when each call ends (`prefill_done`, `decode_done`) and whether the instance
failed.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

from kvduplex.router import rendezvous
from kvduplex.router.config import RouterConfig
from kvduplex.router.residency import PoolClock
from kvduplex.router.sessions import Session
from kvduplex.router.sessions import SessionTable


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


class NoHealthyInstance(Exception):
    """Every instance of a role that a request needs is unhealthy."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} instance")
        self.role = role


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
        """The session's instance (module docstring): the first healthy instance (that
        pairs with one of `peers`, if given) of its rendezvous rank that is not much busier
        than the least busy of those; None if none is healthy."""
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


@dataclass
class Route:
    """The instances chosen for one request; each is released once with its outcome."""

    session_id: str
    """The client's session id, or one the router made up for a recognised conversation."""
    is_session_hit: bool
    """The session was known (named before, or its previous prompt recognised)."""
    prefill: Backend | None
    """None: decode serves the request alone."""
    decode: Backend
    previous: Session | None = None
    """The session's latest turn before this one (None for a new session)."""
    reuses_answer: bool | None = None
    """The prompt holds the previous turn's answer where it left it (None: unknown)."""
    is_returning: bool = True
    """The session's turns are returned to prefill now (`sessions` module docstring)."""
    is_named: bool = False
    """The client named the session: its instances are its rendezvous choice."""
    sends_reasoning: bool = False
    """The session's client sends answers back with their reasoning (`Session`)."""
    prefill_open: bool = True
    decode_open: bool = True
    is_unpaired: bool = False
    """Decode serves it alone because no healthy prefill instance serves what decode
    serves (their fingerprints differ), not because none is healthy."""


class RoutingPolicy:
    """Sessions and load of a router's instances (see the module docstring)."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        *,
        session_ttl_s: float = 600.0,
        max_sessions: int = 100_000,
        busy_margin: int = 2,
        load_half_life_s: float = 30.0,
        health_failures: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefill = BackendPool(prefill_urls, load_half_life_s, health_failures)
        self.decode = BackendPool(decode_urls, load_half_life_s, health_failures)
        self.sessions = SessionTable(session_ttl_s, max_sessions)
        self.busy_margin = busy_margin
        self.clock = clock

    @classmethod
    def from_config(
        cls, config: RouterConfig, clock: Callable[[], float] = time.monotonic
    ) -> RoutingPolicy:
        return cls(
            config.prefill, config.decode, session_ttl_s=config.session_ttl_s,
            max_sessions=config.max_sessions, busy_margin=config.session_busy_margin,
            load_half_life_s=config.load_half_life_s, health_failures=config.health_failures,
            clock=clock,
        )  # fmt: skip

    def max_model_len(self) -> int | None:
        """The longest request every decode instance accepts (None: unknown).

        The smallest that a decode instance's probe reported: a request that fits
        it fits whichever D it is routed to. Prefill instances do not bound it: one
        that cannot take a prompt refuses it and D computes the prompt itself.
        """
        known = [b.max_model_len for b in self.decode.backends if b.max_model_len is not None]
        return min(known) if known else None

    def route(self, ids: Sequence[int], session_key: str | None) -> Route:
        """Choose P (if there are prefill instances) and D for a request with prompt `ids`.

        `session_key` is the client's name for the session (its instances are then
        its rendezvous choice); without one the session is recognised by its prompt.
        Counts the request as in flight on both; the caller reports back with
        `prefill_done` / `decode_done`.
        Without a healthy prefill instance the route has none (decode computes
        the prompt); raises `NoHealthyInstance` without a healthy decode instance.
        """
        now = self.clock()
        if not self.decode.healthy():
            raise NoHealthyInstance("decode")
        if session_key is not None:
            session = self.sessions.get(session_key, now)
        else:
            session = self.sessions.find_by_prompt(ids, now)
        if session_key is not None:
            session_id = session_key
        elif session is not None:
            session_id = session.session_id
        else:
            session_id = f"s-{secrets.token_hex(16)}"
        partners = self._decode_partners()
        if session_key is not None:
            decode = self._try_rendezvous(self.decode, session_key, now, partners)
            assert decode is not None  # one is healthy (checked above)
            prefill = self._try_rendezvous(self.prefill, session_key, now, [decode])
        else:
            pinned_decode = session.decode_url if session else None
            decode = self._try_choose(self.decode, pinned_decode, now, partners)
            assert decode is not None  # one is healthy (checked above)
            pinned = session.prefill_url if session else None
            prefill = self._try_choose(self.prefill, pinned, now, [decode])
        reuses = session.reuses_answer(ids) if session is not None else None
        current = self.sessions.record(
            session_id, prefill.url if prefill else None, decode.url, ids, now, reuses
        )
        return Route(
            session_id, session is not None, prefill, decode, session, reuses, current.is_returning,
            is_named=session_key is not None, sends_reasoning=current.sends_reasoning,
            is_unpaired=prefill is None and self.is_unpaired(decode),
        )  # fmt: skip

    def is_unpaired(self, decode: Backend) -> bool:
        """Whether prefill instances are healthy but none pairs with `decode` (their
        fingerprints differ): its requests go decode-alone."""
        return bool(self.prefill.healthy()) and not self.prefill.healthy([decode])

    def _decode_partners(self) -> list[Backend] | None:
        """The healthy prefill instances that decode is chosen to pair with: decode is
        then chosen among the healthy instances that pair with one of them. None (decode
        among all healthy ones, to serve alone) if no healthy decode instance pairs with
        a healthy prefill instance, or no prefill instance is healthy."""
        partners = self.prefill.healthy()
        return partners if partners and self.decode.healthy(partners) else None

    def try_reroute(self, route: Route) -> Route | None:
        """A new route for `route`'s request after its decode instance could not be reached
        (the request never got there): another healthy decode instance, and the same prefill
        instance if it is still healthy. The session moves with it. None if no decode
        instance is healthy. `route` itself is released by its caller as before."""
        now = self.clock()
        decode = self._try_choose_again(self.decode, route, now, self._decode_partners())
        if decode is None:
            return None
        prefill = route.prefill
        if prefill is not None and prefill.is_healthy and pairs_with(prefill, decode):
            self.prefill.assign(prefill, now)
        else:
            prefill = self._try_choose_again(self.prefill, route, now, [decode])
        self.sessions.move(route.session_id, prefill.url if prefill else None, decode.url)
        return Route(
            route.session_id, route.is_session_hit, prefill, decode, route.previous,
            route.reuses_answer, route.is_returning, is_named=route.is_named,
            sends_reasoning=route.sends_reasoning,
            is_unpaired=prefill is None and self.is_unpaired(decode),
        )  # fmt: skip

    def _try_choose_again(
        self, pool: BackendPool, route: Route, now: float, peers: Sequence[Backend] | None
    ) -> Backend | None:
        """`route`'s session's choice among the healthy instances left (that pair with one
        of `peers`, if given): its rendezvous choice if the client named it, else the
        least loaded."""
        if route.is_named:
            return self._try_rendezvous(pool, route.session_id, now, peers)
        chosen = pool.try_least_loaded(now, peers)
        if chosen is not None:
            pool.assign(chosen, now)
        return chosen

    def _try_rendezvous(
        self, pool: BackendPool, session_id: str, now: float, peers: Sequence[Backend] | None
    ) -> Backend | None:
        chosen = pool.try_rendezvous(session_id, self.busy_margin, peers)
        if chosen is not None:
            pool.assign(chosen, now)
        return chosen

    def _try_choose(
        self, pool: BackendPool, pinned_url: str | None, now: float,
        peers: Sequence[Backend] | None,
    ) -> Backend | None:  # fmt: skip
        """The session's pinned instance if it may stay there (and pairs with one of
        `peers`, if given), else the least loaded of those that do."""
        pinned = pool.by_url(pinned_url)
        if pinned is not None and pool.can_keep(pinned, self.busy_margin, peers):
            chosen: Backend | None = pinned
        else:
            chosen = pool.try_least_loaded(now, peers)
        if chosen is not None:
            pool.assign(chosen, now)
        return chosen

    def prefill_done(self, route: Route, outcome: Outcome) -> None:
        """The call to `route.prefill` ended (idempotent)."""
        if route.prefill is not None and route.prefill_open:
            route.prefill_open = False
            self.prefill.done(route.prefill, outcome, self.clock())

    def decode_done(self, route: Route, outcome: Outcome) -> None:
        """The call to `route.decode` ended, its stream included (idempotent)."""
        if route.decode_open:
            route.decode_open = False
            self.decode.done(route.decode, outcome, self.clock())
