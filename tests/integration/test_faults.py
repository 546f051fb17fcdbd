"""Faults on real processes: P or D killed with SIGKILL, or restarted at the same
address (a new engine id), at moments of a request's life.

Requests go through ``kvduplex router --mode push``; the duplex return is driven
directly, as the router drives it. Each test checks that every request in
flight either completes with the colocated instance's tokens or fails with an
OpenAI error (or, for a stream whose own server died, a cut connection) within
a bound; that the survivor keeps serving while the other is
down; that the restarted process is handshaken afresh (the next request's KV is
pushed, not recomputed); and that every pool passes its integrity check and
holds no request blocks. Counts per fault and moment are printed at the end.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from kvduplex.cluster import LocalCluster
from tests.integration.conftest import kv_stats
from tests.integration.faults import REQUEST_BOUND_S
from tests.integration.faults import Outcome
from tests.integration.faults import Rig
from tests.integration.faults import Tally
from tests.integration.faults import Victim
from tests.integration.faults import blocks_left
from tests.integration.faults import body
from tests.integration.faults import duplex_turn
from tests.integration.faults import open_tally
from tests.integration.faults import poll
from tests.integration.faults import prompt_ids
from tests.integration.faults import reference_tokens
from tests.integration.faults import start_rig
from tests.integration.faults import stats
from tests.integration.faults import write_bytes
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

FAULT = {"D": "D killed (SIGKILL)", "P": "P killed (SIGKILL)"}
PUSH_STATS = "/internal/kv/push/stats"
RETURN_STATS = "/internal/kv/return/stats"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "trial" in metafunc.fixturenames:  # --fault-trials N repeats each fault and moment
        metafunc.parametrize("trial", range(metafunc.config.getoption("fault_trials")))


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    title = "Faults on real processes (tests/integration/test_faults.py)"
    yield from open_tally(request, title, "fault-counts")


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster, reference: str) -> Iterator[Rig]:
    r = start_rig(cluster, reference, "faults")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def salts() -> Iterator[int]:
    return itertools.count(1000)


def _record(rig: Rig, tally: Tally, fault: str, moments: dict[Victim, str], *, lost: bool) -> None:
    """Wait for every victim (bounded) and count their outcomes. ``lost``: the process
    that streams their answers (D) died, so they fail: with an OpenAI error from the
    router (502) unless the answer was already streaming (then the connection is cut).
    Otherwise each completes with the right tokens (D computes a prompt P did not send)."""
    for v in moments:
        v.done.wait(REQUEST_BOUND_S)
    for v, moment in moments.items():
        outcome = v.outcome(reference_tokens(rig.reference, v.body))
        tally.add(fault, moment, outcome, v.elapsed_s)
        assert outcome not in (Outcome.WRONG, Outcome.HUNG), (moment, v.error, v.tokens)
        if not lost:
            assert outcome is Outcome.COMPLETED, (moment, v.error)
        elif not v.body.get("stream"):
            assert outcome is Outcome.ERROR and v.status == 502, (moment, v.status, v.error)


def _survivor_serves(rig: Rig, killed: str, salt: int) -> None:
    """While one is down, the other still answers exactly: the router's requests (D
    computes the prompt itself) when P is down, P's own API when D is."""
    url = rig.url if killed == "P" else rig.p.url
    v = Victim(url, body(prompt_ids(30, salt), 6)).start()
    v.done.wait(REQUEST_BOUND_S)
    assert v.outcome(reference_tokens(rig.reference, v.body)) is Outcome.COMPLETED, v.error


def _pushed_afresh(rig: Rig, salt: int) -> None:
    """The next request's KV is pushed (not recomputed): P and D handshook anew."""
    before = stats(rig.d.url, PUSH_STATS)
    v = Victim(rig.url, body(prompt_ids(40, salt), 6)).start()
    v.done.wait(REQUEST_BOUND_S)
    assert v.outcome(reference_tokens(rig.reference, v.body)) is Outcome.COMPLETED, v.error
    after = stats(rig.d.url, PUSH_STATS)
    assert after["num_received"] == before["num_received"] + 1, (before, after)
    assert after["num_fallbacks"] == before["num_fallbacks"], (before, after)


