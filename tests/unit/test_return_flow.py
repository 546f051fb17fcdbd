"""The duplex return over the in-process transport: decode offers a finished turn's
blocks, prefill takes those its prefix cache lacks, and the next turn hits them."""

from __future__ import annotations

import asyncio
import threading
import time

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.eviction import EvictionClass
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVOffer
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.kvflow.returns import ReturnSpec
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_pair import BS
from tests.unit.flow_pair import FIRST
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture

ANSWER = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)


async def _turn(
    s: Pair, xid: str, prompt: list[int], session: str = "s1", params: SamplingParams = ANSWER
) -> list[int]:
    """One push turn whose finished blocks D returns to P."""
    await asyncio.wrap_future(s.push.submit(PushSpec(xid, s.p_peer, "http://p", f"d-{xid}")))
    out: list[int] = []
    d = s.ad.generate(Request(
        f"d-{xid}", prompt, params, remote_kv=RemoteKVSpec(xid), hold_blocks_on_finish=True,
        connector_meta=ReturnSpec(session, s.p_peer),
    ))  # fmt: skip
    p = asyncio.ensure_future(s.prefill(xid, prompt))
    async for o in d:
        out.extend(o.new_token_ids)
    await p
    return out


def _p_cached_prefix(s: Pair, tokens: list[int]) -> int:
    """Tokens of `tokens` P's prefix cache holds, in whole blocks."""
    keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
    return s.ap.call(lambda e: e.kv_manager.num_cached_prefix(keys)).result(5) * BS


