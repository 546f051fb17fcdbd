"""Paged KV blocks: reference counts, a hash-chain prefix cache, eviction by session value.

Every block is in exactly one of three states::

    FREE    ref 0, no key               in `_free` (FIFO)
    IN USE  ref > 0, with or without key
    CACHED  ref 0, with key             in `evictor` (its eviction order)

    FREE ──try_allocate──► IN USE ──release (ref→0, no key)──► FREE
                             │  ▲
      insert_cached (key) ───┘  └──acquire (cache hit revives)──┐
                             │                                  │
                             └──release (ref→0, keyed)──► CACHED ──evicted by try_allocate──► IN USE

`try_allocate` takes FREE blocks first and evicts CACHED ones only when it must,
in the evictor's order (`kvduplex.engine.eviction`: by session value, from the
class a request's `release` gives its blocks, or LRU). Invariant: free + in use +
cached = total. An evicted block is handed to `on_evict` (the KV tier's
demotion) before anyone can overwrite its KV.

Prefix-cache keys form a chain over FULL blocks only (a partial block is
never cached)::

    tokens:  [ t0 .. t15 | t16 .. t31 | t32 .. t40 ]   block_size 16
    keys:      k0          k1           (partial: none)
    k0 = H(ROOT, identity, t0..t15)     k1 = H(k0, identity, t16..t31)

H is BLAKE2b-256 over ``parent(32 B) | len(identity) u32 LE | identity |
tokens as int64 LE``: the same prefix gives the same chain in every process and
on every machine, so instances can name blocks to each other by key.

Single-threaded: the engine loop owns the pool.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from kvduplex.common.engine_config import EvictionPolicy
from kvduplex.engine.eviction import Clock
from kvduplex.engine.eviction import Evictor
from kvduplex.engine.eviction import ReleaseTag
from kvduplex.engine.eviction import make_evictor

logger = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", bytes)
"""Prefix-cache key of one full block (32 bytes)."""

BLOCK_HASH_BYTES = 32
_ROOT = BlockHash(bytes(BLOCK_HASH_BYTES))


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], identity: bytes) -> BlockHash:
    """Key of one full block whose predecessor's key is `parent` (None for the first)."""
    h = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
    h.update(_ROOT if parent is None else parent)
    h.update(struct.pack("<I", len(identity)))
    h.update(identity)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return BlockHash(h.digest())


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    identity: bytes,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Keys of the full blocks of `token_ids` (a trailing partial block gets none).

    `parent` is the key of the block just before ``token_ids[0]``, so a chain
    can be extended: ``compute(a + b) == compute(a) + compute(b, parent=last key of a)``
    when ``len(a)`` is a multiple of `block_size`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], identity)
        hashes.append(parent)
    return hashes


EvictHook = Callable[[int, BlockHash], None]
"""``hook(block_id, key)``: a CACHED block is being evicted; its KV is intact until the
hook returns (the pool's owner thread calls it, inside `try_allocate` or `evict`)."""


