"""Where a session's KV likely is, read from the instances' pool clocks, and the plan of
its next turn (`router.residency`, `router.plans`)."""

from __future__ import annotations

import pytest

from kvduplex.router.backends import Outcome
from kvduplex.router.config import RouterConfig
from kvduplex.router.plans import is_return_kept
from kvduplex.router.plans import note_turn_held
from kvduplex.router.plans import turn_plan
from kvduplex.router.policy import Route
from kvduplex.router.policy import RoutingPolicy
from kvduplex.router.residency import Plan
from kvduplex.router.residency import PoolClock
from kvduplex.router.residency import Residency
from kvduplex.router.residency import choose_plan

P, D = "http://p", "http://d"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pool_holds_blocks_until_it_allocated_most_of_itself_since() -> None:
    clock = PoolClock()
    assert clock.holds(5), "an instance that never said: as if it held everything"
    assert not clock.holds(None), "no stamp: nothing of the session there"
    clock.note(num_blocks=100, allocated=1000, now=0.0)
    assert clock.holds(1000) and clock.holds(921)
    assert not clock.holds(920), "80 of 100 blocks allocated since: turned over"


def test_the_rate_is_sampled_over_seconds_and_a_restart_resets_it() -> None:
    clock = PoolClock()
    clock.note(num_blocks=100, allocated=0, now=0.0)
    clock.note(num_blocks=100, allocated=10, now=0.05)
    assert clock.rate is None and clock.keeps_for(1e6), "a burst of answers: no rate yet"
    clock.note(num_blocks=100, allocated=50, now=10.0)
    assert clock.rate == pytest.approx(5.0)
    assert clock.keeps_for(9.0) and not clock.keeps_for(10.0), "50 blocks = half the pool"
    clock.note(num_blocks=100, allocated=60, now=10.5)
    assert clock.rate == pytest.approx(5.0) and clock.allocated == 60
    clock.note(num_blocks=100, allocated=55, now=20.0)  # a probe that arrived late
    assert clock.allocated == 60 and clock.rate == pytest.approx(5.0), "ignored"
    clock.note(num_blocks=100, allocated=70, now=20.0, epoch="a")
    clock.note(num_blocks=100, allocated=3, now=20.0, epoch="b")  # a restart
    assert clock.rate is None and clock.allocated == 70 + 100 + 3, "a whole pool ahead"
    assert not clock.holds(50), "a stamp from before the restart is gone"
    assert clock.holds(clock.stamp_of(3))


def test_a_reading_in_an_answer_needs_both_numbers() -> None:
    clock = PoolClock()
    clock.read({"kv_num_blocks": 10}, 0.0)
    clock.read("not a body", 0.0)
    assert clock.num_blocks is None
    clock.read({"kv_num_blocks": 10, "kv_blocks_allocated": 4}, 0.0)
    assert (clock.num_blocks, clock.allocated) == (10, 4)


def test_the_plan_is_the_cheaper_one_a_token_on_decode_costing_more() -> None:
    def plan(prefill_tokens: int, decode_tokens: int, cost: float = 2.0) -> Plan:
        return choose_plan(1000, Residency(prefill_tokens, decode_tokens), cost)

    assert plan(900, 900) is Plan.PUSH, "a tie goes to prefill"
    assert plan(100, 900) is Plan.DECODE_LOCAL, "prefill lost the history: 900 against 200"
    assert plan(850, 900) is Plan.PUSH, "150 on prefill against 100 at twice the cost"
    assert plan(850, 900, cost=1.0) is Plan.DECODE_LOCAL
    assert plan(0, 1000) is Plan.PUSH, "nothing for decode to compute: prefill samples"


def _policy(clock: Clock) -> RoutingPolicy:
    return RoutingPolicy([P], [D], clock=clock)


def _turn(
    policy: RoutingPolicy, ids: list[int], answer: int, *, p_clock: int, is_returned: bool = False
) -> Route:
    """Route a turn of session "s", note P's answer at `p_clock` and the decode answer."""
    route = policy.route(ids, "s")
    policy.sessions.note_held("s", ids, is_prefill=True, stamp=p_clock, num_tokens=len(ids))
    if is_returned:
        policy.sessions.note_return_limit("s", None)
    policy.sessions.note_answer("s", ids, answer, list(range(answer)), None, policy.clock())
    note_turn_held(policy.sessions, route, ids, answer, policy.clock())
    policy.prefill_done(route, Outcome.OK)
    policy.decode_done(route, Outcome.OK)
    return route


