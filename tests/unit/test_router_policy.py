"""The router's policy in plain Python: sessions, load spreading, prefix recognition."""

from __future__ import annotations

from collections import Counter

import pytest

from kvduplex.router.backends import Outcome
from kvduplex.router.policy import NoHealthyInstance
from kvduplex.router.policy import Route
from kvduplex.router.policy import RoutingPolicy
from kvduplex.router.sessions import PrefixIndex
from kvduplex.router.sessions import SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _policy(num_p: int = 2, num_d: int = 2, **kw: object) -> tuple[RoutingPolicy, Clock]:
    clock = Clock()
    policy = RoutingPolicy(
        [f"http://p{i}" for i in range(num_p)],
        [f"http://d{i}" for i in range(num_d)],
        clock=clock,
        **kw,  # type: ignore[arg-type]
    )
    return policy, clock


SYSTEM = list(range(1, 200))
"""A system prompt every conversation shares (12 chunks of 16 and a tail)."""


def _turn1(i: int) -> list[int]:
    return [*SYSTEM, 1000 + i, 7, 7, 7]


def _done(policy: RoutingPolicy, route: Route, outcome: Outcome = Outcome.OK) -> None:
    policy.prefill_done(route, outcome)
    policy.decode_done(route, outcome)


def test_concurrent_new_sessions_sharing_a_system_prompt_spread_evenly() -> None:
    policy, _ = _policy(2, 2)
    routes = [policy.route(_turn1(i), None) for i in range(8)]  # all in flight at once
    assert Counter(r.prefill.url for r in routes if r.prefill) == {"http://p0": 4, "http://p1": 4}
    assert Counter(r.decode.url for r in routes) == {"http://d0": 4, "http://d1": 4}
    assert not any(r.is_session_hit for r in routes)
    assert len({r.session_id for r in routes}) == 8


def test_sequential_new_sessions_spread_by_recent_assignments() -> None:
    """Each request is done before the next arrives: in-flight counts are all zero, yet
    recent assignments still spread the sessions (and ties go round-robin)."""
    policy, clock = _policy(3, 2)
    seen = []
    for i in range(6):
        route = policy.route(_turn1(i), None)
        _done(policy, route)
        clock.now += 0.5
        seen.append(route.prefill.url if route.prefill else "")
    assert Counter(seen) == {"http://p0": 2, "http://p1": 2, "http://p2": 2}


def test_named_session_sticks_unless_much_busier() -> None:
    policy, _ = _policy(2, 2, busy_margin=2)
    first = policy.route(_turn1(0), "alice")
    _done(policy, first)
    p, d = first.prefill, first.decode
    assert p is not None
    for _ in range(3):  # other sessions keep the other instances busy too
        policy.route(_turn1(50), None)
    again = policy.route([*_turn1(0), 5, 5], "alice")
    assert again.is_session_hit and again.session_id == "alice"
    assert (again.prefill, again.decode) == (p, d)
    _done(policy, again)
    least = min(b.in_flight for b in policy.prefill.backends if b is not p)
    extra = least + 2 - p.in_flight
    p.in_flight += extra  # two more than the least busy one: within the margin
    kept = policy.route([*_turn1(0), 5, 5, 6], "alice")
    assert kept.prefill is p
    _done(policy, kept)
    p.in_flight += 1  # three more: past it
    moved = policy.route([*_turn1(0), 5, 5, 6], "alice")
    assert moved.is_session_hit and moved.prefill is not p and moved.decode is d
    _done(policy, moved)
    p.in_flight -= extra + 1
    back = policy.route([*_turn1(0), 5, 5, 6, 7], "alice")
    assert back.prefill is p, "not busier any more: back to its rendezvous choice"


def test_a_session_recognised_by_its_prompt_follows_its_move() -> None:
    policy, _ = _policy(2, 2, busy_margin=0)
    first = policy.route(_turn1(0), None)
    _done(policy, first)
    p = first.prefill
    assert p is not None
    p.in_flight += 1  # busier than the least by one: past the margin
    moved = policy.route([*_turn1(0), 5, 5], None)
    assert moved.is_session_hit and moved.prefill is not p
    _done(policy, moved)
    p.in_flight -= 1
    back = policy.route([*_turn1(0), 5, 5, 6], None)
    assert back.session_id == first.session_id
    assert back.prefill is moved.prefill, "the session moved: its next turn follows"


