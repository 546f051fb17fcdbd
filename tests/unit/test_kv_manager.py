"""KV cache manager: prefix hits, the never-whole-prompt rule, slot appends, caching, freeing."""

from __future__ import annotations

import pytest

from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.request import Request

BS = 4
IDENTITY = b"m"


def make(num_blocks: int = 8, caching: bool = True) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, enable_caching=caching)
    return pool, KVCacheManager(pool, BS, IDENTITY)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def admit_and_compute(kv: KVCacheManager, r: Request) -> None:
    """Admission plus one step that computes every known token."""
    hit = kv.find_prefix_hit(r)
    assert kv.try_allocate_slots(r, r.num_tokens - hit.num_tokens, hit) is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)


def test_prefix_hit_reuses_cached_blocks() -> None:
    pool, kv = make()
    a = req("a", list(range(10)))
    admit_and_compute(kv, a)
    a_blocks = list(a.block_ids)
    assert pool.key_of(a_blocks[0]) is not None and pool.key_of(a_blocks[1]) is not None
    assert pool.key_of(a_blocks[2]) is None  # partial block: never cached
    kv.free(a)
    assert pool.stats().num_in_use == 0 and pool.stats().num_cached == 2

    b = req("b", [*range(8), 50, 51, 52])
    hit = kv.find_prefix_hit(b)
    assert hit.block_ids == tuple(a_blocks[:2]) and hit.num_tokens == 8
    new = kv.try_allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert new is not None and len(new) == 1
    assert b.block_ids[:2] == a_blocks[:2]
    assert pool.ref_count(a_blocks[0]) == 1 and not pool.is_evictable(a_blocks[0])
    assert kv.num_hit_tokens == 8
    pool.check_integrity()


def test_hit_never_covers_the_whole_prompt() -> None:
    _, kv = make()
    admit_and_compute(kv, req("a", list(range(8))))
    same = req("b", list(range(8)))
    # 8 tokens all cached, but the last one must be computed for logits: one block only.
    assert kv.find_prefix_hit(same).num_tokens == 4
    # KV arriving from a remote sender needs no local logits.
    assert kv.find_prefix_hit(same, allow_full_hit=True).num_tokens == 8


def test_decode_appends_slots_across_block_boundaries() -> None:
    pool, kv = make()
    r = req("a", list(range(4)))
    assert kv.try_allocate_slots(r, 4) is not None and len(r.block_ids) == 1
    r.num_computed_tokens = 4
    for step in range(5):  # tokens 4..8: a new block at 4 and at 8
        r.append_output_token(100 + step)
        new = kv.try_allocate_slots(r, 1)
        assert new is not None
        assert len(new) == (1 if r.num_tokens - 1 in (4, 8) else 0)
        r.num_computed_tokens += 1
    assert len(r.block_ids) == 3 and len(set(r.block_ids)) == 3
    pool.check_integrity()


def test_generated_token_blocks_are_cached() -> None:
    pool, kv = make()
    r = req("a", list(range(6)))
    admit_and_compute(kv, r)
    for t in (90, 91, 92):  # fills block 1 (positions 4..7) with 2 prompt + 2 output tokens
        r.append_output_token(t)
        assert kv.try_allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        kv.cache_full_blocks(r)
    # Position 8 (token 92) is in block 2, computed but the block is not full.
    assert pool.key_of(r.block_ids[1]) is not None
    assert pool.key_of(r.block_ids[2]) is None
    assert r.block_hashes == compute_block_hashes(list(r.all_token_ids), BS, IDENTITY)
    next_turn = req("b", [*range(6), 90, 91, 7, 7])
    assert kv.find_prefix_hit(next_turn).block_ids == tuple(r.block_ids[:2])


def test_cache_waits_for_computed_tokens() -> None:
    pool, kv = make()
    r = req("a", list(range(8)))
    assert kv.try_allocate_slots(r, 8) is not None
    r.num_computed_tokens = 3  # a chunk that stops inside block 0
    assert kv.cache_full_blocks(r) == 0
    r.num_computed_tokens = 8
    assert kv.cache_full_blocks(r) == 2
    assert kv.cache_full_blocks(r) == 0  # nothing new
    assert pool.lookup(r.block_hashes) == r.block_ids


