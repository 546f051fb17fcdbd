"""The multi-host run's client and report: which failures a client sends to the other router,
how turns are grouped for the duplex hit, how failures are told apart around the kill, and
which bars the report holds the run to."""

from __future__ import annotations

import asyncio

import httpx

from benchmarks.multihost_load import Attempt
from benchmarks.multihost_load import TurnRecord
from benchmarks.multihost_report import Labels
from benchmarks.multihost_report import Membership
from benchmarks.multihost_report import Observed
from benchmarks.multihost_report import Timeline
from benchmarks.multihost_report import duplex_hits
from benchmarks.multihost_report import failures
from benchmarks.multihost_report import format_report
from benchmarks.multihost_report import rendezvous_choice
from kvduplex.bench.client import KVUsage
from kvduplex.bench.client import RequestResult
from kvduplex.bench.client import stream_request

BS = 4
P0, P1 = "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def _stream(handler: httpx.MockTransport) -> RequestResult:
    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=handler) as client:
            body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
            return await stream_request(client, "http://router", "/v1/completions", body)

    return asyncio.run(go())


def test_a_refused_connection_is_a_transport_error_and_an_http_error_is_not() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    refused = _stream(httpx.MockTransport(refuse))
    assert not refused.ok and refused.is_transport_error
    unavailable = _stream(httpx.MockTransport(lambda _: httpx.Response(503, json={})))
    assert not unavailable.ok and not unavailable.is_transport_error


def _turn(
    session: str, turn: int, prompt_len: int, answer_len: int, cached: int, router: int,
    start_s: float, prefill_computed: int = 1,
) -> TurnRecord:  # fmt: skip
    kv = KVUsage(prefill_computed, 0, 0)
    res = RequestResult(ok=True, token_ids=[7] * answer_len, cached_tokens=cached, kv=kv)
    return TurnRecord(session, turn, [1] * prompt_len, answer_len,
                      [Attempt(router, start_s, start_s + 1.0, res)])  # fmt: skip


def test_duplex_hits_group_turns_by_what_came_between_them_and_the_previous_one() -> None:
    both = Membership([(0.0, [P0, P1]), (50.0, [P0])])
    moved = next(s for s in (f"s{i}" for i in range(100)) if rendezvous_choice(s, [P0, P1]) == P1)
    stays = next(s for s in (f"s{i}" for i in range(100)) if rendezvous_choice(s, [P0, P1]) == P0)
    turns = [
        # 1. turn 1 via the other router, all of the returnable answer cached: 10 + 8 - 1
        #    tokens, up to a block of 4: 16, of which 6 are the answer's.
        _turn(stays, 0, 10, 8, 0, 0, 1.0),
        _turn(stays, 1, 20, 8, 16, 1, 5.0),
        # 2. turn 2 via the same router, 2 of the 4 returnable (20 + 8 - 1 -> 24, from 20)
        _turn(stays, 2, 30, 8, 22, 1, 9.0),
        # 3. the drain moved the session's prefill: nothing of the answer there
        _turn(moved, 0, 10, 8, 0, 0, 40.0),
        _turn(moved, 1, 20, 8, 8, 1, 55.0),
        # 4. decode computed turn 1 (cached: its own), then turn 2 found nothing
        _turn("d", 0, 10, 8, 0, 0, 1.0),
        _turn("d", 1, 20, 8, 18, 1, 5.0, prefill_computed=0),
        _turn("d", 2, 30, 8, 8, 0, 9.0),
    ]
    hits = duplex_hits(turns, BS, both)
    other = hits["previous turn via the other router"]
    assert (other.num_turns, other.num_full, other.num_hit_tokens, other.num_returnable_tokens) == (
        1, 1, 6, 6,
    )  # fmt: skip
    same = hits["previous turn via the same router"]
    assert (same.num_turns, same.num_full, same.rate) == (1, 0, 2 / 4)
    assert hits["session's prefill changed (drain)"].num_hit_tokens == 0
    assert hits["session's prefill changed (drain)"].num_turns == 1
    assert hits["decode computed the prompt"].num_turns == 1
    assert hits["decode computed the previous turn's prompt"].num_turns == 1


def _failed(error: str = "ReadError()") -> RequestResult:
    return RequestResult(ok=False, error=error, is_transport_error=True)


def test_failures_are_told_apart_by_whether_they_were_in_flight_at_the_kill() -> None:
    done = RequestResult(ok=True)
    turns = [
        # in flight on router 1 at the kill (t=10), completed on router 0
        TurnRecord("a", 0, [1], 1, [Attempt(1, 9.0, 10.5, _failed()), Attempt(0, 10.5, 11, done)]),
        # in flight at the kill, and router 0 failed it too
        TurnRecord("b", 0, [1], 1, [Attempt(1, 9.5, 10.1, _failed()), Attempt(0, 10.1, 11, _failed())]),
        # sent to router 1 after the kill: refused, completed on router 0
        TurnRecord("c", 0, [1], 1, [Attempt(1, 12.0, 12.0, _failed()), Attempt(0, 12.0, 13, done)]),
        # a failure on router 0 that has nothing to do with the kill
        TurnRecord("d", 0, [1], 1, [Attempt(0, 5.0, 6.0, RequestResult(ok=False, error="HTTP 500"))]),
        # ended on router 1 just before the kill
        TurnRecord("e", 0, [1], 1, [Attempt(1, 8.0, 9.9, done)]),
    ]  # fmt: skip
    f = failures(turns, killed_router=1, kill_s=10.0)
    assert (f.num_in_flight_at_kill, f.num_in_flight_completed) == (2, 1)
    assert (f.num_refused_after_kill, f.num_retried_other) == (1, 0)
    assert [e.split(":")[0] for e in f.failed_in_flight] == ["b turn 0"]
    assert [e.split(":")[0] for e in f.failed_other] == ["d turn 0"]
    assert failures(turns, killed_router=None, kill_s=None).num_in_flight_at_kill == 0


def _observed(turns: list[TurnRecord], in_use: int = 0) -> Observed:
    both = Membership([(0.0, [P0, P1])])
    pool = {"integrity_ok": True, "num_in_use": in_use, "num_running": 0, "num_waiting": 0}
    returns = {"decode-0": {"num_done": 3, "num_failed": 1, "num_declined": 0}}
    tl = Timeline(drain_exit_code=0, join_published_s=0.0)
    return Observed(
        turns, Labels(("router-0", "router-1"), 1, "decode-2", "prefill-1"), tl,
        duplex_hits(turns, BS, both), failures(turns, 1, None), {"decode-2": turns[:1]},
        {"decode-0": pool}, 0.5, returns, {"has_all": 0.0, "no_room": 1.0},
    )  # fmt: skip


def test_the_report_meets_its_bars_only_when_every_one_holds() -> None:
    turns = [_turn("s", 0, 10, 8, 0, 0, 1.0), _turn("s", 1, 20, 8, 16, 1, 5.0)]
    for t in turns:
        t.is_exact = True
    table, is_ok = format_report("run", _observed(turns))
    assert is_ok and "| NO |" not in table
    assert (
        "| duplex returns offered by decode: done, failed, declined (why) |  | 3, 1, 0; no_room 1 |  |"
        in table
    )

    turns[1].is_exact = False  # a wrong token
    table, is_ok = format_report("run", _observed(turns))
    assert not is_ok
    assert "| completed turns not token-exact against the reference | 0 | 1 | NO |" in table
    turns[1].is_exact = True
    _, is_ok = format_report("run", _observed(turns, in_use=2))  # a leaked block
    assert not is_ok