def test_an_unreachable_instance_is_routed_around_until_a_later_probe_succeeds() -> None:
    """1. a call that could not reach P marks it unhealthy: the session and new requests go
    elsewhere;
    2. a probe that began before the failure cannot bring it back;
    3. a probe that began after it does, and new sessions reach it again."""
    policy, clock = _policy(2, 2)
    first = policy.route(_turn1(0), "s")
    probe_started = clock()
    clock.now += 0.1
    policy.prefill_done(first, Outcome.UNREACHABLE)
    policy.decode_done(first, Outcome.OK)
    failed = first.prefill
    assert failed is not None and not failed.is_healthy
    for i in range(4):
        route = policy.route([*_turn1(0), i], "s" if i == 0 else None)
        assert route.prefill is not failed
        _done(policy, route)
    assert policy.sessions.get("s", clock()).prefill_url != failed.url, "the session moved"
    policy.prefill.note_probe(failed, True, probe_started, clock())  # 2.
    assert not failed.is_healthy
    clock.now += 2.0
    policy.prefill.note_probe(failed, True, clock() - 0.01, clock())  # 3.
    assert failed.is_healthy
    seen = [policy.route(_turn1(10 + i), None).prefill for i in range(4)]
    assert failed in seen


def test_a_failed_probe_marks_unhealthy_and_none_healthy_is_told_at_once() -> None:
    policy, clock = _policy(1, 2, health_failures=1)
    d0, d1 = policy.decode.backends
    policy.decode.note_probe(d0, False, clock(), clock())
    assert not d0.is_healthy
    assert {policy.route(_turn1(i), None).decode.url for i in range(3)} == {d1.url}
    policy.decode.note_probe(d1, False, clock(), clock())
    with pytest.raises(NoHealthyInstance, match="no healthy decode instance"):
        policy.route(_turn1(5), None)
    (p0,) = policy.prefill.backends
    policy.prefill.note_probe(p0, False, clock(), clock())
    policy.decode.note_probe(d1, True, clock(), clock())
    route = policy.route(_turn1(6), None)
    assert route.prefill is None and route.decode is d1, "no healthy P: D computes alone"


def test_probes_mark_unhealthy_after_the_threshold_and_a_failed_call_only_asks_for_one() -> None:
    """1. one failed probe leaves D0 healthy, and a good probe starts the count again;
    2. the second failed probe in a row marks it unhealthy and tells its watchers, once;
    3. a call to D1 whose connection failed leaves D1 in rotation, its watchers untold,
    and asks for a probe of it; a call that could not reach it takes it out of rotation
    at once, its watchers (the calls in flight) still untold;
    4. a watch of an instance presumed down is told at once; an ended watch is never told;
    5. a 5xx answer leaves it healthy, in rotation, and its watchers untold."""
    policy, clock = _policy(1, 2)  # health_failures: 2, the default
    d0, d1 = policy.decode.backends
    told: list[str] = []
    probes_asked: list[str] = []
    policy.decode.probe_soon = lambda b: probes_asked.append(b.url)
    policy.decode.note_probe(d0, False, clock(), clock())  # 1.
    assert d0.is_healthy
    policy.decode.note_probe(d0, True, clock(), clock())
    policy.decode.note_probe(d0, False, clock(), clock())
    assert d0.is_healthy, "not two in a row"
    d0.watch(lambda: told.append("d0"))
    policy.decode.note_probe(d0, False, clock(), clock())  # 2.
    assert not d0.is_healthy and told == ["d0"]
    policy.decode.note_probe(d0, False, clock(), clock())
    assert told == ["d0"] and d0.watchers == {}
    route = policy.route(_turn1(0), None)  # 3.
    assert route.decode is d1
    d1.watch(lambda: told.append("d1"))
    policy.decode_done(route, Outcome.FAILED)
    assert d1.is_healthy and not d1.is_down and told == ["d0"]
    assert probes_asked == [d1.url]
    route = policy.route(_turn1(0), None)
    assert route.decode is d1, "still in rotation"
    policy.decode_done(route, Outcome.UNREACHABLE)
    assert not d1.is_healthy and not d1.is_down and told == ["d0"]
    assert probes_asked == [d1.url], "back with a later probe of the rounds"
    policy.decode.note_probe(d1, False, clock(), clock())
    policy.decode.note_probe(d1, False, clock(), clock())
    assert d1.is_down and told == ["d0", "d1"], "its probes presume it down"
    d0.watch(lambda: told.append("d0 again"))  # 4.
    assert told == ["d0", "d1", "d0 again"] and d0.watchers == {}
    clock.now += 1.0
    policy.decode.note_probe(d0, True, clock(), clock())
    assert d0.is_healthy
    unwatch = d0.watch(lambda: told.append("ended"))
    unwatch()
    unwatch()
    policy.decode.mark_failed(d0, clock())
    assert told == ["d0", "d1", "d0 again"]
    clock.now += 1.0  # 5. a 5xx answer is one request's failure: d0 stays in rotation
    policy.decode.note_probe(d0, True, clock(), clock())
    route = policy.route(_turn1(1), None)
    assert route.decode is d0
    d0.watch(lambda: told.append("d0 down"))
    policy.decode_done(route, Outcome.ERROR)
    assert d0.is_healthy and not d0.is_down and told == ["d0", "d1", "d0 again"]
    assert policy.route(_turn1(2), None).decode is d0, "the only healthy decode gets the next"
    policy.decode.mark_failed(d0, clock())  # then failed probes: presumed down
    assert d0.is_down and told == ["d0", "d1", "d0 again", "d0 down"]