def _recover(
    rig: Rig, tally: Tally, fault: str, moments: list[str], killed: str, salt: int
) -> None:
    survivor = "D" if killed == "P" else "P"
    leaked = blocks_left(rig.proc(survivor).url)
    _survivor_serves(rig, killed, salt)
    rig.restart(killed)
    _pushed_afresh(rig, salt + 1)
    leaked += sum(blocks_left(proc.url) for proc in (rig.p, rig.d))
    for moment in moments:
        tally.leaked(fault, moment, leaked)
    assert leaked == 0


@pytest.mark.parametrize("role", ["D", "P"])
def test_kill_while_requests_are_queued_prefilled_and_decoded(
    rig: Rig, tally: Tally, salts: Iterator[int], role: str, trial: int
) -> None:
    """Three requests at once: one decoding on D, one whose long prefill P is computing
    (its KV streaming to D layer by layer), one queued on P behind it."""
    # 2,400 tokens: still decoding when the polls below are done (1,200 had ended on a
    # fast core, in 1.5 s).
    decoding = Victim(rig.url, body(prompt_ids(24, next(salts)), 2400, stream=True)).start()
    poll(lambda: len(decoding.tokens) >= 3, "a request decoding on D")
    written = write_bytes(rig.p.url)
    # 3,200 tokens at P's 4 a step: a prefill long enough (~800 steps) for the polls below.
    prefilling = Victim(rig.url, body(prompt_ids(3200, next(salts)), 4)).start()
    poll(lambda: kv_stats(rig.p.url)["num_running"] == 1, "a long prefill on P")
    queued = Victim(rig.url, body(prompt_ids(400, next(salts)), 4)).start()
    poll(lambda: kv_stats(rig.p.url)["num_waiting"] == 1, "a request queued on P")
    poll(lambda: write_bytes(rig.p.url) > written, "P streaming a long prefill's KV to D")
    st = kv_stats(rig.p.url)
    assert st["num_running"] == 1 and st["num_waiting"] == 1, st  # the moments hold
    assert not decoding.done.is_set()
    rig.kill(role)
    moments = {
        decoding: "mid-decode", prefilling: "mid-prefill, KV streaming (mid-WRITE)",
        queued: "queued on P (before admission)",
    }  # fmt: skip
    _record(rig, tally, FAULT[role], moments, lost=role == "D")
    _recover(rig, tally, FAULT[role], list(moments.values()), role, next(salts))


@pytest.mark.parametrize("role", ["D", "P"])
def test_kill_right_after_the_first_token(
    rig: Rig, tally: Tally, salts: Iterator[int], role: str, trial: int
) -> None:
    v = Victim(rig.url, body(prompt_ids(200, next(salts)), 500, stream=True)).start()
    assert v.first_token.wait(REQUEST_BOUND_S), v.error
    num_seen = len(v.tokens)
    rig.kill(role)
    moment = "after the first token" if num_seen == 1 else "mid-decode"
    _record(rig, tally, FAULT[role], {v: moment}, lost=role == "D")
    _recover(rig, tally, FAULT[role], [moment], role, next(salts))


def _return_state(rig: Rig, killed: str, p_before: dict, d_before: dict) -> str:
    """Where the turn's return was when the process died (read from the survivor)."""
    if killed == "D":
        p = stats(rig.p.url, RETURN_STATS)
        if p["num_received_blocks"] > p_before["num_received_blocks"]:
            return "the return had ended before the kill"
        if p["num_accepted"] > p_before["num_accepted"]:
            return "killed mid-return (P had registered its blocks)"
        return "killed before the offer reached P"
    ended = ("num_done", "num_failed", "num_declined")

    def num_ended(st: dict) -> int:
        return sum(st[k] for k in ended)

    poll(
        lambda: num_ended(stats(rig.d.url, RETURN_STATS)) > num_ended(d_before), "D's return to end"
    )
    d = stats(rig.d.url, RETURN_STATS)
    if d["num_done"] > d_before["num_done"]:
        return "the return had ended before the kill"
    return "killed mid-return (D's return failed)"


