"""Decode lends a prompt's cached prefix to prefill (the router's fetch plan,
`kvduplex.kvflow.fetch`): its blocks stay referenced under a lease until prefill releases
it or it expires, and prefill, having read them, computes only the rest, exactly."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.request import Request
from kvduplex.kvflow.fetch import FetchRefusal
from kvduplex.kvflow.fetch import FetchRefused
from kvduplex.kvflow.fetch import PrefixLease
from kvduplex.kvflow.fetch import PrefixLeases
from kvduplex.kvflow.fetch import lendable_keys
from kvduplex.kvflow.return_pull import RetainedReadSide
from kvduplex.kvflow.return_pull import RetainedTurnRef
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.protocol import PeerHandle
from tests.unit.flow_pair import BS
from tests.unit.flow_pair import GREEDY
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture


def _generate(s: Pair, on_decode: bool, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """Run `prompt` whole on one engine of the pair: its tokens and its cached tokens."""
    engine = s.ad if on_decode else s.ap

    async def run() -> tuple[list[int], int]:
        out: list[int] = []
        num_cached = 0
        async for o in engine.generate(Request(rid, prompt, GREEDY)):
            out.extend(o.new_token_ids)
            num_cached = o.num_local_cached_tokens
        return out, num_cached

    return asyncio.run(run())


def _refs(s: Pair, blocks: list[int]) -> list[int]:
    return s.ad.call(lambda e: [e.block_pool.ref_count(b) for b in blocks]).result(5)


def _grant(s: Pair, leases: PrefixLeases, xid: str, prompt: list[int]) -> PrefixLease:
    keys = lendable_keys(prompt, BS, s.d.kv_manager.identity)
    return s.ad.call(lambda _e: leases.grant(xid, keys)).result(5)


def _refusal(s: Pair, leases: PrefixLeases, xid: str, prompt: list[int]) -> FetchRefusal:
    with pytest.raises(FetchRefused) as info:
        _grant(s, leases, xid, prompt)
    return info.value.reason


def test_prefill_reads_a_leased_history_and_computes_only_the_rest(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        answer, _ = _generate(s, True, "turn-1", PROMPT)  # decode served the first turn
        # 18 + 6 tokens, the last one without KV: 5 full blocks cached on decode.
        turn = PROMPT + answer + [77, 78, 79]
        leases = PrefixLeases(EngineHandle(s.ad), lease_s=5.0, inbox=s.df.inbox)
        lease = _grant(s, leases, "fetch-1", turn)
        assert (len(lease.block_ids), lease.num_tokens) == (5, 5 * BS)
        assert _refs(s, lease.block_ids) == [1] * 5, "the lease's own reference"

        def get_peer(_url: str, _engine_id: str | None) -> PeerHandle:
            return s.d_peer

        side = RetainedReadSide(s.ap, s.pf.reader, get_peer)
        ref = RetainedTurnRef(
            "http://d", None, lease.block_ids, [bytes(k).hex() for k in lease.keys],
            turn[: lease.num_tokens], lease.lease_s,
        )  # fmt: skip
        assert asyncio.run(side.read("x-1", ref, time.monotonic())) == 5
        assert s.ad.call(lambda _e: leases.release("fetch-1")).result(5)
        assert _refs(s, lease.block_ids) == [0] * 5, "released: cached, evictable again"
        assert not s.ad.call(lambda _e: leases.release("fetch-1")).result(5)

        got, num_cached = _generate(s, False, "turn-2", turn)
        assert num_cached == 5 * BS, "prefill computed only the tokens after the history"
        assert got == _reference(tiny, turn, GREEDY)
        s.assert_clean()


def test_a_read_keeps_the_cached_prefix_it_extends(tiny: LoadedModel) -> None:
    """Prefill holds the history's first blocks, least recently used, and no free block:
    allocating the blocks to read into evicts cached blocks, but not that prefix (the
    blocks read would be cached after a gap no lookup gets past)."""
    with Pair(tiny) as s:
        answer, _ = _generate(s, True, "turn-1", PROMPT)
        turn = PROMPT + answer + [77, 78, 79]
        _generate(s, False, "old", PROMPT[: 2 * BS + 1])  # caches the first 2 blocks
        _generate(s, False, "recent", [200 + i for i in range(6 * BS)])  # more recent ones

        def take_free(e: LLMEngine) -> list[int]:
            blocks = e.kv_manager.try_allocate_blocks(e.block_pool.stats().num_free)
            assert blocks is not None
            return blocks

        held = s.ap.call(take_free).result(5)
        leases = PrefixLeases(EngineHandle(s.ad), lease_s=5.0, inbox=s.df.inbox)
        lease = _grant(s, leases, "fetch-1", turn)

        def get_peer(_url: str, _engine_id: str | None) -> PeerHandle:
            return s.d_peer

        ref = RetainedTurnRef(
            "http://d", None, lease.block_ids, [bytes(k).hex() for k in lease.keys],
            turn[: lease.num_tokens], lease.lease_s,
        )  # fmt: skip
        side = RetainedReadSide(s.ap, s.pf.reader, get_peer)
        assert asyncio.run(side.read("x-1", ref, time.monotonic())) == 3, "the 3 it lacked"
        s.ad.call(lambda _e: leases.release("fetch-1")).result(5)
        s.ap.call(lambda e: e.kv_manager.release_blocks(held)).result(5)
        got, num_cached = _generate(s, False, "turn-2", turn)
        assert num_cached == 5 * BS, "its 2 blocks, then the 3 read"
        assert got == _reference(tiny, turn, GREEDY)
        s.assert_clean()


def test_decode_lends_only_what_it_holds_within_its_bound(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        _generate(s, True, "turn-1", PROMPT)
        leases = PrefixLeases(EngineHandle(s.ad), lease_s=5.0, inbox=s.df.inbox, max_blocks=6)
        assert _refusal(s, leases, "f0", [5, *PROMPT]) is FetchRefusal.NOT_CACHED
        assert _refusal(s, leases, "f0", PROMPT[:BS]) is FetchRefusal.NOT_CACHED, (
            "the prompt's last token is never lent: prefill computes it"
        )
        lease = _grant(s, leases, "f1", PROMPT[: 4 * BS])
        assert len(lease.block_ids) == 3, "16 tokens: 3 full blocks before the last token"
        assert _refusal(s, leases, "f1", PROMPT) is FetchRefusal.XID_IN_USE
        part = _grant(s, leases, "f2", PROMPT)
        assert part.block_ids == lease.block_ids, "4 blocks held, 3 more leased at most: its head"
        assert part.num_tokens == 3 * BS
        assert _refs(s, lease.block_ids) == [2, 2, 2], "two leases on the same blocks"
        assert _refusal(s, leases, "f3", PROMPT) is FetchRefusal.NO_ROOM
        assert s.ad.call(lambda _e: leases.release("f1")).result(5)
        again = _grant(s, leases, "f3", PROMPT[: 3 * BS])
        assert (len(leases), leases.num_leased_blocks()) == (2, 5)
        assert s.ad.call(lambda _e: leases.release("f2")).result(5)
        assert _refs(s, again.block_ids) == [1, 1]

        def expire(_e: LLMEngine) -> None:  # as if the lease and its grace had passed
            leases._tick(time.monotonic() + leases.hold_s + 1)

        s.ad.call(expire).result(5)
        assert len(leases) == 0 and _refs(s, again.block_ids) == [0, 0]
        s.assert_clean()
