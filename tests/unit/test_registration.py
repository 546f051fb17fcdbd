"""Push registrations over the in-process transport: re-sent until prefill acknowledges
them, refused at once (decode falls back without waiting out its deadline), and
deadlines that travel as durations, so that the hosts' wall clocks never matter.

P and D are stepped in one thread on a fake clock (`tests.unit.flow_sim`)."""

from __future__ import annotations

import time

import pytest

from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.kvflow.messages import ids_digest
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import MessageCodec
from tests.unit.flow_common import BS
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim


def _is_registration(payload: bytes) -> bool:
    return isinstance(MessageCodec().decode(payload), KVRegister)


def _answered(s: Sim, xid: str) -> bool:
    return s.finished(xid) and s.finished(f"d-{xid}")


def test_a_lost_registration_is_sent_again_and_the_push_lands(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's first KVRegister is lost on the way: D sends it again a third of its wait
    later (P had not acknowledged it), P writes, D decodes from P's KV."""
    s = Sim(tiny, monkeypatch, wait_s=1.5)
    s.td.drop_next_notif(_is_registration)
    s.push("lost")
    s.run(lambda: _answered(s, "lost"))
    p_out, d_out = s.outputs["lost"], s.outputs["d-lost"]
    assert d_out == _reference(tiny) and p_out == d_out[:1]
    assert s.td.num_notifs_dropped == 1
    assert s.df.receiver.stats.num_registrations_resent >= 1
    assert s.df.push.stats.num_received == 1 and s.df.push.stats.num_fallbacks == 0
    assert s.pf.sender.stats.num_done == 1
    s.assert_clean()


def test_a_lost_acknowledgement_makes_a_copy_that_is_answered_again(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's KVRegistered is lost (D registered before P's job began): D sends the
    registration again, P answers the copy, and the push lands once P's job starts."""
    s = Sim(tiny, monkeypatch, wait_s=1.5)
    s.tp.drop_next_notif(lambda p: isinstance(MessageCodec().decode(p), KVRegistered))
    receiver = s.df.receiver
    s.push_decode("copy")
    s.run(lambda: receiver.stats.num_registrations_resent >= 1)  # a re-send
    s.push_prefill("copy")
    s.run(lambda: _answered(s, "copy"))
    assert s.outputs["d-copy"] == _reference(tiny)
    assert s.tp.num_notifs_dropped == 1
    assert s.df.push.stats.num_received == 1 and s.df.push.stats.num_fallbacks == 0
    assert s.pf.sender.stats.num_written_blocks == len(PROMPT) // BS + 1  # 5, once each
    s.assert_clean()


def test_a_duplicate_registration_is_acknowledged_again_and_applied_once(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a registration P already applied (its acknowledgement crossed D's
    re-send) is answered again and changes nothing; nor does a heartbeat echo from
    the future."""
    s = Sim(tiny, monkeypatch, wait_s=5.0)
    sender = s.pf.sender
    acks = s.intercept(s.td, KVRegistered)
    sender.expect("dup", s.d_peer, PROMPT)
    reg = KVRegister("dup", [1, 2, 3, 4, 5], 0, len(PROMPT), 5.0, 5.0, ids_digest(PROMPT))
    for _ in range(2):
        s.td.send_notif(s.p_peer, MessageCodec().encode(reg), "dup")
    s.run(lambda: len(acks) == 2)  # both acknowledgements
    assert [(m.xid, sender_id) for m, sender_id in acks] == [("dup", s.tp.engine_id)] * 2
    assert sender._jobs["dup"].reg == reg
    assert sender.stats.num_registrations_refused == 0
    # An acknowledged heartbeat moves P's deadline by the wait from when P sent it, on
    # P's own clock: an echo claiming a later time than P's now moves it no further.
    codec = MessageCodec()
    s.td.send_notif(s.p_peer, codec.encode(KVAliveAck("dup", s.clock.now + 3600)), "dup")
    s.td.send_notif(s.p_peer, codec.encode(reg), "dup")  # answered after the echo
    s.run(lambda: len(acks) == 3)  # the third acknowledgement
    assert sender._jobs["dup"].expires_at <= s.clock.now + reg.wait_s
    assert sender.cancel("dup", "test")
    s.assert_clean()


@pytest.mark.parametrize("refusal", ["sizes", "cancelled"])
def test_a_refused_registration_makes_decode_fall_back_at_once(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """P refuses D's registration (its job counts other tokens, or P cancelled the xid
    before D registered): P tells D, and D computes the prompt itself at once, in the
    blocks it registered (nothing was written there), long before its 30 s wait."""
    s = Sim(tiny, monkeypatch, wait_s=30.0)
    xid = f"refused-{refusal}"
    t0 = s.clock.now
    if refusal == "cancelled":
        s.pf.sender.cancel(xid, "prefill failed")
        s.push_decode(xid)
        s.run(lambda: s.finished(f"d-{xid}"))
    else:
        s.push_decode(xid)
        # P's job counts one block more than D's prompt: sizes differ.
        s.pf.sender.expect(xid, s.d_peer, [*PROMPT, *range(BS)])
        s.p.add_request(Request(xid, PROMPT, FIRST, hold_blocks_on_finish=True))
        s.run(lambda: _answered(s, xid))
    assert s.outputs[f"d-{xid}"] == _reference(tiny)
    assert s.clock.now - t0 < 10.0, "D waited for its deadline"
    assert s.pf.sender.stats.num_registrations_refused == 1
    assert s.df.push.stats.num_fallbacks == 1 and s.df.push.stats.num_received == 0
    assert s.df.receiver.stats.num_failed == 1
    s.assert_clean()


@pytest.mark.parametrize("skew_s", [60.0, -60.0])
def test_clock_skew_between_prefill_and_decode_costs_no_push(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, skew_s: float
) -> None:
    """D's wall clock is a minute ahead of (or behind) P's: every push still lands."""
    real = time.time
    s = Sim(tiny, monkeypatch, wait_s=2.0)

    def skewed() -> float:  # what D's threads (its engine, its pump) read
        return real() + (skew_s if s.on is s.d else 0.0)

    def sim_skewed() -> float:  # the same, on the sim's clock (the flow modules')
        return s.clock.now + (skew_s if s.on is s.d else 0.0)

    monkeypatch.setattr(time, "time", skewed)
    monkeypatch.setattr(s.clock, "time", sim_skewed)
    for i in range(3):
        s.push(f"skew-{i}")
        s.run(lambda i=i: _answered(s, f"skew-{i}"))  # type: ignore[misc]
        assert s.outputs[f"d-skew-{i}"] == _reference(tiny)
    assert s.df.push.stats.num_received == 3 and s.df.push.stats.num_fallbacks == 0
    assert s.pf.sender.stats.num_done == 3 and s.pf.sender.stats.num_failed == 0
    s.assert_clean()
