"""Push registrations over the in-process transport: re-sent until prefill acknowledges
them, refused at once (decode falls back without waiting out its deadline), and
deadlines that travel as durations, so that the hosts' wall clocks never matter."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import MessageCodec
from tests.unit.flow_pair import BS
from tests.unit.flow_pair import FIRST
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture


def _is_registration(payload: bytes) -> bool:
    return isinstance(MessageCodec().decode(payload), KVRegister)


def test_a_lost_registration_is_sent_again_and_the_push_lands(tiny: LoadedModel) -> None:
    """D's first KVRegister is lost on the way: D sends it again a third of its wait
    later (P had not acknowledged it), P writes, D decodes from P's KV."""
    with Pair(tiny, wait_s=1.5) as s:
        s.td.drop_next_notif(_is_registration)

        async def both() -> tuple[list[int], list[int]]:
            return await asyncio.gather(s.prefill("lost"), s.decode("lost"))

        p_out, d_out = asyncio.run(both())
        assert d_out == _reference(tiny) and p_out == d_out[:1]
        assert s.td.num_notifs_dropped == 1
        assert s.df.receiver.stats.num_registrations_resent >= 1
        assert s.push.stats.num_received == 1 and s.push.stats.num_fallbacks == 0
        assert s.sender.stats.num_done == 1
        s.assert_clean()


def test_a_lost_acknowledgement_makes_a_copy_that_is_answered_again(
    tiny: LoadedModel,
) -> None:
    """P's KVRegistered is lost (D registered before P's job began): D sends the
    registration again, P answers the copy, and the push lands once P's job starts."""
    with Pair(tiny, wait_s=1.5) as s:
        s.tp.drop_next_notif(lambda p: isinstance(MessageCodec().decode(p), KVRegistered))
        receiver = s.df.receiver

        async def decode_first() -> list[int]:
            d = asyncio.ensure_future(s.decode("copy"))
            await asyncio.to_thread(
                _wait_for, lambda: receiver.stats.num_registrations_resent >= 1, "a re-send"
            )
            await s.prefill("copy")
            return await d

        assert asyncio.run(decode_first()) == _reference(tiny)
        assert s.tp.num_notifs_dropped == 1
        assert s.push.stats.num_received == 1 and s.push.stats.num_fallbacks == 0
        assert s.sender.stats.num_written_blocks == len(PROMPT) // BS + 1  # 5, once each
        s.assert_clean()


def test_a_duplicate_registration_is_acknowledged_again_and_applied_once(
    tiny: LoadedModel,
) -> None:
    """A copy of a registration P already applied (its acknowledgement crossed D's
    re-send) is answered again and changes nothing; nor does a heartbeat echo from
    the future."""
    with Pair(tiny, wait_s=5.0) as s:
        acks: list[tuple[str, str]] = []
        s.pumps[1].on(KVRegistered, lambda msg, sender: acks.append((msg.xid, sender)))
        s.ap.call(lambda _e: s.sender.expect("dup", s.d_peer, len(PROMPT))).result(5)
        reg = KVRegister("dup", [1, 2, 3, 4, 5], 0, len(PROMPT), 5.0, 5.0)
        for _ in range(2):
            s.td.send_notif(s.p_peer, MessageCodec().encode(reg), "dup")
        _wait_for(lambda: len(acks) == 2, "both acknowledgements")
        assert acks == [("dup", s.tp.engine_id)] * 2
        assert s.sender._jobs["dup"].reg == reg
        assert s.sender.stats.num_registrations_refused == 0
        # An acknowledged heartbeat moves P's deadline by the wait from when P sent it, on
        # P's own clock: an echo claiming a later time than P's now moves it no further.
        codec = MessageCodec()
        s.td.send_notif(s.p_peer, codec.encode(KVAliveAck("dup", time.monotonic() + 3600)), "dup")
        s.td.send_notif(s.p_peer, codec.encode(reg), "dup")  # answered after the echo
        _wait_for(lambda: len(acks) == 3, "the third acknowledgement")
        assert s.sender._jobs["dup"].expires_at <= time.monotonic() + reg.wait_s
        assert s.ap.call(lambda _e: s.sender.cancel("dup", "test")).result(5)
        s.assert_clean()


@pytest.mark.parametrize("refusal", ["sizes", "cancelled"])
def test_a_refused_registration_makes_decode_fall_back_at_once(
    tiny: LoadedModel, refusal: str
) -> None:
    """P refuses D's registration (its job counts other tokens, or P cancelled the xid
    before D registered): P tells D, and D computes the prompt itself at once, in the
    blocks it registered (nothing was written there), long before its 30 s wait."""
    with Pair(tiny, wait_s=30.0) as s:
        xid = f"refused-{refusal}"
        t0 = time.monotonic()

        async def run() -> list[int]:
            if refusal == "cancelled":
                s.ap.call(lambda _e: s.sender.cancel(xid, "prefill failed")).result(5)
                return await s.decode(xid)

            async def prefill() -> None:
                request = Request(xid, PROMPT, FIRST, hold_blocks_on_finish=True)
                # P's job counts one block more than D's prompt: sizes differ.
                expect = lambda: s.sender.expect(xid, s.d_peer, len(PROMPT) + BS)  # noqa: E731
                async for _ in s.ap.generate(request, on_admit=expect):
                    pass

            out, _ = await asyncio.gather(s.decode(xid), prefill())
            return out

        assert asyncio.run(run()) == _reference(tiny)
        assert time.monotonic() - t0 < 10.0, "D waited for its deadline"
        assert s.sender.stats.num_registrations_refused == 1
        assert s.push.stats.num_fallbacks == 1 and s.push.stats.num_received == 0
        assert s.df.receiver.stats.num_failed == 1
        s.assert_clean()


@pytest.mark.parametrize("skew_s", [60.0, -60.0])
def test_clock_skew_between_prefill_and_decode_costs_no_push(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, skew_s: float
) -> None:
    """D's wall clock is a minute ahead of (or behind) P's: every push still lands."""
    real = time.time
    with Pair(tiny, wait_s=2.0) as s:
        decode_threads = {s.ad._thread, *(p._thread for p in s.pumps[1:])}

        def skewed() -> float:
            return real() + (skew_s if threading.current_thread() in decode_threads else 0.0)

        monkeypatch.setattr(time, "time", skewed)

        async def pushes() -> list[list[int]]:
            outs = []
            for i in range(3):
                _, out = await asyncio.gather(s.prefill(f"skew-{i}"), s.decode(f"skew-{i}"))
                outs.append(out)
            return outs

        assert asyncio.run(pushes()) == [_reference(tiny)] * 3
        assert s.push.stats.num_received == 3 and s.push.stats.num_fallbacks == 0
        assert s.sender.stats.num_done == 3 and s.sender.stats.num_failed == 0
        s.assert_clean()
