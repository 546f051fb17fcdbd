"""Named sessions by rendezvous hashing: router replicas that share nothing agree on a
session's instances; an instance that leaves moves only its sessions; load sheds."""

from __future__ import annotations

from collections import Counter

from kvduplex.router import rendezvous
from kvduplex.router.backends import Backend
from kvduplex.router.backends import Outcome
from kvduplex.router.policy import Route
from kvduplex.router.policy import RoutingPolicy

P = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
D = [f"http://10.0.1.{i}:8000" for i in range(1, 4)]
SESSIONS = [f"session-{i}" for i in range(1000)]
PROMPT = list(range(1, 40))


def _done(policy: RoutingPolicy, route: Route) -> None:
    policy.prefill_done(route, Outcome.OK)
    policy.decode_done(route, Outcome.OK)


def _choices(policy: RoutingPolicy, sessions: list[str] = SESSIONS) -> dict[str, tuple[str, str]]:
    """Each session's (P, D) for one turn, one request at a time."""
    out = {}
    for sid in sessions:
        route = policy.route(PROMPT, sid)
        assert route.prefill is not None and route.is_named
        out[sid] = (route.prefill.url, route.decode.url)
        _done(policy, route)
    return out


def test_the_score_is_fixed_across_processes_and_versions() -> None:
    """Replicas of different builds (a rolling upgrade) must agree: a golden value."""
    assert rendezvous.score("session-1", "http://10.0.0.1:8000") == 0xDC60464B05B9E6F5


def test_independent_routers_choose_alike_and_spread_the_sessions() -> None:
    """Two routers (one given the instances in another order, one with other sessions
    routed before) make the same choice for 1,000 sessions; a third, started later
    (a restart), too. Each instance gets its share."""
    a = RoutingPolicy(P, D)
    b = RoutingPolicy(P[::-1], D[::-1])
    _choices(b, [f"other-{i}" for i in range(100)])
    first = _choices(a)
    assert _choices(b) == first
    assert _choices(RoutingPolicy(P, D)) == first
    per_p = Counter(p for p, _ in first.values())
    per_d = Counter(d for _, d in first.values())
    assert set(per_p) == set(P) and min(per_p.values()) > 1000 / len(P) * 0.75
    assert set(per_d) == set(D) and min(per_d.values()) > 1000 / len(D) * 0.75
    again = _choices(a)
    assert again == first, "turn 2 of every session goes where turn 1 went"


def test_an_instance_that_leaves_moves_only_its_sessions() -> None:
    """1. P2 leaves one router (it left DNS): its sessions move, spread over the others,
    and no other session moves; 2. on another router P2 turns unhealthy instead: the
    same choices; 3. it joins again: every session is back where it was."""
    before = _choices(RoutingPolicy(P, D))
    leaving = P[2]
    left = RoutingPolicy(P, D)
    assert left.prefill.remove(leaving) is not None  # 1.
    after = _choices(left)
    moved = {sid for sid in SESSIONS if after[sid][0] != before[sid][0]}
    assert moved == {sid for sid in SESSIONS if before[sid][0] == leaving}
    assert len(Counter(after[sid][0] for sid in moved)) == len(P) - 1
    assert all(after[sid][1] == before[sid][1] for sid in SESSIONS), "decode unchanged"
    unhealthy = RoutingPolicy(P, D)  # 2.
    backend = unhealthy.prefill.by_url(leaving)
    assert backend is not None
    unhealthy.prefill.mark_failed(backend, 0.0)
    assert _choices(unhealthy) == after
    left.prefill.add(Backend(leaving))  # 3.
    assert _choices(left) == before


def test_an_instance_that_joins_takes_only_the_sessions_that_rank_it_first() -> None:
    policy = RoutingPolicy(P[:3], D)
    before = _choices(policy)
    policy.prefill.add(Backend(P[3]))
    after = _choices(policy)
    moved = {sid for sid in SESSIONS if after[sid] != before[sid]}
    assert moved and all(after[sid][0] == P[3] for sid in moved)
    assert 150 < len(moved) < 350, "about a quarter"


def test_an_overloaded_instance_sheds_to_the_next_in_the_sessions_rank() -> None:
    """The rule: a session leaves its instance while that one has more than
    `busy_margin` requests in flight beyond the least busy; it goes to the next in its
    rank, as every router that sees the same loads decides; it comes back after."""
    routers = [RoutingPolicy(P, D, busy_margin=2), RoutingPolicy(P[::-1], D, busy_margin=2)]
    sid = "alice"
    ranked = rendezvous.rank(sid, P, lambda url: url)
    for policy in routers:
        first = policy.prefill.by_url(ranked[0])
        assert first is not None
        first.in_flight = 2  # two beyond the least busy (0): kept
        route = policy.route(PROMPT, sid)
        assert route.prefill is first
        _done(policy, route)
        first.in_flight = 3  # past the margin
        route = policy.route(PROMPT, sid)
        assert route.prefill is not None and route.prefill.url == ranked[1]
        second = route.prefill
        _done(policy, route)
        second.in_flight = 3  # both busy: the third in rank
        route = policy.route(PROMPT, sid)
        assert route.prefill is not None and route.prefill.url == ranked[2]
        _done(policy, route)
        first.in_flight = second.in_flight = 0
        route = policy.route(PROMPT, sid)
        assert route.prefill is first, "the load has passed: back to its first choice"


def test_a_named_sessions_reroute_goes_to_its_next_decode() -> None:
    policy = RoutingPolicy(P, D)
    route = policy.route(PROMPT, "bob")
    policy.prefill_done(route, Outcome.REFUSED)
    policy.decode_done(route, Outcome.UNREACHABLE)
    again = policy.try_reroute(route)
    ranked = rendezvous.rank("bob", D, lambda url: url)
    assert again is not None and again.is_named
    assert route.decode.url == ranked[0] and again.decode.url == ranked[1]
    assert again.prefill is route.prefill


def test_requests_without_a_session_name_keep_the_load_based_choice() -> None:
    policy = RoutingPolicy(P, D)
    routes = [policy.route([*PROMPT, i], None) for i in range(8)]  # all in flight at once
    assert Counter(r.prefill.url for r in routes if r.prefill) == dict.fromkeys(P, 2)
    assert not any(r.is_named for r in routes)