def test_allocation_failure_changes_nothing() -> None:
    pool, kv = make(num_blocks=3)
    r = req("a", list(range(12)))
    assert kv.try_allocate_slots(r, 12) is not None
    before = pool.stats()
    r.num_computed_tokens = 12
    r.append_output_token(1)
    assert kv.try_allocate_slots(r, 1) is None
    assert pool.stats() == before and len(r.block_ids) == 3


def test_revived_hit_blocks_count_against_capacity() -> None:
    """Allocating the rest must never evict the hit blocks it is about to use."""
    pool, kv = make(num_blocks=4)
    a = req("a", list(range(9)))  # 2 full blocks cached + 1 partial
    admit_and_compute(kv, a)
    kv.free(a)
    assert pool.stats().num_cached == 2 and pool.stats().num_free == 2

    too_big = req("b", [*range(8), *range(100, 109)])  # 17 tokens: 2 hit + 3 fresh blocks
    hit = kv.find_prefix_hit(too_big)
    assert hit.num_tokens == 8
    assert kv.try_allocate_slots(too_big, too_big.num_tokens - 8, hit) is None
    assert pool.lookup(too_big.block_hashes[:2]) == list(hit.block_ids)  # still cached

    fits = req("c", [*range(8), *range(100, 108)])  # 16 tokens: 2 hit + 2 fresh
    hit = kv.find_prefix_hit(fits)
    assert kv.try_allocate_slots(fits, fits.num_tokens - 8, hit) is not None
    assert fits.block_ids[:2] == list(hit.block_ids)
    pool.check_integrity()


def test_free_releases_tail_first() -> None:
    pool, kv = make(num_blocks=3)
    r = req("a", list(range(12)))
    admit_and_compute(kv, r)
    blocks = list(r.block_ids)
    kv.free(r)
    assert r.block_ids == []
    # The tail was released first, so it is evicted first.
    assert pool.evict(3) == blocks[::-1]


def test_same_content_computed_twice_stays_private() -> None:
    pool, kv = make()
    a, b = req("a", list(range(8))), req("b", list(range(8)))
    for r in (a, b):
        assert kv.try_allocate_slots(r, 8) is not None
    for r in (a, b):
        r.num_computed_tokens = 8
        kv.cache_full_blocks(r)
    assert pool.lookup(a.block_hashes) == a.block_ids
    assert all(pool.key_of(x) is None for x in b.block_ids)
    kv.free(a)
    kv.free(b)
    s = pool.stats()
    assert (s.num_in_use, s.num_cached, s.num_free) == (0, 2, 6)
    pool.check_integrity()


def test_prefix_caching_disabled() -> None:
    pool, kv = make(caching=False)
    admit_and_compute(kv, req("a", list(range(8))))
    b = req("b", list(range(9)))
    assert kv.find_prefix_hit(b).num_tokens == 0
    assert pool.stats().num_cached == 0
    assert b.block_hashes == []  # no hashing work at all


def test_hit_only_at_admission() -> None:
    _, kv = make()
    admit_and_compute(kv, req("a", list(range(8))))
    b = req("b", list(range(9)))
    hit = kv.find_prefix_hit(b)
    assert kv.try_allocate_slots(b, 1, hit) is not None
    with pytest.raises(ValueError, match="admission"):
        kv.try_allocate_slots(b, 1, hit)


def test_drop_tail_keeps_head() -> None:
    pool, kv = make()
    r = req("a", list(range(12)))
    admit_and_compute(kv, r)
    head = r.block_ids[:1]
    kv.drop_tail(r, 1)
    assert r.block_ids == head
    assert pool.stats().num_in_use == 1
    kv.free(r)
    assert pool.stats().num_in_use == 0
    pool.check_integrity()
