"""Transfers that fail at their deadline but land afterwards (the fake's late
transfers, landing garbage as stale KV from a reused block would): no block is
reused, recomputed into, or cached while a transfer into it may still land, and
every answer stays token-exact."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.kvflow.messages import KVFailed
from kvduplex.model.loader import LoadedModel
from kvduplex.transport import handshake
from kvduplex.transport.base import Post
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.messages import MessageCodec
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import landing_problems
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture
from tests.unit.test_pull_connector import Setup as PullSetup


def _assert_reserved(engine: AsyncEngine, post: Post) -> None:
    assert landing_problems(engine, post) == []


def test_a_push_write_that_lands_after_its_deadline_is_waited_for(tiny: LoadedModel) -> None:
    """P's WRITE fails at its own deadline but may still land: P keeps its source
    blocks and tells D nothing until it has landed; D then computes the prompt over
    the garbage that landed, and answers right."""
    with Pair(tiny, wait_s=30, transfer_timeout_s=0.3, quarantine_s=30) as s:
        s.tp.land_late_next(None, corrupt=True)

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xl"))
            d = asyncio.create_task(s.decode("xl"))
            await asyncio.to_thread(_wait_for, lambda: s.tp.num_late() == 1, "the late WRITE")
            # The WRITE failed, yet it may land: nobody may act as if it cannot.
            assert s.push.stats.num_fallbacks == 0 and s.df.receiver.is_waiting("xl")
            assert s.sender.num_jobs() == 1, "P keeps the job until the WRITE settles"
            assert s.in_use(s.ap) > 0, "P keeps the WRITE's source blocks"
            landed = s.tp.land_late(
                lambda post: _assert_reserved(s.ad, post)
            )
            assert landed == 1
            await p
            return await d

        d_out = asyncio.run(run())
        assert d_out == _reference(tiny)
        assert s.push.stats.num_fallbacks == 1 and s.sender.stats.num_failed == 1
        s.assert_clean()


def test_a_write_landing_after_decode_gave_up_finds_its_blocks_quarantined(
    tiny: LoadedModel,
) -> None:
    """D's wait ends first: D computes the prompt into fresh blocks and keeps the
    registered ones until P confirms that its late WRITE can no longer land."""
    with Pair(tiny, wait_s=0.4, transfer_timeout_s=30, quarantine_s=30) as s:
        s.tp.land_late_next(None, corrupt=True)

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xq"))
            d_out = await s.decode("xq")  # falls back at its deadline, answers
            await asyncio.to_thread(_wait_for, lambda: s.tp.num_late() == 1, "the late WRITE")
            assert s.df.receiver.is_waiting("xq"), "registered blocks quarantined"
            landed = s.tp.land_late(
                lambda post: _assert_reserved(s.ad, post)
            )
            assert landed == 1
            await p
            return d_out

        d_out = asyncio.run(run())
        assert d_out == _reference(tiny)
        assert s.push.stats.num_fallbacks == 1
        _wait_for(lambda: not s.df.receiver.is_waiting("xq"), "P's KVFailed to end the quarantine")
        s.assert_clean()


def test_a_write_that_never_settles_gets_its_endpoint_torn_down(tiny: LoadedModel) -> None:
    """NIXL never lets go of P's failed WRITE: P tears its endpoint with D down a
    transfer deadline later, which settles it; D's quarantine ends the same way."""
    with Pair(tiny, wait_s=0.4, transfer_timeout_s=0.3, quarantine_s=0.6) as s:
        s.tp.land_late_next(None, corrupt=True)

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xt"))
            d_out = await s.decode("xt")
            await p
            return d_out

        assert asyncio.run(run()) == _reference(tiny)
        _wait_for(lambda: not s.tp.is_connected(s.td.engine_id), "P to tear the endpoint down")
        assert s.tp.num_late() == 0 and s.tp.land_late() == 0, "torn down: nothing lands"
        _wait_for(lambda: not s.df.receiver.is_waiting("xt"), "D's quarantine to end")
        s.assert_clean()