def _after_one_turn(clock: Clock) -> tuple[RoutingPolicy, list[int]]:
    """A session's first turn through P (pool of 100 blocks, its clock at 13) and D,
    returned to P; the next turn's prompt."""
    policy = _policy(clock)
    p, d = policy.prefill.backends[0], policy.decode.backends[0]
    p.kv_clock.note(num_blocks=100, allocated=0, now=clock.now)
    d.kv_clock.note(num_blocks=1000, allocated=0, now=clock.now)
    first = list(range(1, 201))
    _turn(policy, first, 20, p_clock=13, is_returned=True)
    return policy, first + list(range(19)) + list(range(300, 340))


def test_a_turn_goes_to_decode_once_prefills_pool_turned_over_since_the_session_was_there() -> None:
    clock = Clock()
    # A fetched token costing as much as a computed one: fetching never pays.
    config = RouterConfig(decode=(D,), prefill=(P,), fetch_token_cost=1.0)
    policy, second = _after_one_turn(clock)
    route = policy.route(second, "s")
    assert turn_plan(config, route, len(second)) is Plan.PUSH, "prefill holds it all"
    assert is_return_kept(route, Plan.PUSH, clock.now)

    policy, second = _after_one_turn(clock)
    p = policy.prefill.backends[0]
    p.kv_clock.note(num_blocks=100, allocated=13 + 85, now=clock.now + 1)  # others' turns
    route = policy.route(second, "s")
    assert turn_plan(config, route, len(second)) is Plan.DECODE_LOCAL
    assert not is_return_kept(route, Plan.DECODE_LOCAL, clock.now + 1), (
        "prefill lacks the history the return would extend"
    )
    off = RouterConfig(decode=(D,), prefill=(P,), plan_by_residency=False)
    assert turn_plan(off, route, len(second)) is Plan.PUSH


def test_a_return_is_skipped_when_prefill_turns_over_within_the_sessions_think_time() -> None:
    clock = Clock()
    policy = _policy(clock)
    p = policy.prefill.backends[0]
    p.kv_clock.note(num_blocks=100, allocated=0, now=clock.now)
    p.kv_clock.note(num_blocks=100, allocated=30, now=clock.now + 3)  # 10 blocks/s
    clock.now += 3
    first = list(range(1, 101))
    _turn(policy, first, 10, p_clock=30)
    clock.now += 2  # the client thought 2 s: 20 blocks then, a fifth of the pool
    second = first + list(range(9)) + [7] * 30
    route = policy.route(second, "s")
    assert is_return_kept(route, Plan.PUSH, clock.now)
    policy.prefill_done(route, Outcome.OK)
    policy.decode_done(route, Outcome.OK)
    policy.sessions.note_answer("s", second, 10, list(range(10)), None, clock.now)
    clock.now += 8  # 8 s: 80 blocks, most of the pool
    third = second + list(range(9)) + [8] * 30
    route = policy.route(third, "s")
    assert not is_return_kept(route, Plan.PUSH, clock.now)


def test_the_turns_stamps_follow_the_instances_that_hold_them() -> None:
    clock = Clock()
    policy = _policy(clock)
    d = policy.decode.backends[0]
    d.kv_clock.note(num_blocks=1000, allocated=40, now=clock.now)
    ids = list(range(1, 51))
    _turn(policy, ids, 5, p_clock=7)
    session = policy.sessions.get("s", clock.now)
    assert session is not None
    assert (session.prefill_stamp, session.prefill_tokens) == (7, 50)
    assert (session.decode_stamp, session.decode_tokens) == (40, 54), (
        "the answer's last token has no KV"
    )
    assert session.answered_at == clock.now
    clock.now += 3
    policy.route(ids + list(range(4)) + [9], "s")
    again = policy.sessions.get("s", clock.now)
    assert again is not None and again.gap_s == 3.0 and again.prefill_stamp == 7


def test_prefills_answer_noted_after_the_return_keeps_the_returned_part() -> None:
    clock = Clock()
    policy = _policy(clock)
    ids = list(range(1, 51))
    route = policy.route(ids, "s")
    policy.sessions.note_return_limit("s", None)
    policy.sessions.note_answer("s", ids, 5, list(range(5)), None, clock.now)
    note_turn_held(policy.sessions, route, ids, 5, clock.now)  # the answer ended first
    policy.sessions.note_held("s", ids, is_prefill=True, stamp=3, num_tokens=len(ids))
    session = policy.sessions.get("s", clock.now)
    assert session is not None and session.prefill_tokens == 54