def test_reroute_moves_the_request_and_its_session_to_a_healthy_decode() -> None:
    policy, clock = _policy(2, 2)
    first = policy.route(_turn1(0), "s")
    dead = first.decode
    policy.prefill_done(first, Outcome.REFUSED)
    policy.decode_done(first, Outcome.UNREACHABLE)
    again = policy.try_reroute(first)
    assert again is not None and again.decode is not dead and again.prefill is first.prefill
    assert (again.session_id, again.prefill_open, again.decode_open) == ("s", True, True)
    session = policy.sessions.get("s", clock())
    assert session is not None and session.num_turns == 1
    assert (session.prefill_url, session.decode_url) == (first.prefill.url, again.decode.url)
    _done(policy, again)
    assert all(b.in_flight == 0 for b in (*policy.prefill.backends, *policy.decode.backends))
    policy.decode.mark_failed(again.decode, clock())
    assert policy.try_reroute(again) is None, "no healthy decode left"


def test_a_continuing_conversation_is_recognised_by_its_whole_previous_prompt() -> None:
    policy, _ = _policy(2, 2)
    a1 = policy.route(_turn1(0), None)
    b1 = policy.route(_turn1(1), None)  # shares the system prompt with a1: a new session
    assert not b1.is_session_hit and b1.prefill is not a1.prefill
    _done(policy, a1)
    _done(policy, b1)
    a2 = policy.route([*_turn1(0), 42, 43, 44], None)  # a1's prompt + answer + new message
    assert a2.is_session_hit and a2.session_id == a1.session_id
    assert (a2.prefill, a2.decode) == (a1.prefill, a1.decode)
    _done(policy, a2)
    a3 = policy.route([*_turn1(0), 42, 43, 44, *range(300, 340)], None)
    assert a3.session_id == a1.session_id and a3.prefill is a1.prefill
    # The same first prompt again is not a continuation: concurrent duplicates spread.
    dup = policy.route(_turn1(0), None)
    assert not dup.is_session_hit


def test_session_table_expires_and_bounds() -> None:
    table = SessionTable(ttl_s=10.0, max_sessions=2)
    table.record("a", "http://p0", "http://d0", [1, 2, 3], now=0.0)
    table.record("b", "http://p1", "http://d1", [4, 5, 6], now=5.0)
    assert table.get("a", now=9.0) is not None
    assert table.get("a", now=10.5) is None and len(table) == 1  # a expired
    assert table.find_by_prompt([1, 2, 3, 4], now=10.5) is None  # and left the index
    table.record("c", "http://p0", "http://d0", [7, 8], now=11.0)
    table.record("d", "http://p0", "http://d0", [9, 9], now=12.0)  # over 2: b (oldest) goes
    assert table.get("b", now=12.0) is None and len(table) == 2
    assert table.find_by_prompt([4, 5, 6, 7], now=12.0) is None
    again = table.record("c", "http://p1", "http://d1", [7, 8, 1], now=13.0)
    assert again.num_turns == 2 and table.find_by_prompt([7, 8, 1, 2], 13.0) is again
    assert table.find_by_prompt([7, 8, 9], now=13.0) is None, "only the latest prompt is filed"
    assert len(table.index) == 2


@pytest.mark.parametrize("length", [3, 16, 17, 31, 32, 100])
def test_prefix_index_finds_the_longest_strict_prefix(length: int) -> None:
    index = PrefixIndex(chunk=16)
    prompt = list(range(length))
    index.add("short", prompt[: length // 2])
    index.add("whole", prompt)
    assert index.find([*prompt, 999]) == "whole"
    assert index.find(prompt) == ("short" if length // 2 else None)  # strict: not itself
    assert index.find([*prompt[:-1], 999, 1000]) == ("short" if length // 2 else None)
    assert index.find([5000, *prompt]) is None


def test_prefix_index_bounds_one_key() -> None:
    index = PrefixIndex(chunk=4, max_per_key=2)
    for i in range(3):
        index.add(f"s{i}", [1, 2, 3, 4, 100 + i])  # one full chunk, tails differ
    assert index.find([1, 2, 3, 4, 100, 0]) is None  # s0 dropped from the full key
    assert index.find([1, 2, 3, 4, 102, 0]) == "s2"
    index.remove("s2", (1, index._chain([1, 2, 3, 4])[1]))
    assert index.find([1, 2, 3, 4, 102, 0]) is None and len(index) == 1


def test_the_context_limit_is_the_smallest_decode_instances_not_prefills() -> None:
    """A request must fit whichever D it goes to; a P with less room only refuses its
    prefill (D then computes the prompt), so it does not bound requests."""
    policy = RoutingPolicy(["http://p0"], ["http://d0", "http://d1"])
    assert policy.max_model_len() is None  # no probe has answered
    policy.prefill.backends[0].max_model_len = 64
    policy.decode.backends[0].max_model_len = 4096
    policy.decode.backends[1].max_model_len = 2048
    assert policy.max_model_len() == 2048