def test_return_fills_prefills_cache_and_next_turn_matches(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        acceptor = s.pf.acceptor
        answer = asyncio.run(_turn(s, "t1", PROMPT))
        assert answer == _reference(tiny, PROMPT, ANSWER)
        history = PROMPT + answer  # 29 tokens; decode computed 28: 7 full blocks
        _wait_for(lambda: acceptor.stats.num_received_blocks > 0, "the return")
        # P computed the prompt (4 full blocks); the return brought blocks 4..6.
        assert acceptor.stats.num_received_blocks == 3
        assert s.df.offerer.stats.num_done == 1 and s.df.offerer.stats.num_sent_blocks == 3
        rec = s.df.offerer.records()["d-t1"]
        assert (rec["outcome"], rec["num_offered_blocks"], rec["num_sent_blocks"]) == ("done", 3, 3)
        assert rec["num_sent_bytes"] == 3 * s.df.sender.transport.layout.bytes_per_block
        assert _p_cached_prefix(s, history) == 28
        s.assert_clean()

        # Next turn: P prefills only what its cache lacks, and the answer is exact.
        turn2 = [*history, 40, 41, 42, 43, 44]
        first: list[object] = []

        async def prefill_only() -> list[int]:
            out: list[int] = []
            async for o in s.ap.generate(Request("p2", turn2, FIRST)):
                out.extend(o.new_token_ids)
                first.append(o)
            return out

        got = asyncio.run(prefill_only())
        assert got == _reference(tiny, turn2, FIRST)
        assert first[-1].num_cached_tokens == 28  # type: ignore[attr-defined]
        s.assert_clean()


def test_returned_blocks_are_kept_as_their_sessions_fresh_answer(tiny: LoadedModel) -> None:
    """The blocks a return inserts into P's prefix cache are RETURNED, owned by the
    session the offer names: P evicts them after live sessions' history."""
    with Pair(tiny) as s:
        answer = asyncio.run(_turn(s, "r1", PROMPT, session="s1"))
        _wait_for(lambda: s.pf.acceptor.stats.num_received_blocks == 3, "the return")
        keys = compute_block_hashes(PROMPT + answer, BS, s.p.kv_manager.identity)

        def classes(e: LLMEngine) -> list[tuple[EvictionClass, str | None]]:
            ev = e.block_pool.evictor
            return [(ev.classes[b], ev.owners[b]) for b in e.block_pool.lookup(keys)]

        # P's own prefill named no session here: its prompt blocks are PLAIN.
        assert s.ap.call(classes).result(5) == [
            *[(EvictionClass.PLAIN, None)] * 4, *[(EvictionClass.RETURNED, "s1")] * 3,
        ]  # fmt: skip
        s.assert_clean()


def test_turn_that_ends_with_prefills_first_token_is_returned_too(tiny: LoadedModel) -> None:
    """max_tokens=1: the request finishes as the pushed KV arrives, outside a step's update;
    its held blocks are still released (nothing to offer: P computed the whole prompt)."""
    with Pair(tiny) as s:
        assert asyncio.run(_turn(s, "one", PROMPT, params=FIRST)) == _reference(tiny, PROMPT, FIRST)
        s.assert_clean()
        assert s.df.offerer.stats.num_offered == 0


def test_offer_of_blocks_prefill_has_is_declined(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        asyncio.run(_turn(s, "a1", PROMPT))
        _wait_for(lambda: s.pf.acceptor.stats.num_received_blocks == 3, "the first return")
        # The same conversation again: P's prefill hits, D offers the same blocks.
        asyncio.run(_turn(s, "a2", PROMPT))
        _wait_for(lambda: s.df.offerer.stats.num_declined == 1, "the decline")
        assert s.df.offerer.records()["d-a2"]["outcome"] == "declined"
        assert s.df.offerer.records()["d-a2"]["num_sent_bytes"] == 0
        assert s.pf.acceptor.stats.num_refused == 1
        assert s.pf.acceptor.stats.num_received_blocks == 3
        s.assert_clean()


def test_forged_offer_is_declined_and_nothing_is_cached(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        tokens = list(range(100, 100 + 2 * BS))
        keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
        forged = KVOffer("f1", "s", [bytes(k) for k in keys], [t + 1 for t in tokens])
        s.ap.call(lambda _e: s.pf.acceptor.accept(forged, s.td.engine_id)).result(5)
        assert s.pf.acceptor.stats.num_refused == 1 and s.pf.acceptor.stats.num_accepted == 0
        assert _p_cached_prefix(s, tokens) == 0
        s.assert_clean()


def test_failed_return_write_leaves_both_pools_clean(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        answer = asyncio.run(_turn(s, "w1", PROMPT))
        _wait_for(lambda: s.df.offerer.stats.num_done == 1, "the first return")
        s.td.fail_next("link down")  # D's next WRITE is the second turn's return
        asyncio.run(_turn(s, "w2", [*PROMPT, *answer, 7, 8, 9]))
        _wait_for(lambda: s.df.offerer.stats.num_failed == 1, "the failed return")
        assert s.pf.acceptor.stats.num_received_blocks == 3  # the first return's only
        s.assert_clean()


def test_unanswered_offer_releases_decodes_blocks(tiny: LoadedModel) -> None:
    """Prefill never answers (gone, or the offer was lost): decode's job ends at the
    registration deadline and its references go."""
    with Pair(tiny, wait_s=0.3) as s:
        s.pumps[0].on(KVOffer, lambda _msg, _sender: None)  # the offer never arrives
        asyncio.run(_turn(s, "u1", PROMPT))
        _wait_for(lambda: s.df.offerer.stats.num_failed == 1, "the offer to expire")
        assert s.pf.acceptor.stats.num_received_blocks == 0
        s.assert_clean()


def test_offer_without_room_is_declined(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        hog = s.ap.call(lambda e: e.kv_manager.try_allocate_blocks(e.block_pool.num_allocatable_blocks)).result(5)
        tokens = list(range(200, 200 + 3 * BS))
        keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
        offer = KVOffer("r1", "s", [bytes(k) for k in keys], tokens)
        s.ap.call(lambda _e: s.pf.acceptor.accept(offer, s.td.engine_id)).result(5)
        assert s.pf.acceptor.stats.num_refused == 1
        s.ap.call(lambda e: e.kv_manager.release_blocks(hog)).result(5)
        s.assert_clean()


def test_jobs_ending_on_the_engine_thread_while_the_pump_ticks(tiny: LoadedModel) -> None:
    """Jobs are added and forgotten on the engine thread while the pump thread ticks:
    every walk of the sender's tick sees a consistent table (no "changed size during
    iteration")."""
    s = Pair(tiny)
    sender = s.df.sender
    errors: list[BaseException] = []
    stop = threading.Event()
    ticks = s.df.inbox._ticks
    sender_tick = ticks[ticks.index(sender._tick)]

    def checked_tick(now: float) -> None:
        try:
            sender_tick(now)
        except BaseException as exc:
            errors.append(exc)
            raise

    ticks[ticks.index(sender._tick)] = checked_tick

    def tick() -> None:  # as the pump does
        while not stop.is_set():
            s.df.inbox.tick(time.monotonic())
            time.sleep(0.001)

    try:
        blocks = s.ad.call(lambda e: e.kv_manager.try_allocate_blocks(2)).result(5)
        assert blocks is not None
        ticker = threading.Thread(target=tick)
        ticker.start()

        def churn(e: object) -> None:
            for i in range(2000):
                sender.offer(f"j{i}", s.p_peer, blocks, 2 * BS)
                sender.decline(f"j{i}", "test")

        s.ad.call(churn).result(60)
        _wait_for(lambda: sender.num_jobs() == 0, "every job forgotten")
        stop.set()
        ticker.join()
        assert not errors, errors
        s.ad.call(lambda e: e.kv_manager.release_blocks(blocks)).result(5)
        s.assert_clean()
    finally:
        stop.set()
        s.close()


def test_retained_turn_is_read_by_prefill(tiny: LoadedModel) -> None:
    """``--return-mode pull``: decode holds the finished turn; prefill READs what it lacks."""
    with Pair(tiny) as s:

        async def turn() -> list[int]:
            await asyncio.wrap_future(s.push.submit(PushSpec("r1", s.p_peer, "http://p", "d-r1")))
            out: list[int] = []
            d = s.ad.generate(Request(
                "d-r1", PROMPT, ANSWER, remote_kv=RemoteKVSpec("r1"), hold_blocks_on_finish=True,
                connector_meta=RetainSpec("s1"),
            ))  # fmt: skip
            p = asyncio.ensure_future(s.prefill("r1", PROMPT))
            async for o in d:
                out.extend(o.new_token_ids)
            await p
            return out

        history = PROMPT + asyncio.run(turn())
        assert s.df.retainer.num_retained() == 1
        assert s.in_use(s.ad) == 7  # the turn's blocks stay pinned on decode
        info = s.ad.call(lambda _e: s.df.retainer.describe("s1")).result(5)
        assert info is not None and len(info["block_ids"]) == 7
        done = s.ap.call(
            lambda _e: s.pf.reader.start(
                s.d_peer, "rd", info["block_ids"], info["keys"], info["token_ids"]
            )
        ).result(5)
        assert done.result(10) == 3  # P had the prompt's 4 full blocks
        assert _p_cached_prefix(s, history) == 28
        s.ad.call(lambda _e: s.df.retainer._expire()).result(5)  # nothing expired yet
        assert s.df.retainer.num_retained() == 1
