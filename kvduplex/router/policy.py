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

Which instances are members, their load and their health are `backends`'s.

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

import secrets
import time
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass

from kvduplex.router.backends import Backend
from kvduplex.router.backends import BackendPool
from kvduplex.router.backends import Outcome
from kvduplex.router.backends import pairs_with
from kvduplex.router.config import RouterConfig
from kvduplex.router.sessions import Session
from kvduplex.router.sessions import SessionTable


class NoHealthyInstance(Exception):
    """Every instance of a role that a request needs is unhealthy."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} instance")
        self.role = role


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