def test_a_pull_read_that_lands_after_its_deadline_never_reaches_the_answer(
    tiny: LoadedModel,
) -> None:
    """D's READ fails at its deadline while it may still land: D computes the prompt
    into fresh blocks and keeps the READ's targets until it has landed."""
    s = PullSetup(tiny, deadline_s=0.3)
    try:
        spec = s.prefill("xr")
        s.conn.submit(spec).result(5)
        s.td.land_late_next(None, corrupt=True)
        out = asyncio.run(s.decode("xr"))
        assert out == _reference(tiny, PROMPT)
        assert s.td.num_late() == 1
        assert s.td.land_late(
            lambda post: _assert_reserved(s.ad, post)
        ) == 1
        _wait_for(lambda: s.ad.call(lambda e: e.block_pool.stats().num_in_use).result(5) == 0,
                  "D's pool to empty")  # fmt: skip
        s.ad.call(lambda e: e.check_integrity()).result(5)
    finally:
        s.ad.shutdown()


def test_decode_falling_back_continues_from_prefills_first_token(tiny: LoadedModel) -> None:
    """P sampled the first token (the router streams it to the client at once), then
    its WRITE failed: KVFailed carries that token and D's own prefill continues from
    it instead of sampling another (unseeded sampling would differ almost surely)."""
    hot = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    with Pair(tiny, wait_s=30, transfer_timeout_s=0.3) as s:
        for trial in range(3):
            xid = f"xf{trial}"
            s.tp.land_late_next(0.05)

            async def run(xid: str = xid) -> tuple[list[int], list[int]]:
                return await asyncio.gather(
                    s.prefill(xid, PROMPT, SamplingParams(max_tokens=1, temperature=1.0)),
                    s.decode(xid, PROMPT, hot),
                )

            p_out, d_out = asyncio.run(run())
            assert len(p_out) == 1 and len(d_out) == 4
            assert d_out[0] == p_out[0], "D's answer starts with the token the client has"
        assert s.push.stats.num_fallbacks == 3 and s.push.stats.num_received == 0
        s.assert_clean()


def test_a_pull_read_that_never_settles_gets_its_endpoint_torn_down(tiny: LoadedModel) -> None:
    s = PullSetup(tiny, deadline_s=0.3)
    try:
        spec = s.prefill("xn")
        s.conn.submit(spec).result(5)
        s.td.land_late_next(None)  # NIXL never lets go of it
        assert asyncio.run(s.decode("xn")) == _reference(tiny, PROMPT)
        _wait_for(lambda: not s.td.is_connected(s.tp.engine_id), "D to tear the endpoint down")
        assert s.td.num_late() == 0
        _wait_for(lambda: s.ad.call(lambda e: e.block_pool.stats().num_in_use).result(5) == 0,
                  "D's pool to empty")  # fmt: skip
    finally:
        s.ad.shutdown()


def test_a_retained_turn_read_ends_within_decodes_pin(tiny: LoadedModel) -> None:
    """P's READ of a retained turn gets at most the pin's time left: a READ that hangs
    fails then, and nothing is cached."""
    from tests.unit.test_retained_turns import _turn

    with Pair(tiny) as s:
        _turn(s, "rt1", "s9")
        info = s.ad.call(lambda _e: s.df.retainer.describe("s9")).result(5)
        assert info is not None and info["pin_s"] == s.df.retainer.pin_s
        s.tp.hang_next()
        t0 = time.monotonic()
        done = s.ap.call(lambda _e: s.pf.reader.start(
            s.d_peer, "rt1-read", info["block_ids"], info["keys"], info["token_ids"], 0.2,
        )).result(5)  # fmt: skip
        assert done.result(10) == 0
        assert time.monotonic() - t0 < s.pf.reader.deadline_s, "the pin's bound, not the reader's"


def _is_failed(payload: bytes) -> bool:
    return isinstance(MessageCodec().decode(payload), KVFailed)


