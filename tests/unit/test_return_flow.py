"""The duplex return over the in-process transport: decode offers a finished turn's
blocks, prefill takes those its prefix cache lacks, and the next turn hits them.

P and D are stepped in one thread (`tests.unit.flow_sim`)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.eviction import EvictionClass
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVOffer
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.kvflow.returns import ReturnSpec
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import BS
from tests.unit.flow_common import FIRST
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import Starved
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

ANSWER = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)


def _turn(
    s: Sim, xid: str, prompt: list[int], session: str = "s1", params: SamplingParams = ANSWER
) -> list[int]:
    """One push turn whose finished blocks D returns to P: D's answer (P's prefill
    finished too)."""
    s.push(xid, prompt, params, session=session)
    s.run(lambda: s.finished(f"d-{xid}") and s.finished(xid))
    return s.outputs[f"d-{xid}"]


def _p_cached_prefix(s: Sim, tokens: list[int]) -> int:
    """Tokens of `tokens` P's prefix cache holds, in whole blocks."""
    keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
    return s.p.kv_manager.num_cached_prefix(keys) * BS


def test_return_fills_prefills_cache_and_next_turn_matches(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    acceptor = s.pf.acceptor
    answer = _turn(s, "t1", PROMPT)
    assert answer == _reference(tiny, PROMPT, ANSWER)
    history = PROMPT + answer  # 29 tokens; decode computed 28: 7 full blocks
    s.run(lambda: acceptor.stats.num_received_blocks > 0)  # the return
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
    s.p.add_request(Request("p2", turn2, FIRST))
    s.run(lambda: s.finished("p2"))
    assert s.outputs["p2"] == _reference(tiny, turn2, FIRST)
    assert s.last["p2"].num_cached_tokens == 28
    s.assert_clean()


def test_returned_blocks_are_kept_as_their_sessions_fresh_answer(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks a return inserts into P's prefix cache are RETURNED, owned by the
    session the offer names: P evicts them after live sessions' history."""
    s = Sim(tiny, monkeypatch)
    answer = _turn(s, "r1", PROMPT, session="s1")
    s.run(lambda: s.pf.acceptor.stats.num_received_blocks == 3)  # the return
    keys = compute_block_hashes(PROMPT + answer, BS, s.p.kv_manager.identity)
    ev = s.p.block_pool.evictor
    classes = [(ev.classes[b], ev.owners[b]) for b in s.p.block_pool.lookup(keys)]
    # P's own prefill named no session here: its prompt blocks are PLAIN.
    assert classes == [
        *[(EvictionClass.PLAIN, None)] * 4, *[(EvictionClass.RETURNED, "s1")] * 3,
    ]  # fmt: skip
    s.assert_clean()


def test_turn_that_ends_with_prefills_first_token_is_returned_too(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_tokens=1: the request finishes as the pushed KV arrives, outside a step's update;
    its held blocks are still released (nothing to offer: P computed the whole prompt)."""
    s = Sim(tiny, monkeypatch)
    assert _turn(s, "one", PROMPT, params=FIRST) == _reference(tiny, PROMPT, FIRST)
    s.assert_clean()
    assert s.df.offerer.stats.num_offered == 0


def test_offer_of_blocks_prefill_has_is_declined(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    _turn(s, "a1", PROMPT)
    s.run(lambda: s.pf.acceptor.stats.num_received_blocks == 3)  # the first return
    # The same conversation again: P's prefill hits, D offers the same blocks.
    _turn(s, "a2", PROMPT)
    s.run(lambda: s.df.offerer.stats.num_declined == 1)
    assert s.df.offerer.records()["d-a2"]["outcome"] == "declined"
    assert s.df.offerer.records()["d-a2"]["num_sent_bytes"] == 0
    assert s.pf.acceptor.stats.num_refused == 1
    assert s.pf.acceptor.stats.num_received_blocks == 3
    s.assert_clean()


def test_forged_offer_is_declined_and_nothing_is_cached(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    tokens = list(range(100, 100 + 2 * BS))
    keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
    forged = KVOffer("f1", "s", [bytes(k) for k in keys], [t + 1 for t in tokens])
    s.pf.acceptor.accept(forged, s.td.engine_id)
    assert s.pf.acceptor.stats.num_refused == 1 and s.pf.acceptor.stats.num_accepted == 0
    assert _p_cached_prefix(s, tokens) == 0
    s.assert_clean()


def test_failed_return_write_leaves_both_pools_clean(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Sim(tiny, monkeypatch)
    answer = _turn(s, "w1", PROMPT)
    s.run(lambda: s.df.offerer.stats.num_done == 1)  # the first return
    s.td.fail_next("link down")  # D's next WRITE is the second turn's return
    _turn(s, "w2", [*PROMPT, *answer, 7, 8, 9])
    s.run(lambda: s.df.offerer.stats.num_failed == 1)  # the failed return
    assert s.pf.acceptor.stats.num_received_blocks == 3  # the first return's only
    s.assert_clean()


def test_unanswered_offer_releases_decodes_blocks(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill never answers (gone, or the offer was lost): decode's job ends at the
    registration deadline and its references go."""
    s = Sim(tiny, monkeypatch, wait_s=0.3)
    lost = s.intercept(s.tp, KVOffer)  # the offer never arrives
    _turn(s, "u1", PROMPT)
    s.run(lambda: s.df.offerer.stats.num_failed == 1)  # the offer expires
    assert len(lost) == 1
    assert s.pf.acceptor.stats.num_received_blocks == 0
    s.assert_clean()


def test_offer_without_room_is_declined(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Sim(tiny, monkeypatch)
    hog = s.p.kv_manager.try_allocate_blocks(s.p.block_pool.num_allocatable_blocks)
    assert hog is not None
    tokens = list(range(200, 200 + 3 * BS))
    keys = compute_block_hashes(tokens, BS, s.p.kv_manager.identity)
    offer = KVOffer("r1", "s", [bytes(k) for k in keys], tokens)
    s.pf.acceptor.accept(offer, s.td.engine_id)
    assert s.pf.acceptor.stats.num_refused == 1
    s.p.kv_manager.release_blocks(hog)
    s.assert_clean()


def test_jobs_ending_while_the_sender_ticks(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs are added and forgotten between the ticks the pump puts into the inbox, and
    a tick ends many jobs at once (their registration wait ran out): every walk of the
    sender's tick sees a consistent table (no "changed size during iteration")."""
    s = Sim(tiny, monkeypatch)
    sender, inbox = s.df.sender, s.df.inbox
    errors: list[BaseException] = []
    ticks = inbox._ticks
    sender_tick = ticks[ticks.index(sender._tick)]

    def checked_tick(now: float) -> None:
        try:
            sender_tick(now)
        except BaseException as exc:
            errors.append(exc)
            raise

    ticks[ticks.index(sender._tick)] = checked_tick

    def pump_tick() -> None:  # as the pump does; the engine thread drains it
        inbox.tick(s.clock.now)
        inbox.drain()

    blocks = s.d.kv_manager.try_allocate_blocks(2)
    assert blocks is not None
    for i in range(2000):
        sender.offer(f"j{i}", s.p_peer, blocks, list(range(2 * BS)))
        pump_tick()
        sender.decline(f"j{i}", "test")
        pump_tick()
    assert sender.num_jobs() == 0
    for i in range(200):  # never registered: the tick that ends their wait ends them all
        sender.offer(f"k{i}", s.p_peer, blocks, list(range(2 * BS)))
    assert sender.num_jobs() == 200
    s.clock.now += sender.registration_wait_s + 1.0
    pump_tick()
    assert sender.num_jobs() == 0, "every job forgotten"
    assert not errors, errors
    s.d.kv_manager.release_blocks(blocks)
    s.assert_clean()


def test_retained_turn_is_read_by_prefill(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--return-mode pull``: decode holds the finished turn; prefill READs what it lacks."""
    s = Sim(tiny, monkeypatch)
    s.push("r1", PROMPT, ANSWER, meta=RetainSpec("s1"))
    s.run(lambda: s.finished("d-r1") and s.finished("r1"))
    history = PROMPT + s.outputs["d-r1"]
    assert s.df.retainer.num_retained() == 1
    assert s.in_use(s.d) == 7  # the turn's blocks stay pinned on decode
    info = s.df.retainer.describe("s1")
    assert info is not None and len(info["block_ids"]) == 7
    done = s.pf.reader.start(s.d_peer, "rd", info["block_ids"], info["keys"], info["token_ids"])
    s.run(done.done)
    assert done.result(0) == 3  # P had the prompt's 4 full blocks
    assert _p_cached_prefix(s, history) == 28
    s.df.retainer._expire()  # nothing expired yet
    assert s.df.retainer.num_retained() == 1


def test_return_skips_the_blocks_prefills_tier_holds(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's pool evicted part of the session's prompt into its KV tier before D's offer
    came: P counts the tier's blocks as held (its next lookup promotes them), so D moves
    only the blocks held nowhere, and the next turn is exact over pool, tier and return::

        blocks    0    1  |  2    3  |  4    5    6
        P         pool    |  tier    |  lacks: the only blocks D WRITEs
    """
    s = Sim(tiny, monkeypatch, p_tier_blocks=16)
    try:
        offers = s.intercept(s.tp, KVOffer)  # held back until P's pool evicted
        s.push("t1", PROMPT, ANSWER, meta=ReturnSpec("s1", s.p_peer, from_block=0))
        s.run(lambda: len(offers) == 1 and s.finished("t1"))
        s.run(lambda: s.pf.sender.num_jobs() == 0)  # P's prefill released its blocks
        history = PROMPT + s.outputs["d-t1"]
        keys = compute_block_hashes(history[: 7 * BS], BS, s.p.kv_manager.identity)
        assert s.p.block_pool.num_cached_prefix(keys) == 4  # P computed the prompt

        # Two more blocks than are free: P evicts its two least recently released
        # cached blocks, the prompt's tail (blocks 3 and 2), down into its tier.
        hog = s.p.kv_manager.try_allocate_blocks(s.p.block_pool.stats().num_free + 2)
        assert hog is not None
        s.p.kv_manager.release_blocks(hog)
        tier = s.p.kv_tier
        assert tier is not None
        assert s.p.block_pool.num_cached_prefix(keys) == 2
        assert [tier.tier.contains(k) for k in keys[:4]] == [False, False, True, True]
        assert s.p.kv_manager.num_held_prefix(keys) == 4

        msg, sender = offers[0]
        assert isinstance(msg, KVOffer) and len(msg.keys) == 7
        s.pf.inbox.heard(msg, sender)
        s.run(lambda: s.pf.acceptor.stats.num_received_blocks > 0)
        rec = s.df.offerer.records()["d-t1"]
        assert (rec["num_offered_blocks"], rec["num_sent_blocks"]) == (7, 3)
        assert rec["num_sent_bytes"] == 3 * s.td.layout.bytes_per_block
        assert s.pf.acceptor.stats.num_received_blocks == 3
        assert tier.tier.stats.num_loaded_blocks == 0, "nothing loaded to answer the offer"
        s.assert_clean()

        # Next turn: the pool's blocks, the tier's promoted, then the returned ones.
        turn2 = [*history, 40, 41, 42, 43, 44]
        s.p.add_request(Request("p2", turn2, FIRST))
        s.run(lambda: s.finished("p2"))
        assert s.outputs["p2"] == _reference(tiny, turn2, FIRST)
        assert s.last["p2"].num_cached_tokens == 7 * BS
        assert tier.tier.stats.num_loaded_blocks == 2
        registry = CollectorRegistry()
        EngineMetrics(registry).bind_hits(s.p.kv_manager)
        hits = {src: registry.get_sample_value("kvduplex_kv_hit_tokens_total", {"source": src})
                for src in ("pool", "tier", "store", "decode")}  # fmt: skip
        assert hits == {"pool": 2 * BS, "tier": 2 * BS, "store": 0, "decode": 3 * BS}
        s.assert_clean()
    finally:
        s.close()


def test_offer_whose_parent_only_the_tier_holds_is_taken(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offer's first block extends a prefix P's pool evicted into its tier: P takes
    it (a lookup promotes the prefix) instead of declining ``prefix_missing``."""
    s = Sim(tiny, monkeypatch, p_tier_blocks=16)
    try:
        offers = s.intercept(s.tp, KVOffer)
        s.push("t1", PROMPT, ANSWER, session="s1")  # offers blocks 4..6, parent block 3
        s.run(lambda: len(offers) == 1 and s.finished("t1"))
        s.run(lambda: s.pf.sender.num_jobs() == 0)
        starved = Starved(s.p)  # every cached block of P goes down into its tier
        starved.end()
        history = PROMPT + s.outputs["d-t1"]
        keys = compute_block_hashes(history[: 7 * BS], BS, s.p.kv_manager.identity)
        assert s.p.block_pool.num_cached_prefix(keys) == 0
        msg, sender = offers[0]
        s.pf.inbox.heard(msg, sender)
        s.run(lambda: s.pf.acceptor.stats.num_received_blocks > 0)
        assert s.df.offerer.records()["d-t1"]["num_sent_blocks"] == 3
        assert s.pf.acceptor.stats.num_refused == 0
        s.assert_clean()

        turn2 = [*history, 40, 41, 42, 43, 44]
        s.p.add_request(Request("p2", turn2, FIRST))
        s.run(lambda: s.finished("p2"))
        assert s.outputs["p2"] == _reference(tiny, turn2, FIRST)
        assert s.last["p2"].num_cached_tokens == 7 * BS
        by_source = s.p.kv_manager.num_hit_tokens_by_source
        assert by_source == {
            HitSource.POOL: 0, HitSource.TIER: 4 * BS, HitSource.STORE: 0,
            HitSource.DECODE: 3 * BS,
        }  # fmt: skip
        s.assert_clean()
    finally:
        s.close()


def test_received_bytes_are_counted_by_the_role_they_came_from(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D counts what prefill pushed or let it pull, P what decode returned or lent."""
    s = Sim(tiny, monkeypatch, metrics=True)
    per_block = s.tp.layout.bytes_per_block

    def received(registry: CollectorRegistry, source: str) -> float | None:
        return registry.get_sample_value("kvduplex_kv_received_bytes_total", {"source": source})

    _turn(s, "t1", PROMPT)  # P pushes the prompt's 5 blocks; D returns the answer's 3
    s.run(lambda: s.pf.acceptor.stats.num_received_blocks > 0)
    assert received(s.d_registry, "prefill") == 5 * per_block
    assert received(s.p_registry, "decode") == 3 * per_block
    assert received(s.p_registry, "prefill") is None and received(s.d_registry, "decode") is None

    s.pull("pl", [*PROMPT, 90, 91, 92, 93])  # 22 tokens: 6 blocks, 4 of them in D's cache
    s.run(lambda: s.finished("pl"))
    s.pull_decode("pl", [*PROMPT, 90, 91, 92, 93])
    s.run(lambda: s.finished("d-pl"))
    assert received(s.d_registry, "prefill") == (5 + s.df.pull.stats.num_pulled_blocks) * per_block
    assert s.df.pull.stats.num_pulled_blocks > 0
    s.assert_clean()