@dataclass(frozen=True)
class PoolStats:
    """Block counts; ``num_free + num_in_use + num_cached == total``."""

    num_free: int
    """Blocks holding nothing."""
    num_in_use: int
    """Blocks referenced by at least one request (or transfer)."""
    num_cached: int
    """Unreferenced blocks kept for the prefix cache (evictable)."""
    total: int

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced right now."""
        return self.num_in_use / self.total


class BlockPool:
    """A fixed set of `num_blocks` KV blocks with ref counts and a prefix cache.

    Callers (the KV manager, the transfer layer) hold references: every block
    id returned by `try_allocate` or passed to `acquire` must later be passed
    to `release` exactly once. Block ids are ``0 .. num_blocks-1``.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        *,
        eviction: EvictionPolicy = EvictionPolicy.SESSION,
        session_idle_s: float = 180.0,
        clock: Clock = time.monotonic,
    ) -> None:
        """`eviction`, `session_idle_s`: the order in which cached blocks are evicted
        (`kvduplex.engine.eviction`); `clock`: monotonic seconds, for sessions' idle time."""
        if num_blocks < 1:
            raise ValueError(f"the block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Off: nothing is ever cached; lookups miss, insert_cached registers nothing.
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._keys: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self.evictor: Evictor = make_evictor(eviction, num_blocks, session_idle_s, clock)
        """The CACHED blocks in eviction order, the blocks' classes, evictions by class."""
        self.epoch = os.urandom(8).hex()
        """Names this pool's life (an instance start): `num_allocated` counts from it."""
        self.num_allocated = 0
        """Blocks handed out since start, fresh (`try_allocate`) or revived from the cache
        (`acquire`): the pool's clock. Every block handed out goes back behind the others
        when released, so a cached block released when the clock read t can be evicted only
        after about `num_blocks` more have been handed out (under LRU; a live session's
        later, by session value). Counting allocations alone misses the revivals: sessions
        that take turns in a cycle larger than the pool each revive their history ahead of
        the one released longest ago, which is then evicted after far fewer allocations.
        The router reads this to tell whether a session's blocks are likely still here."""
        self.on_evict: EvictHook | None = None
        """Called with each CACHED block evicted, before it is handed out again (set by
        the KV tier's link, which copies its KV down)."""

    # ---- queries (no side effects) ----

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks `try_allocate` could hand out now (free plus evictable cached)."""
        return len(self._free) + len(self.evictor)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def key_of(self, block_id: int) -> BlockHash | None:
        """The prefix-cache key a block is registered under, if any."""
        return self._keys[block_id]

    def is_evictable(self, block_id: int) -> bool:
        """True if the block is CACHED (unreferenced, keyed): acquiring it revives it."""
        return block_id in self.evictor

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`. Takes no references."""
        block_ids: list[int] = []
        for key in hashes:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_cached_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading `hashes` that are cached."""
        return len(self.lookup(hashes))

    def missing(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Indices into `hashes` of the keys that are not cached (anywhere in the list)."""
        return [i for i, key in enumerate(hashes) if key not in self._cached]

    def stats(self) -> PoolStats:
        num_free = len(self._free)
        num_cached = len(self.evictor)
        return PoolStats(
            num_free=num_free,
            num_in_use=self.num_blocks - num_free - num_cached,
            num_cached=num_cached,
            total=self.num_blocks,
        )

    # ---- reference changes ----

    def try_allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` fresh blocks (ref 1, no key), or None if there are not enough.

        Free blocks go first; then cached ones are evicted in the evictor's order,
        and their keys leave the prefix cache. The ids come in
        ascending order: requests release their blocks tail first, so the free
        queue and the LRU hold descending runs, and a request's consecutive
        blocks that are adjacent and ascending in the pool move several times
        faster in one KV transfer than descending or scattered ones (figures in
        docs/transfer.md).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_allocatable_blocks:
            return None
        free = self._free
        block_ids = [free.popleft() for _ in range(min(num_blocks, len(free)))]
        if len(block_ids) < num_blocks:
            block_ids += self._evict(num_blocks - len(block_ids))
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        self.evictor.untag(block_ids)
        self.num_allocated += num_blocks
        block_ids.sort()
        return block_ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a CACHED block is revived (leaves the LRU).

        Raises ValueError for a FREE block: its content is meaningless.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self.evictor:
                    raise ValueError(
                        f"block {block_id} is free; only used or cached blocks can be acquired"
                    )
                self.evictor.remove(block_id)
                self.num_allocated += 1  # handed out again (see `num_allocated`)
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int], tag: ReleaseTag | None = None) -> None:
        """Drop one reference on each block, in the order given; a block reaching 0 becomes
        CACHED (most recently released) if it has a key, else FREE. Release a request's
        blocks tail first so that its tail is evicted before its head. `tag`: the releasing
        request's class and session, which the blocks take on (the highest class kept);
        None (a transfer's reference) changes no block's class."""
        released: list[int] = []
        to_cache: list[int] = []
        try:
            for block_id in block_ids:
                ref = self._ref_counts[block_id]
                if ref <= 0:
                    msg = f"block {block_id} released more often than it was referenced"
                    raise ValueError(msg)
                self._ref_counts[block_id] = ref - 1
                if tag is not None:
                    released.append(block_id)
                if ref == 1:
                    if self._keys[block_id] is None:
                        self._free.append(block_id)
                    else:
                        to_cache.append(block_id)
        finally:  # what was released is consistent even when a later block was not
            if tag is not None:
                self.evictor.tag(released, tag)
            if to_cache:
                self.evictor.push(to_cache)

    def note_session(self, session_id: str) -> None:
        """A request of `session_id` arrived: its cached blocks count as live again."""
        self.evictor.note_session(session_id)

    def insert_cached(self, block_id: int, key: BlockHash) -> int:
        """Register a filled, referenced block under `key`; return the block now cached under it.

        If `key` is already cached by another block, that one is kept and its id
        returned (the caller's block stays unkeyed and becomes FREE on release).
        Re-inserting a block under its own key is a no-op. With caching
        disabled nothing is registered and `block_id` is returned.
        """
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} must be referenced to be inserted into the cache")
        if not self.enable_caching:
            return block_id
        own_key = self._keys[block_id]
        if own_key is not None:
            if own_key != key:
                raise ValueError(f"block {block_id} is already cached under another key")
            return block_id
        existing = self._cached.get(key)
        if existing is not None:
            return existing
        self._keys[block_id] = key
        self._cached[key] = block_id
        return block_id

    def evict(self, num_blocks: int) -> list[int]:
        """Turn up to `num_blocks` CACHED blocks FREE, in eviction order; return their ids."""
        evicted = self._evict(min(num_blocks, len(self.evictor)))
        self._free.extend(evicted)
        return evicted

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block (neither handed to `on_evict` nor counted
        as evicted: a reset forgets them); return how many were dropped."""
        num_dropped = len(self.evictor)
        self._free.extend(self._evict(num_dropped, is_reset=True))
        logger.info("prefix cache reset: %d cached blocks dropped", num_dropped)
        return num_dropped

    def _evict(self, num_blocks: int, is_reset: bool = False) -> list[int]:
        """Take the next `num_blocks` CACHED blocks out of the cache, each handed to
        `on_evict` first (unless `is_reset`); return them, in eviction order."""
        victims = self.evictor.pop(num_blocks, count=not is_reset)
        on_evict = None if is_reset else self.on_evict
        for block_id in victims:
            key = self._keys[block_id]
            assert key is not None and self._cached.get(key) == block_id, (
                f"evictable block {block_id} not in the cache"
            )
            if on_evict is not None:
                try:
                    on_evict(block_id, key)
                except Exception:  # the block is evicted either way; only its copy is lost
                    logger.exception("eviction hook failed for block %d", block_id)
            del self._cached[key]
            self._keys[block_id] = None
        return victims

    # ---- integrity ----

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant (works under ``-O``)."""
        problems = self._integrity_problems()
        if problems:
            raise AssertionError("block pool inconsistent: " + "; ".join(problems))

    def _integrity_problems(self) -> list[str]:
        problems: list[str] = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("a block appears twice in the free queue")
        cached = set(self.evictor)
        problems.extend(self.evictor.problems())
        both = free & cached
        if both:
            problems.append(f"blocks both free and cached: {sorted(both)}")
        for block_id, ref in enumerate(self._ref_counts):
            problems.extend(
                self._block_problems(block_id, ref, block_id in free, block_id in cached)
            )
        for key, block_id in self._cached.items():
            if self._keys[block_id] != key:
                problems.append(
                    f"key {key.hex()[:12]} maps to block {block_id}, which has another key"
                )
        stats = self.stats()
        num_in_use = sum(1 for ref in self._ref_counts if ref > 0)
        if stats.num_free + num_in_use + stats.num_cached != self.num_blocks:
            problems.append(
                f"free {stats.num_free} + in use {num_in_use} + cached {stats.num_cached}"
                f" != total {self.num_blocks}"
            )
        return problems

    def _block_problems(self, block_id: int, ref: int, is_free: bool, is_cached: bool) -> list[str]:
        """One block's ref count against the free queue and the cache, and its key."""
        problems: list[str] = []
        key = self._keys[block_id]
        if ref < 0:
            problems.append(f"block {block_id} has ref count {ref}")
        elif ref == 0 and is_free == is_cached:
            problems.append(f"unreferenced block {block_id} is neither free nor cached")
        elif ref > 0 and (is_free or is_cached):
            problems.append(f"referenced block {block_id} (ref {ref}) is in a free/cached list")
        if is_free and key is not None:
            problems.append(f"free block {block_id} still has a key")
        if is_cached and key is None:
            problems.append(f"cached block {block_id} has no key")
        if key is not None and self._cached.get(key) != block_id:
            problems.append(f"block {block_id}'s key maps to {self._cached.get(key)}")
        return problems


__all__ = [
    "BLOCK_HASH_BYTES",
    "BlockHash",
    "BlockPool",
    "EvictHook",
    "PoolStats",
    "compute_block_hashes",
    "hash_block",
]