@pytest.mark.parametrize("role", ["D", "P"])
def test_kill_as_a_finished_turn_returns_to_prefill(
    rig: Rig, tally: Tally, salts: Iterator[int], role: str, trial: int
) -> None:
    """The turn's answer is complete; D is offering its blocks to P (or WRITEing them) when
    one of them dies. Nothing half-written may reach P's prefix cache: the session's next
    turn must still match the colocated instance."""
    salt = next(salts)
    session, history = f"ret-{role}-{trial}-{salt}", prompt_ids(120, salt)
    p_before, d_before = stats(rig.p.url, RETURN_STATS), stats(rig.d.url, RETURN_STATS)
    v = duplex_turn(rig, history, session, 100)
    rig.kill(role)
    moment = "mid-return (turn answered, KV going back to P)"
    _record(rig, tally, FAULT[role], {v: moment}, lost=False)  # the answer was out before
    tally.note(FAULT[role], moment, _return_state(rig, role, p_before, d_before))
    _recover(rig, tally, FAULT[role], [moment], role, next(salts))
    nxt = duplex_turn(rig, [*history, *v.tokens, *prompt_ids(9, salt + 1)], session, 8)
    assert nxt.outcome(reference_tokens(rig.reference, nxt.body)) is Outcome.COMPLETED, nxt.error
    for proc in (rig.p, rig.d):
        assert blocks_left(proc.url) == 0


@pytest.mark.parametrize("role", ["D", "P"])
def test_restart_between_requests_is_handshaken_afresh(
    rig: Rig, tally: Tally, salts: Iterator[int], role: str, trial: int
) -> None:
    """Stopped and started again at its address: the first request after it is pushed to
    or from the new engine, not to the connection of its previous life."""
    _pushed_afresh(rig, next(salts))
    rig.restart(role)
    v = Victim(rig.url, body(prompt_ids(33, next(salts)), 6)).start()
    v.done.wait(REQUEST_BOUND_S)
    tally.add(f"{role} restarted (new engine id)", "between requests",
              v.outcome(reference_tokens(rig.reference, v.body)), v.elapsed_s)  # fmt: skip
    _pushed_afresh(rig, next(salts))
    leaked = sum(blocks_left(proc.url) for proc in (rig.p, rig.d))
    tally.leaked(f"{role} restarted (new engine id)", "between requests", leaked)
    assert leaked == 0


def test_decode_restarted_at_once_never_gets_the_old_push(
    rig: Rig, tally: Tally, salts: Iterator[int], trial: int
) -> None:
    """D dies while P streams a long prefill's KV to it and comes back at once, while P
    still computes that prefill for the old engine: the new D gets only its own pushes."""
    written = write_bytes(rig.p.url)
    old = Victim(rig.url, body(prompt_ids(1600, next(salts)), 4)).start()
    poll(lambda: write_bytes(rig.p.url) > written, "P streaming KV to D")
    rig.kill("D")
    rig.restart("D")
    fault, moment = "D restarted at once (new engine id)", "mid-prefill, KV streaming (mid-WRITE)"
    _record(rig, tally, fault, {old: moment}, lost=True)
    news = [Victim(rig.url, body(prompt_ids(n, next(salts)), 5)).start() for n in (48, 96)]
    _record(rig, tally, fault, {v: "requests right after the restart" for v in news}, lost=False)
    d = stats(rig.d.url, PUSH_STATS)
    assert d["num_received"] + d["num_fallbacks"] == len(news)
    leaked = sum(blocks_left(proc.url) for proc in (rig.p, rig.d))
    tally.leaked(fault, moment, leaked)
    assert leaked == 0
    _pushed_afresh(rig, next(salts))
