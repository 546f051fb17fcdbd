"""Eviction by session value on the block pool, in numbered steps over an injected clock:
the classes a release gives, the order cached blocks are evicted in, idle sessions,
the eviction hook and counters; the pool's integrity after every step."""

from __future__ import annotations

import hashlib

import pytest

from kvduplex.common.engine_config import EvictionPolicy
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.eviction import PLAIN_TAG
from kvduplex.engine.eviction import SHARED
from kvduplex.engine.eviction import EvictionClass
from kvduplex.engine.eviction import ReleaseTag

IDLE_S = 60.0
A, B, C = ReleaseTag.of_request("a"), ReleaseTag.of_request("b"), ReleaseTag.of_request("c")


def returned(session: str) -> ReleaseTag:
    return ReleaseTag.returned(session)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """A pool on a fake clock that records its evictions and checks itself."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy = EvictionPolicy.SESSION) -> None:
        self.clock = FakeClock()
        self.pool = BlockPool(num_blocks, eviction=policy, session_idle_s=IDLE_S, clock=self.clock)
        self.evicted: list[int] = []
        self.pool.on_evict = lambda block_id, key: self.evicted.append(block_id)
        self.next_key = 0

    def cache(self, n: int, tag: ReleaseTag | None) -> list[int]:
        """Fill `n` fresh blocks, cache them under new keys, release them tail first."""
        blocks = self.allocate(n)
        for b in blocks:
            assert self.pool.insert_cached(b, self.key()) == b
        self.pool.release(reversed(blocks), tag)
        self.check()
        return blocks

    def allocate(self, n: int) -> list[int]:
        got = self.pool.try_allocate(n)
        assert got is not None
        self.check()
        return got

    def take(self, n: int) -> list[int]:
        """Allocate `n` blocks and return those evicted for them (the hook's calls)."""
        self.evicted.clear()
        self.allocate(n)
        return list(self.evicted)

    def key(self) -> BlockHash:
        self.next_key += 1
        return BlockHash(hashlib.blake2b(self.next_key.to_bytes(8, "little")).digest()[:32])

    def check(self) -> None:
        self.pool.check_integrity()
        s = self.pool.stats()
        assert s.num_free + s.num_in_use + s.num_cached == s.total

    def cls(self, block_id: int) -> tuple[EvictionClass, str | None]:
        ev = self.pool.evictor
        return ev.classes[block_id], ev.owners[block_id]

    def num_evicted(self) -> dict[str, int]:
        return {c.label: n for c, n in self.pool.evictor.num_evicted.items()}


def test_plain_blocks_go_first_then_sessions_least_recently_active_first() -> None:
    p = Pool(9)
    # 1. Session a's history, then plain blocks released later: LRU would take a's first.
    a = p.cache(3, A)
    p.clock.now = 1
    plain = p.cache(3, PLAIN_TAG)
    p.clock.now = 2
    b = p.cache(3, B)
    assert [p.cls(x) for x in (a[0], plain[0], b[0])] == [
        (EvictionClass.SESSION, "a"), (EvictionClass.PLAIN, None), (EvictionClass.SESSION, "b"),
    ]  # fmt: skip
    # 2. The plain blocks go first, least recently released (the tail) first.
    assert p.take(2) == plain[::-1][:2]
    # 3. Then the live sessions, the least recently active (a) first, its tail first.
    assert p.take(3) == [plain[0], a[2], a[1]]
    assert p.take(4) == [a[0], *b[::-1]]
    assert p.num_evicted() == {"plain": 3, "session": 6, "returned": 0}
    assert p.pool.num_allocated == 9 + 9  # every block handed out counts, as under LRU


def test_lru_policy_keeps_todays_order_and_still_counts_by_class() -> None:
    p = Pool(9, EvictionPolicy.LRU)
    # 1. The same releases as above.
    a = p.cache(3, A)
    plain = p.cache(3, PLAIN_TAG)
    b = p.cache(3, returned("b"))
    # 2. Least recently released first, whatever the class.
    assert p.take(9) == [*a[::-1], *plain[::-1], *b[::-1]]
    assert p.num_evicted() == {"plain": 3, "session": 3, "returned": 3}
    assert p.pool.num_allocated == 18


def test_idle_session_goes_before_a_live_one_and_a_request_revives_it() -> None:
    p = Pool(12)
    # 1. t=0: a's history; t=30: b's.
    a = p.cache(4, A)
    p.clock.now = 30
    b = p.cache(4, B)
    # 2. t=80: a (idle 80 s) is past the think time, b (50 s) is not: a goes first.
    p.clock.now = 80
    p.allocate(4)  # the free blocks
    assert p.take(1) == [a[3]]
    # 3. t=85: a request of a arrives: a is live again, and now more recently active than b.
    p.clock.now = 85
    p.pool.note_session("a")
    assert p.take(2) == [b[3], b[2]]
    # 4. t=200: both idle; b (last active at 30) before a (85).
    p.clock.now = 200
    assert p.take(5) == [b[1], b[0], a[2], a[1], a[0]]
    assert p.num_evicted() == {"plain": 0, "session": 8, "returned": 0}


def test_returned_blocks_go_last_among_live_sessions() -> None:
    p = Pool(8)
    # 1. t=0: b's fresh answer lands (a duplex return); t=10: a's history.
    r = p.cache(4, returned("b"))
    p.clock.now = 10
    a = p.cache(4, A)
    assert p.cls(r[0]) == (EvictionClass.RETURNED, "b")
    # 2. Both live: a's history goes before b's answer, though released later.
    p.clock.now = 20
    assert p.take(5) == [*a[::-1], r[3]]
    assert p.num_evicted() == {"plain": 0, "session": 4, "returned": 1}


def test_an_idle_sessions_answer_goes_before_its_history() -> None:
    p = Pool(12)
    # 1. t=0: a's history, then its returned answer; t=5: b's history.
    hist = p.cache(4, A)
    ans = p.cache(2, returned("a"))
    p.clock.now = 5
    b = p.cache(4, B)
    p.allocate(2)
    # 2. t=100: both idle. a (less recently active) first, the end of its chain first;
    #    then b, idle too, before nothing else.
    p.clock.now = 100
    assert p.take(8) == [ans[1], ans[0], *hist[::-1], b[3], b[2]]


def test_an_idle_returned_session_waits_for_an_idle_session_older_still() -> None:
    p = Pool(6)
    # 1. t=0: a's history; t=10: b's answer. t=100: both idle, a longer.
    a = p.cache(3, A)
    p.clock.now = 10
    r = p.cache(3, returned("b"))
    p.clock.now = 100
    # 2. a's history first (idle since 0), then b's answer.
    assert p.take(6) == [*a[::-1], *r[::-1]]


def test_a_shared_prefix_keeps_its_class_and_stays_hot_while_used() -> None:
    p = Pool(8)
    # 1. t=0: session a's prompt: a shared system prompt (2 blocks) and its own turn.
    shared = p.allocate(2)
    own = p.allocate(2)
    for blk in [*shared, *own]:
        p.pool.insert_cached(blk, p.key())
    p.pool.release([*reversed(own), *reversed(shared)], A)
    p.check()
    # 2. t=50, t=100: plain requests use the system prompt: it stays SESSION (not demoted),
    #    held by the shared owner, whose activity every such use renews.
    for t in (50, 100):
        p.clock.now = t
        p.pool.acquire(shared)
        p.pool.release(reversed(shared), PLAIN_TAG)
        p.check()
    assert p.cls(shared[0]) == (EvictionClass.SESSION, SHARED)
    assert p.cls(own[0]) == (EvictionClass.SESSION, "a")
    # 3. t=130: a is idle (130 s), the shared prompt is not (30 s): a's own blocks go
    #    first; then plain ones released later still go before the shared prompt.
    p.clock.now = 130
    plain = p.cache(2, PLAIN_TAG)
    p.allocate(2)
    assert p.take(2) == plain[::-1]
    assert p.take(2) == own[::-1]
    assert p.take(2) == shared[::-1]


def test_the_next_session_to_release_a_shared_block_takes_it_over() -> None:
    p = Pool(2)
    blk = p.cache(1, PLAIN_TAG)[0]
    for tag, want in ((B, "b"), (PLAIN_TAG, SHARED), (C, "c")):
        p.pool.acquire([blk])
        p.pool.release([blk], tag)
        assert p.cls(blk) == (EvictionClass.SESSION, want)
        p.check()


def test_a_returned_answer_read_by_its_session_becomes_history() -> None:
    p = Pool(4)
    # 1. a's answer and b's answer land.
    ra = p.cache(1, returned("a"))[0]
    rb = p.cache(1, returned("b"))[0]
    # 2. a's next turn reads both (b's answer is a prefix a shares): a's own becomes
    #    SESSION; b's keeps the higher class, owned by its latest user.
    p.pool.acquire([ra, rb])
    p.pool.release([rb, ra], A)
    assert p.cls(ra) == (EvictionClass.SESSION, "a")
    assert p.cls(rb) == (EvictionClass.RETURNED, "a")
    # 3. A transfer's reference (no tag) changes no class.
    p.pool.acquire([ra])
    p.pool.release([ra])
    assert p.cls(ra) == (EvictionClass.SESSION, "a")
    p.check()


def test_a_transfers_last_reference_files_the_block_under_its_session() -> None:
    p = Pool(4)
    # 1. t=0: a's request and a transfer both hold the blocks; the request ends first.
    blocks = p.allocate(2)
    for blk in blocks:
        p.pool.insert_cached(blk, p.key())
    p.pool.acquire(blocks)
    p.pool.release(reversed(blocks), A)
    # 2. t=60: b's history.
    p.clock.now = 60
    old = p.cache(2, B)
    # 3. t=100: the transfer ends: the blocks are cached as a's, a active now.
    p.clock.now = 100
    p.pool.release(reversed(blocks))
    p.check()
    assert [p.cls(b) for b in blocks] == [(EvictionClass.SESSION, "a")] * 2
    # 4. t=150: b is idle (90 s), a is not (50 s): b's go first.
    p.clock.now = 150
    assert p.take(4) == [*old[::-1], *blocks[::-1]]


def test_every_class_evicts_when_nothing_else_is_left() -> None:
    p = Pool(6)
    # 1. The pool is all cached: live history and a fresh answer, no plain block.
    a = p.cache(3, A)
    r = p.cache(3, returned("b"))
    assert p.pool.num_allocatable_blocks == 6
    # 2. One allocation of the whole pool is served, as LRU would; each evicted block
    #    went through the hook first.
    assert p.take(6) == [*a[::-1], *r[::-1]]
    assert p.pool.try_allocate(1) is None
    assert p.num_evicted() == {"plain": 0, "session": 3, "returned": 3}
    # 3. Handed out fresh, the blocks hold no class.
    assert all(p.cls(b) == (EvictionClass.PLAIN, None) for b in range(6))


def test_acquiring_a_cached_block_takes_it_out_of_its_session() -> None:
    p = Pool(4)
    # 1. a's two blocks; one is hit by a new request (revived).
    a = p.cache(2, A)
    p.pool.acquire([a[0]])
    p.check()
    assert not p.pool.is_evictable(a[0]) and p.pool.is_evictable(a[1])
    # 2. Only the other can be evicted.
    p.allocate(2)
    assert p.take(1) == [a[1]]
    assert p.pool.try_allocate(1) is None
    # 3. Released, the revived block is cached again, still a's.
    p.pool.release([a[0]], A)
    assert p.cls(a[0]) == (EvictionClass.SESSION, "a") and p.pool.is_evictable(a[0])
    p.check()


def test_reset_drops_every_class_without_the_hook_or_the_counters() -> None:
    p = Pool(6)
    p.cache(2, A)
    p.cache(2, returned("b"))
    p.cache(2, PLAIN_TAG)
    assert p.pool.reset_prefix_cache() == 6
    p.check()
    assert p.evicted == [] and sum(p.num_evicted().values()) == 0
    assert p.pool.stats().num_free == 6


def test_release_tags_must_name_a_session_exactly_when_they_have_one() -> None:
    assert ReleaseTag.of_request(None) is PLAIN_TAG and ReleaseTag.of_request("") is PLAIN_TAG
    assert ReleaseTag.returned("") is PLAIN_TAG
    with pytest.raises(ValueError):
        ReleaseTag(EvictionClass.SESSION)
    with pytest.raises(ValueError):
        ReleaseTag(EvictionClass.PLAIN, "a")
    with pytest.raises(ValueError, match="session_idle_s must be > 0"):
        BlockPool(2, session_idle_s=0)


def test_a_live_sessions_answer_goes_before_its_history_never_after() -> None:
    p = Pool(12)
    # 1. t=0: a's history, then its returned answer; t=5: b's history. Both stay live.
    hist = p.cache(4, A)
    ans = p.cache(2, returned("a"))
    p.clock.now = 5
    b = p.cache(4, B)
    p.allocate(2)
    # 2. t=10: a (least recently active) goes first, the end of its chain first: an
    #    answer kept past its history could never be hit (lookups stop at a miss).
    p.clock.now = 10
    assert p.take(7) == [ans[1], ans[0], *hist[::-1], b[3]]
    assert p.num_evicted() == {"plain": 0, "session": 5, "returned": 2}


def test_the_clock_counts_cached_blocks_revived_as_handed_out() -> None:
    # Sessions taking turns in a cycle larger than the pool revive their histories ahead
    # of the one released longest ago: the clock must move with every block handed out,
    # or a session looks cached long after it was evicted.
    p = Pool(6, EvictionPolicy.LRU)
    a = p.cache(3, A)
    b = p.cache(3, B)
    assert p.pool.num_allocated == 6
    p.pool.acquire(b)  # b's next turn hits its history: 3 blocks handed out again
    assert p.pool.num_allocated == 9
    p.pool.release(reversed(b), B)
    assert p.take(3) == a[::-1]  # a, released longest ago, goes first
    assert p.pool.num_allocated == 12
    p.pool.acquire([b[0]])
    p.pool.acquire([b[0]])  # a block already in use is not handed out again
    assert p.pool.num_allocated == 13
