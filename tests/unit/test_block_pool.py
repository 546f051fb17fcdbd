"""Block pool: ref counts, hash-chain keys, LRU eviction, integrity under random operations."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.block_pool import hash_block

IDENTITY = b"test-model\x1ffloat32"


def key(n: int) -> BlockHash:
    """A distinct key for tests that do not care about token content."""
    return BlockHash(hashlib.blake2b(n.to_bytes(8, "little", signed=True), digest_size=32).digest())


# ---- hash chain ----


def test_hash_chain_same_prefix_same_chain() -> None:
    a = compute_block_hashes(list(range(40)), 16, IDENTITY)
    b = compute_block_hashes([*range(32), 99, 98, 97], 16, IDENTITY)
    assert len(a) == 2  # the partial third block has no key
    assert a == b[:2]
    assert all(len(h) == 32 for h in a)


def test_hash_chain_depends_on_parent_and_identity() -> None:
    a = compute_block_hashes(list(range(32)), 16, IDENTITY)
    # Same second block after a different first block: a different key.
    c = compute_block_hashes([7, *range(1, 32)], 16, IDENTITY)
    assert a[0] != c[0] and a[1] != c[1]
    other = compute_block_hashes(list(range(32)), 16, b"other-model\x1ffloat32")
    assert set(a).isdisjoint(other)


def test_hash_chain_extends_with_parent() -> None:
    whole = compute_block_hashes(list(range(48)), 16, IDENTITY)
    head = compute_block_hashes(list(range(16)), 16, IDENTITY)
    tail = compute_block_hashes(list(range(16, 48)), 16, IDENTITY, parent=head[-1])
    assert head + tail == whole
    assert whole[1] == hash_block(whole[0], list(range(16, 32)), IDENTITY)


def test_hash_golden_value() -> None:
    """Pins the wire format: changing it breaks cache keys shared between instances."""
    expected = hashlib.blake2b(
        bytes(32)
        + len(IDENTITY).to_bytes(4, "little")
        + IDENTITY
        + b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3, -1)),
        digest_size=32,
    ).digest()
    assert compute_block_hashes([1, 2, 3, -1], 4, IDENTITY) == [expected]
    assert expected.hex() == "ae91a06e70cff494d1312fcfa275a2822d5299f14d7435e58ed5f60168c3cf3b"


def test_hash_chain_is_the_same_in_another_process() -> None:
    code = (
        "from kvduplex.engine.block_pool import compute_block_hashes;"
        "print(','.join(h.hex() for h in compute_block_hashes(list(range(64)), 16, b'm')))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    here = ",".join(h.hex() for h in compute_block_hashes(list(range(64)), 16, b"m"))
    assert out == here


# ---- basic operations ----


def test_allocate_until_exhausted_then_none() -> None:
    pool = BlockPool(4)
    a = pool.try_allocate(3)
    assert a is not None and len(set(a)) == 3
    assert pool.try_allocate(2) is None  # "can't now" changes nothing
    assert pool.stats().num_free == 1
    assert pool.try_allocate(0) == []
    pool.release(a)
    assert pool.stats().num_free == 4
    pool.check_integrity()


def test_release_keyed_block_becomes_cached_and_acquire_revives() -> None:
    pool = BlockPool(2)
    (b,) = pool.try_allocate(1) or []
    assert pool.insert_cached(b, key(1)) == b
    pool.release([b])
    s = pool.stats()
    assert (s.num_free, s.num_in_use, s.num_cached) == (1, 0, 1)
    assert pool.lookup([key(1), key(2)]) == [b]
    pool.acquire([b])
    assert pool.ref_count(b) == 1 and not pool.is_evictable(b)
    # A revived block is not evicted by allocation: only the free one is handed out.
    other = pool.try_allocate(1)
    assert other is not None and other != [b]
    assert pool.try_allocate(1) is None
    assert pool.lookup([key(1)]) == [b]
    pool.check_integrity()


def test_eviction_is_least_recently_released_first() -> None:
    pool = BlockPool(3)
    blocks = pool.try_allocate(3) or []
    for i, b in enumerate(blocks):
        pool.insert_cached(b, key(i))
    pool.release([blocks[2], blocks[0], blocks[1]])
    # Free list is empty: each allocation evicts the oldest release.
    assert pool.try_allocate(1) == [blocks[2]]
    assert pool.lookup([key(2)]) == []
    assert pool.try_allocate(1) == [blocks[0]]
    assert pool.evict(5) == [blocks[1]]
    assert pool.stats().num_cached == 0
    pool.check_integrity()


def test_insert_existing_key_keeps_the_cached_block() -> None:
    pool = BlockPool(3)
    a, b = pool.try_allocate(2) or []
    assert pool.insert_cached(a, key(7)) == a
    assert pool.insert_cached(b, key(7)) == a  # reported, not replaced
    assert pool.key_of(b) is None
    assert pool.insert_cached(a, key(7)) == a  # idempotent
    with pytest.raises(ValueError, match="another key"):
        pool.insert_cached(a, key(8))
    pool.release([a, b])
    assert pool.stats().num_cached == 1 and pool.stats().num_free == 2
    pool.check_integrity()


def test_missing_and_cached_prefix() -> None:
    pool = BlockPool(4)
    blocks = pool.try_allocate(2) or []
    pool.insert_cached(blocks[0], key(0))
    pool.insert_cached(blocks[1], key(2))
    keys = [key(0), key(1), key(2), key(3)]
    assert pool.missing(keys) == [1, 3]
    assert pool.num_cached_prefix(keys) == 1
    assert pool.lookup([key(9)]) == []


def test_misuse_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="released more often"):
        pool.release([0])
    with pytest.raises(ValueError, match="free"):
        pool.acquire([0])
    with pytest.raises(ValueError, match="referenced"):
        pool.insert_cached(0, key(0))
    with pytest.raises(ValueError):
        BlockPool(0)
    pool.check_integrity()


def test_caching_disabled_never_caches() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.try_allocate(1) or []
    assert pool.insert_cached(b, key(0)) == b
    assert pool.lookup([key(0)]) == [] and pool.missing([key(0)]) == [0]
    pool.release([b])
    assert pool.stats().num_free == 2


def test_check_integrity_describes_corruption() -> None:
    pool = BlockPool(3)
    (b,) = pool.try_allocate(1) or []
    pool._ref_counts[b] = 0  # leaked: neither free nor cached
    with pytest.raises(AssertionError, match=f"block {b}"):
        pool.check_integrity()
    pool = BlockPool(3)
    (b,) = pool.try_allocate(1) or []
    pool.insert_cached(b, key(0))
    pool._cached[key(1)] = b  # a second key for the same block
    with pytest.raises(AssertionError, match="maps to block"):
        pool.check_integrity()


# ---- random operation sequences ----

NUM_BLOCKS = 6


class PoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool and a plain model of it; they must agree after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.refs = [0] * NUM_BLOCKS
        self.key_of: dict[int, BlockHash] = {}
        self.block_of: dict[BlockHash, int] = {}
        self.lru: list[int] = []  # cached, unreferenced; oldest release first
        self.free = set(range(NUM_BLOCKS))
        self.next_key = 0

    def _drop_key(self, block_id: int) -> None:
        k = self.key_of.pop(block_id)
        del self.block_of[k]

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        got = self.pool.try_allocate(n)
        if n > len(self.free) + len(self.lru):
            assert got is None
            return
        assert got is not None and len(set(got)) == n
        num_evicted = max(0, n - len(self.free))
        evicted = self.lru[:num_evicted]
        assert set(got) - self.free == set(evicted), "eviction must take the oldest release"
        for b in evicted:
            self._drop_key(b)
        self.lru = self.lru[num_evicted:]
        self.free -= set(got)
        for b in got:
            assert self.pool.key_of(b) is None
            self.refs[b] = 1

    @precondition(lambda self: any(self.refs) or self.lru)
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        candidates = [b for b in range(NUM_BLOCKS) if self.refs[b] > 0] + self.lru
        b = data.draw(st.sampled_from(candidates))
        self.pool.acquire([b])
        if self.refs[b] == 0:
            self.lru.remove(b)
        self.refs[b] += 1

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from([b for b in range(NUM_BLOCKS) if self.refs[b] > 0]))
        self.pool.release([b])
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.key_of:
                self.lru.append(b)
            else:
                self.free.add(b)

    @precondition(lambda self: any(r > 0 and b not in self.key_of for b, r in enumerate(self.refs)))
    @rule(data=st.data(), reuse=st.booleans())
    def insert_cached(self, data: st.DataObject, reuse: bool) -> None:
        candidates = [b for b, r in enumerate(self.refs) if r > 0 and b not in self.key_of]
        b = data.draw(st.sampled_from(candidates))
        if reuse and self.block_of:
            k = data.draw(st.sampled_from(sorted(self.block_of)))
        else:
            k = key(self.next_key)
            self.next_key += 1
        got = self.pool.insert_cached(b, k)
        if k in self.block_of:
            assert got == self.block_of[k]
        else:
            assert got == b
            self.key_of[b] = k
            self.block_of[k] = b

    @rule(n=st.integers(0, 3))
    def evict(self, n: int) -> None:
        got = self.pool.evict(n)
        assert got == self.lru[:n]
        for b in got:
            self._drop_key(b)
            self.free.add(b)
        self.lru = self.lru[n:]

    @precondition(lambda self: bool(self.block_of))
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from([*sorted(self.block_of), key(-1)]), max_size=4))
        expected: list[int] = []
        for k in keys:
            if k not in self.block_of:
                break
            expected.append(self.block_of[k])
        assert self.pool.lookup(keys) == expected
        assert self.pool.missing(keys) == [i for i, k in enumerate(keys) if k not in self.block_of]

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        s = self.pool.stats()
        assert s.num_free == len(self.free)
        assert s.num_cached == len(self.lru)
        assert s.num_in_use == sum(1 for r in self.refs if r > 0)
        assert s.num_free + s.num_in_use + s.num_cached == s.total == NUM_BLOCKS
        assert all(self.pool.ref_count(b) == r for b, r in enumerate(self.refs))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_allocations_come_in_ascending_order_after_churn() -> None:
    """Blocks released tail first (descending) come back ascending: adjacent ascending
    blocks are what a KV transfer moves fastest."""
    pool = BlockPool(16)
    a, b = pool.try_allocate(8), pool.try_allocate(8)
    assert a is not None and b is not None
    pool.release(reversed(b))
    pool.release(reversed(a))  # the free queue now holds 15..8, 7..0
    again = pool.try_allocate(12)
    assert again == list(range(4, 16))  # 15..4 taken from the front, handed out ascending
    pool.check_integrity()