def test_a_return_is_skipped_when_prefill_turns_over_while_the_answer_decodes() -> None:
    """The history's blocks on prefill age from its prefill, not from the return: a long
    answer at prefill's churn loses them however short the think time."""
    clock = Clock()
    policy = _policy(clock)
    p = policy.prefill.backends[0]
    p.kv_clock.note(num_blocks=100, allocated=0, now=clock.now)
    p.kv_clock.note(num_blocks=100, allocated=30, now=clock.now + 3)  # 10 blocks/s
    clock.now += 3
    first = list(range(1, 101))
    route = policy.route(first, "s")
    policy.sessions.note_held("s", first, is_prefill=True, stamp=30, num_tokens=len(first))
    policy.sessions.note_return_limit("s", None)
    clock.now += 8  # the answer took 8 s: 80 blocks of churn
    policy.sessions.note_answer("s", first, 10, list(range(10)), None, clock.now)
    note_turn_held(policy.sessions, route, first, 10, clock.now)
    session = policy.sessions.get("s", clock.now)
    assert session is not None and (session.prefill_stamp, session.prefill_tokens) == (30, 109)
    clock.now += 0.5
    second = first + list(range(9)) + [7] * 30
    route = policy.route(second, "s")
    assert not is_return_kept(route, Plan.PUSH, clock.now), "8.5 s x 10 blocks/s > half"


def test_prefill_fetches_what_decode_holds_when_that_costs_less_than_computing_it() -> None:
    def plan(p_tokens: int, d_tokens: int, fetch: float | None = 0.1, prefer: bool = True) -> Plan:
        return choose_plan(1000, Residency(p_tokens, d_tokens), 2.0, fetch, prefer)

    assert plan(100, 900) is Plan.PREFILL_FETCH, "80 + 100 against 900 (and 200 on decode)"
    assert plan(100, 900, prefer=False) is Plan.PREFILL_FETCH, "180 is the cheapest too"
    assert plan(0, 980) is Plan.PREFILL_FETCH, "decode's steps stay free"
    assert plan(0, 980, prefer=False) is Plan.DECODE_LOCAL, "40 on decode against 118"
    assert plan(900, 900) is Plan.PUSH, "nothing to fetch: prefill holds what decode holds"
    assert plan(950, 900) is Plan.PUSH
    assert plan(100, 900, fetch=1.0) is Plan.DECODE_LOCAL, "a fetch that never pays"
    assert plan(100, 900, fetch=None) is Plan.DECODE_LOCAL, "no fetch: the plans before it"
    assert plan(0, 1000) is Plan.PREFILL_FETCH, "prefill computes the last token itself"
    assert plan(0, 1000, fetch=1.0) is Plan.PUSH, "a tie goes to prefill's push"


def test_a_turn_prefill_lost_fetches_its_history_from_decode_by_default() -> None:
    clock = Clock()
    policy, second = _after_one_turn(clock)
    p = policy.prefill.backends[0]
    p.kv_clock.note(num_blocks=100, allocated=13 + 85, now=clock.now + 1)  # others' turns
    route = policy.route(second, "s")
    config = RouterConfig(decode=(D,), prefill=(P,))
    assert (config.prefer_fetch, config.fetch_token_cost) == (True, 0.1)
    assert turn_plan(config, route, len(second)) is Plan.PREFILL_FETCH
    assert is_return_kept(route, Plan.PREFILL_FETCH, clock.now + 1), (
        "prefill computes the prompt over the history it fetched: the return extends it"
    )
    # 219 held by decode, 40 new: fetching costs 21.9 + 40, decode alone 80.
    cheapest = RouterConfig(decode=(D,), prefill=(P,), prefer_fetch=False)
    assert turn_plan(cheapest, route, len(second)) is Plan.PREFILL_FETCH
    dear = RouterConfig(decode=(D,), prefill=(P,), prefer_fetch=False, fetch_token_cost=0.5)
    assert turn_plan(dear, route, len(second)) is Plan.DECODE_LOCAL, "109.5 + 40 against 80"
    assert turn_plan(
        RouterConfig(decode=(D,), prefill=(P,), fetch_token_cost=0.5), route, len(second)
    ) is Plan.PREFILL_FETCH, "preferred while it costs less than prefill computing 259"
    off = RouterConfig(decode=(D,), prefill=(P,), plan_by_residency=False)
    assert turn_plan(off, route, len(second)) is Plan.PUSH
    with pytest.raises(ValueError, match="fetch_token_cost"):
        RouterConfig(decode=(D,), prefill=(P,), fetch_token_cost=0)