def test_unconfirmed_quarantine_is_held_and_the_sender_asked_again(tiny: LoadedModel) -> None:
    """Our own teardown would not stop the sender's one-sided WRITEs: a quarantine
    the sender never confirmed is held, and the sender asked again, until it answers."""
    with Pair(tiny, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3) as s:
        s.df.receiver.peer_gone = lambda _engine_id: False
        s.tp.hang_next()  # P's WRITE never ends before D gives up
        for _ in range(2):  # P's confirmations (job failed; D's cancel) are lost
            s.tp.drop_next_notif(_is_failed)

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xh"))
            d_out = await s.decode("xh")
            await p
            return d_out

        assert asyncio.run(run()) == _reference(tiny)
        _wait_for(lambda: s.df.receiver.stats.num_quarantine_asks >= 1, "D to ask P again")
        _wait_for(lambda: not s.df.receiver.is_waiting("xh"), "P's answer to the asking")
        assert s.df.receiver.stats.num_teardowns == 0, "released on P's word, not a timer"
        s.assert_clean()


def test_quarantine_of_a_gone_sender_is_released(tiny: LoadedModel) -> None:
    with Pair(tiny, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3) as s:
        s.df.receiver.peer_gone = lambda _engine_id: True
        s.tp.hang_next()
        for _ in range(2):
            s.tp.drop_next_notif(_is_failed)

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xk"))
            d_out = await s.decode("xk")
            await p
            return d_out

        assert asyncio.run(run()) == _reference(tiny)
        _wait_for(lambda: s.df.receiver.stats.num_teardowns == 1, "D to give the blocks up")
        assert s.df.receiver.stats.num_quarantine_asks == 0


def test_the_receivers_teardown_runs_off_the_engine_thread(tiny: LoadedModel) -> None:
    """NIXL's disconnect takes its locks: D's teardown of a gone sender's endpoint goes
    to the flow I/O thread, as the sender's and the READ's do."""
    with Pair(tiny, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3) as s:
        s.df.receiver.peer_gone = lambda _engine_id: True
        threads: list[str] = []
        disconnect = s.td.disconnect

        def recording(peer: Any) -> None:
            threads.append(threading.current_thread().name)
            disconnect(peer)

        s.td.disconnect = recording  # type: ignore[method-assign]
        s.tp.hang_next()
        for _ in range(2):
            s.tp.drop_next_notif(_is_failed)

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xt"))
            d_out = await s.decode("xt")
            await p
            return d_out

        assert asyncio.run(run()) == _reference(tiny)
        _wait_for(lambda: s.df.receiver.stats.num_teardowns == 1, "D to give the blocks up")
        _wait_for(lambda: bool(threads), "the endpoint torn down")
        assert threads and all(name.startswith("kv-flow") for name in threads), threads


def test_quarantine_of_a_sender_restarted_at_its_url_is_released(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P dies without confirming and restarts at the same URL; D's directory adopts the
    new engine there (the next request names it) before D asks about the old one
    again. The old engine is gone all the same: its quarantined blocks go back."""
    url = "http://p"
    with Pair(tiny, wait_s=0.4, transfer_timeout_s=30, quarantine_s=0.3) as s:
        answering = {"info": s.tp.local_metadata()}  # what answers a handshake at the URL
        monkeypatch.setattr(handshake, "fetch_handshake", lambda *_a, **_k: answering["info"])
        directory = PeerDirectory(s.td)
        assert directory.get_peer(url).engine_id == s.tp.engine_id
        s.df.receiver.peer_gone = directory.is_gone  # as the instance wires them
        s.df.receiver.reconnect = directory.reconnect
        s.tp.hang_next()  # P's WRITE never ends before D gives up
        for _ in range(100):  # P, about to die, never confirms
            s.tp.drop_next_notif(_is_failed)

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xr"))
            d_out = await s.decode("xr")
            await p
            return d_out

        assert asyncio.run(run()) == _reference(tiny)
        assert s.df.receiver.is_waiting("xr"), "quarantined while P lives"
        restarted = s.fabric.endpoint(s.p.kv_pool, s.p.layout)
        answering["info"] = restarted.local_metadata()
        s.tp.close()
        assert directory.get_peer(url, restarted.engine_id).engine_id == restarted.engine_id
        _wait_for(lambda: not s.df.receiver.is_waiting("xr"), "D to give the blocks up")
        assert s.df.receiver.stats.num_teardowns == 1
        _wait_for(lambda: s.in_use(s.ad) == 0, "D's pool to empty")
