"""Transfers that fail at their deadline but land afterwards (the fake's late
transfers, landing garbage as stale KV from a reused block would): no block is
reused, recomputed into, or cached while a transfer into it may still land, and
every answer stays token-exact.

P and D are stepped in one thread (`tests.unit.flow_sim`): deadlines, quarantines
and late landings run on its clock; the check of each late landing's target blocks
(`Sim.late_problems`) runs just before the copy."""

from __future__ import annotations

from typing import Any

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.kvflow.flow_io import TearDownEndpoint
from kvduplex.kvflow.messages import KVFailed
from kvduplex.model.loader import LoadedModel
from kvduplex.transport import handshake
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.messages import MessageCodec
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim
from tests.unit.test_retained_turns import _turn


def _answered(s: Sim, xid: str) -> bool:
    """Both P's prefill and D's request of push ``xid`` finished."""
    return s.finished(xid) and s.finished(f"d-{xid}")


def test_a_push_write_that_lands_after_its_deadline_is_waited_for(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's WRITE fails at its own deadline but may still land: P keeps its source
    blocks and tells D nothing until it has landed; D then computes the prompt over
    the garbage that landed, and answers right."""
    s = Sim(tiny, monkeypatch, wait_s=30, transfer_timeout_s=0.3, quarantine_s=30)
    s.tp.land_late_next(None, corrupt=True)
    s.push("xl")
    s.run(lambda: s.tp.num_late() == 1)  # the late WRITE
    # The WRITE failed, yet it may land: nobody may act as if it cannot.
    assert s.df.push.stats.num_fallbacks == 0 and s.df.receiver.is_waiting("xl")
    assert s.pf.sender.num_jobs() == 1, "P keeps the job until the WRITE settles"
    assert s.in_use(s.p) > 0, "P keeps the WRITE's source blocks"
    assert s.tp.land_late() == 1
    assert s.late_problems == [], "it landed in blocks still reserved for it"
    s.run(lambda: _answered(s, "xl"))
    assert s.outputs["d-xl"] == _reference(tiny)
    assert s.df.push.stats.num_fallbacks == 1 and s.pf.sender.stats.num_failed == 1
    s.assert_clean()


def test_a_write_landing_after_decode_gave_up_finds_its_blocks_quarantined(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's wait ends first: D computes the prompt into fresh blocks and keeps the
    registered ones until P confirms that its late WRITE can no longer land."""
    s = Sim(tiny, monkeypatch, wait_s=0.4, transfer_timeout_s=30, quarantine_s=30)
    s.tp.land_late_next(None, corrupt=True)
    s.push("xq")
    s.run(lambda: s.finished("d-xq"))  # falls back at its deadline, answers
    assert s.outputs["d-xq"] == _reference(tiny)
    s.run(lambda: s.tp.num_late() == 1)  # the late WRITE
    assert s.df.receiver.is_waiting("xq"), "registered blocks quarantined"
    assert s.tp.land_late() == 1
    assert s.late_problems == [], "it landed in blocks still reserved for it"
    s.run(lambda: s.finished("xq"))
    assert s.df.push.stats.num_fallbacks == 1
    s.run(lambda: not s.df.receiver.is_waiting("xq"))  # P's KVFailed ends the quarantine
    s.assert_clean()


def test_a_write_that_never_settles_gets_its_endpoint_torn_down(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL never lets go of P's failed WRITE: P tears its endpoint with D down a
    transfer deadline later, which settles it; D's quarantine ends the same way."""
    s = Sim(tiny, monkeypatch, wait_s=0.4, transfer_timeout_s=0.3, quarantine_s=0.6)
    s.tp.land_late_next(None, corrupt=True)
    s.push("xt")
    s.run(lambda: _answered(s, "xt"))
    assert s.outputs["d-xt"] == _reference(tiny)
    s.run(lambda: not s.tp.is_connected(s.td.engine_id))  # P tears the endpoint down
    assert s.tp.num_late() == 0 and s.tp.land_late() == 0, "torn down: nothing lands"
    s.run(lambda: not s.df.receiver.is_waiting("xt"))  # D's quarantine ends
    s.assert_clean()


def test_a_pull_read_that_lands_after_its_deadline_never_reaches_the_answer(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's READ fails at its deadline while it may still land: D computes the prompt
    into fresh blocks and keeps the READ's targets until it has landed."""
    s = Sim(tiny, monkeypatch, wait_s=0.3, transfer_timeout_s=0.3, quarantine_s=1.0)
    s.pull("xr")
    s.run(lambda: s.finished("xr"))
    s.td.land_late_next(None, corrupt=True)
    s.pull_decode("xr")
    s.run(lambda: s.finished("d-xr"))
    assert s.outputs["d-xr"] == _reference(tiny, PROMPT)
    assert s.td.num_late() == 1
    assert s.td.land_late() == 1
    assert s.late_problems == [], "it landed in blocks still reserved for it"
    s.run(lambda: s.in_use(s.d) == 0)  # D's pool empties
    s.d.check_integrity()


def test_decode_falling_back_continues_from_prefills_first_token(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P sampled the first token (the router streams it to the client at once), then
    its WRITE failed: KVFailed carries that token and D's own prefill continues from
    it instead of sampling another (unseeded sampling would differ almost surely)."""
    hot = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    s = Sim(tiny, monkeypatch, wait_s=30, transfer_timeout_s=0.3)
    for trial in range(3):
        xid = f"xf{trial}"
        s.tp.land_late_next(0.05)
        s.push(xid, PROMPT, hot, p_params=SamplingParams(max_tokens=1, temperature=1.0))
        s.run(lambda xid=xid: _answered(s, xid))  # type: ignore[misc]
        p_out, d_out = s.outputs[xid], s.outputs[f"d-{xid}"]
        assert len(p_out) == 1 and len(d_out) == 4
        assert d_out[0] == p_out[0], "D's answer starts with the token the client has"
    assert s.df.push.stats.num_fallbacks == 3 and s.df.push.stats.num_received == 0
    s.assert_clean()


def test_a_pull_read_that_never_settles_gets_its_endpoint_torn_down(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, wait_s=0.3, transfer_timeout_s=0.3, quarantine_s=1.0)
    s.pull("xn")
    s.run(lambda: s.finished("xn"))
    s.td.land_late_next(None)  # NIXL never lets go of it
    s.pull_decode("xn")
    s.run(lambda: s.finished("d-xn"))
    assert s.outputs["d-xn"] == _reference(tiny, PROMPT)
    s.run(lambda: not s.td.is_connected(s.tp.engine_id))  # D tears the endpoint down
    assert s.td.num_late() == 0
    s.run(lambda: s.in_use(s.d) == 0)  # D's pool empties


def test_a_retained_turn_read_ends_within_decodes_pin(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's READ of a retained turn gets at most the pin's time left: a READ that hangs
    fails then, and nothing is cached."""
    s = Sim(tiny, monkeypatch)
    _turn(s, "rt1", "s9")
    info = s.df.retainer.describe("s9")
    assert info is not None and info["pin_s"] == s.df.retainer.pin_s
    s.tp.hang_next()
    t0 = s.clock.now
    done = s.pf.reader.start(
        s.d_peer, "rt1-read", info["block_ids"], info["keys"], info["token_ids"], 0.2
    )
    s.run(done.done)
    assert done.result(0) == 0
    assert s.clock.now - t0 < s.pf.reader.deadline_s, "the pin's bound, not the reader's"


def _is_failed(payload: bytes) -> bool:
    return isinstance(MessageCodec().decode(payload), KVFailed)


def _hung_push_unconfirmed(s: Sim, tiny: LoadedModel, xid: str, num_lost: int = 2) -> None:
    """A push whose WRITE hangs past D's wait, and P's confirmations (the job failed;
    D's cancel) are lost on the way: D answers by its own prefill, its registered
    blocks quarantined."""
    s.tp.hang_next()  # P's WRITE never ends before D gives up
    for _ in range(num_lost):
        s.tp.drop_next_notif(_is_failed)
    s.push(xid)
    s.run(lambda: _answered(s, xid))
    assert s.outputs[f"d-{xid}"] == _reference(tiny)


def test_unconfirmed_quarantine_is_held_and_the_sender_asked_again(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our own teardown would not stop the sender's one-sided WRITEs: a quarantine
    the sender never confirmed is held, and the sender asked again, until it answers."""
    s = Sim(tiny, monkeypatch, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3)
    s.df.receiver.peer_gone = lambda _engine_id: False
    _hung_push_unconfirmed(s, tiny, "xh")
    s.run(lambda: s.df.receiver.stats.num_quarantine_asks >= 1)  # D asks P again
    s.run(lambda: not s.df.receiver.is_waiting("xh"))  # P's answer to the asking
    assert s.df.receiver.stats.num_teardowns == 0, "released on P's word, not a timer"
    s.assert_clean()


def test_quarantine_of_a_gone_sender_is_released(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3)
    s.df.receiver.peer_gone = lambda _engine_id: True
    _hung_push_unconfirmed(s, tiny, "xk")
    s.run(lambda: s.df.receiver.stats.num_teardowns == 1)  # D gives the blocks up
    assert s.df.receiver.stats.num_quarantine_asks == 0


def test_the_receivers_teardown_runs_off_the_engine_thread(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL's disconnect takes its locks: D's teardown of a gone sender's endpoint goes
    to the flow I/O thread (a `TearDownEndpoint` request), as the sender's and the
    READ's do; the engine thread never disconnects itself."""
    s = Sim(tiny, monkeypatch, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3)
    s.df.receiver.peer_gone = lambda _engine_id: True
    on_flow_io: list[bool] = []
    disconnect = s.td.disconnect

    def recording(peer: Any) -> None:
        on_flow_io.append(s.in_flow_io)
        disconnect(peer)

    s.td.disconnect = recording  # type: ignore[method-assign]
    _hung_push_unconfirmed(s, tiny, "xt")
    s.run(lambda: s.df.receiver.stats.num_teardowns == 1)  # D gives the blocks up
    s.run(lambda: bool(on_flow_io))  # the endpoint torn down
    assert all(on_flow_io), "disconnected outside the flow I/O thread's work"
    assert any(
        isinstance(r, TearDownEndpoint) and r.peer.engine_id == s.tp.engine_id for r in s.io_log
    ), "D's teardown of P's endpoint was a request to the flow I/O thread"


def test_quarantine_of_a_sender_restarted_at_its_url_is_released(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P dies without confirming and restarts at the same URL; D's directory adopts the
    new engine there (the next request names it) before D asks about the old one
    again. The old engine is gone all the same: its quarantined blocks go back."""
    url = "http://p"
    s = Sim(tiny, monkeypatch, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3)
    answering = {"info": s.tp.local_metadata()}  # what answers a handshake at the URL
    monkeypatch.setattr(handshake, "fetch_handshake", lambda *_a, **_k: answering["info"])
    directory = PeerDirectory(s.td)
    assert directory.get_peer(url).engine_id == s.tp.engine_id
    s.df.receiver.peer_gone = directory.is_gone  # as the instance wires them
    s.df.receiver.reconnect = directory.reconnect
    _hung_push_unconfirmed(s, tiny, "xr", num_lost=100)  # P, about to die, never confirms
    assert s.df.receiver.is_waiting("xr"), "quarantined while P lives"
    restarted = s.fabric.endpoint(s.p.kv_pool, s.p.layout)
    answering["info"] = restarted.local_metadata()
    s.tp.close()
    assert directory.get_peer(url, restarted.engine_id).engine_id == restarted.engine_id
    s.run(lambda: not s.df.receiver.is_waiting("xr"))  # D gives the blocks up
    assert s.df.receiver.stats.num_teardowns == 1
    s.run(lambda: s.in_use(s.d) == 0)  # D's pool empties
