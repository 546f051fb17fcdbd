"""Per-request view over the block pool: prefix hits, slot allocation, caching, freeing.

A request's block table after admission with a prefix hit (block_size 4)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . . | . . . .
    blocks      [  b7   |   b2    |   b9    |   b4   ]
                 hit (acquired)     fresh (try_allocate)
    computed    ├─────────────────┤            hit: num_computed_tokens = 8
    this step                     ├──────────┤ num_new_tokens = 2 (slots 8, 9)

Rules:

* Only FULL blocks are cached, and only once their KV is computed
  (`cache_full_blocks` after each step; blocks of generated tokens too).
* A hit never covers the whole token sequence unless asked: the last token
  must be computed to produce logits. KV that arrives from a remote sender
  (``allow_full_hit=True``) needs no local logits.
* Blocks are released tail first, so a request's tail is evicted before its
  head, which other requests are more likely to share. A request's release tags
  its blocks with its session, if it names one (`ReleaseTag.of_request`): the
  pool evicts by session value (`kvduplex.engine.eviction`).

Block hashes are computed once per full block and kept on the Request
(`Request.block_hashes`), extended as tokens arrive: O(tokens) overall.

With a KV tier below the pool (`kvduplex.engine.tier_link`), a lookup that stops
at a key the pool lacks promotes the run of following keys the tier holds, and
those blocks count as hits like any other; a new request's lookup leaves a run of
`tier_overlap_blocks` or more to its first forward, which reads it layer by layer
(`kvduplex.engine.tier_load`; counted as the tier's hits once loaded).

Hits by source (`num_hit_tokens_by_source`): a cached block that came from
elsewhere (promoted from the tier or the store, or sent by decode: a duplex
return, a retained turn, a fetch) carries its origin until its first hit at an
admission, which counts it there; every other hit counts as the pool's own.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvduplex.common.kv_layout import num_blocks_for_tokens
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.eviction import ReleaseTag
from kvduplex.engine.request import Request

if TYPE_CHECKING:
    from kvduplex.engine.tier_link import TierLink

logger = logging.getLogger(__name__)


class HitSource(enum.Enum):
    """Where the KV of a prefix-cache hit was before the admission that used it."""

    POOL = "pool"
    """This instance's own pool (computed here, or hit before)."""
    TIER = "tier"
    """Promoted from this instance's host or file tier."""
    STORE = "store"
    """Promoted from the shared store."""
    DECODE = "decode"
    """Sent or lent by a decode instance (a duplex return, a retained turn, a fetch)."""


@dataclass(frozen=True)
class PrefixHit:
    """The longest usable cached prefix of a request (no references taken yet)."""

    block_ids: tuple[int, ...]
    num_tokens: int
    """``len(block_ids) * block_size``."""


_NO_HIT = PrefixHit((), 0)


class KVCacheManager:
    """Allocates and caches the blocks of requests; the scheduler's only way to memory."""

    def __init__(
        self, pool: BlockPool, block_size: int, identity: bytes, tier: TierLink | None = None
    ) -> None:
        """`identity` (model and dtype) enters every block key; prefix caching is on
        if ``pool.enable_caching``. `tier`: the KV tier below the pool, if any."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.tier = tier
        self.block_size = block_size
        self.identity = identity
        # request id -> leading blocks of its table already in the prefix cache
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache hit rate = num_hit_tokens / num_queried_tokens, over admissions.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_hit_tokens_by_source = dict.fromkeys(HitSource, 0)
        """`num_hit_tokens` by where the blocks were (engine thread; read at scrape)."""
        self._origins: dict[int, HitSource] = {}
        """Cached blocks that came from elsewhere, until their first hit (or reuse)."""
        self.tier_overlap_blocks = 0
        """A tier run this long or longer is left in the tier by a lookup that may defer it
        (a new request's admission: its layer-wise load takes it); 0: always promoted."""

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def max_num_tokens(self) -> int:
        """Most tokens one request's KV can ever occupy (the whole pool)."""
        return self.pool.num_blocks * self.block_size

    def num_blocks_needed(self, num_tokens: int) -> int:
        return num_blocks_for_tokens(num_tokens, self.block_size)

    def update_block_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` to cover every full block of its known tokens."""
        num_full = req.num_tokens // self.block_size
        have = len(req.block_hashes)
        if num_full <= have:
            return
        parent = req.block_hashes[-1] if have else None
        tokens = req.all_token_ids[have * self.block_size : num_full * self.block_size]
        req.block_hashes.extend(
            compute_block_hashes(tokens, self.block_size, self.identity, parent)
        )

    def find_prefix_hit(
        self, req: Request, *, allow_full_hit: bool = False, defer_tier_run: bool = False
    ) -> PrefixHit:
        """The cached prefix of ``req.all_token_ids`` usable at admission.

        Without `allow_full_hit` at least the last token is left to compute.
        Takes no references: pass the hit to `try_allocate_slots` in the same step.
        Blocks promoted from the KV tier are left cached and unreferenced, like the rest
        of the hit (promoting them may evict other cached blocks). With
        `defer_tier_run`, a tier run of `tier_overlap_blocks` or more stays in the tier
        (the hit ends before it).
        """
        if not self.enable_prefix_caching:
            return _NO_HIT
        self.update_block_hashes(req)
        max_tokens = req.num_tokens if allow_full_hit else req.num_tokens - 1
        keys = req.block_hashes[: max_tokens // self.block_size]
        block_ids = self.cached_prefix(keys, defer_tier_run=defer_tier_run)
        return PrefixHit(tuple(block_ids), len(block_ids) * self.block_size)

    def cached_prefix(
        self, keys: Sequence[BlockHash], *, defer_tier_run: bool = False
    ) -> list[int]:
        """Block ids of the longest cached prefix of `keys`, the run that follows it in the
        KV tier promoted first (if there is a tier; with `defer_tier_run`, not if it is
        `tier_overlap_blocks` long or longer). Takes no references; empty with prefix
        caching off."""
        if not self.enable_prefix_caching:
            return []
        block_ids = self.pool.lookup(keys)
        tier = self.tier
        if tier is None or len(block_ids) == len(keys):
            return block_ids
        num_hit = len(block_ids)
        defer_from = self.tier_overlap_blocks if defer_tier_run else 0
        num_promoted = tier.promote(keys, block_ids, defer_from=defer_from)
        if num_promoted:
            block_ids = self.pool.lookup(keys)
            source = HitSource.STORE if tier.is_shared else HitSource.TIER
            for block_id in block_ids[num_hit : num_hit + num_promoted]:
                self._origins[block_id] = source
        return block_ids

    def try_allocate_slots(
        self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[int] | None:
        """Make the block table cover ``num_computed + hit + num_new_tokens`` positions.

        With a `hit` (admission only: the request holds no blocks and has
        computed nothing), the hit blocks are acquired first, so allocating the
        rest can never evict them. Returns the freshly allocated block ids, or
        None (nothing changed) if the pool cannot supply them now.
        """
        hit = hit or _NO_HIT
        is_admission = not req.block_ids and req.num_computed_tokens == 0
        if hit.block_ids and not is_admission:
            raise ValueError(f"request {req.request_id}: a prefix hit applies only at admission")
        num_tokens_after = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        num_have = len(req.block_ids) + len(hit.block_ids)
        num_new_blocks = max(0, self.num_blocks_needed(num_tokens_after) - num_have)
        num_revived = sum(1 for block_id in hit.block_ids if self.pool.is_evictable(block_id))
        if num_new_blocks + num_revived > self.pool.num_allocatable_blocks:
            return None
        self.pool.acquire(hit.block_ids)
        new_block_ids = self.pool.try_allocate(num_new_blocks)
        assert new_block_ids is not None, "allocation failed after the capacity check"
        self._forget_origins(new_block_ids)
        if hit.block_ids:
            req.block_ids.extend(hit.block_ids)
            self._num_cached_blocks[req.request_id] = len(hit.block_ids)
        req.block_ids.extend(new_block_ids)
        if is_admission:
            self.num_queried_tokens += req.num_tokens
            self.num_hit_tokens += hit.num_tokens
            for block_id in hit.block_ids:
                source = self._origins.pop(block_id, HitSource.POOL)
                self.num_hit_tokens_by_source[source] += self.block_size
        return new_block_ids

    def _forget_origins(self, block_ids: Sequence[int]) -> None:
        """Freshly allocated blocks hold nothing from elsewhere (any more)."""
        if self._origins:
            for block_id in block_ids:
                self._origins.pop(block_id, None)

    def cache_full_blocks(self, req: Request) -> int:
        """Insert the request's newly computed full blocks into the prefix cache.

        Call after ``req.num_computed_tokens`` advanced. A block whose key is
        already cached by another block stays private to this request. Returns
        the number of blocks newly registered.
        """
        if not self.enable_prefix_caching:
            return 0
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        start = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return 0
        self.update_block_hashes(req)
        num_inserted = 0
        for i in range(start, num_full):
            if self.pool.insert_cached(req.block_ids[i], req.block_hashes[i]) == req.block_ids[i]:
                num_inserted += 1
        self._num_cached_blocks[req.request_id] = num_full
        return num_inserted

    def drop_tail(self, req: Request, num_blocks_kept: int) -> None:
        """Release the request's blocks after the first `num_blocks_kept`, tail first."""
        tail = req.block_ids[num_blocks_kept:]
        self.pool.release(reversed(tail), ReleaseTag.of_request(req.session_id))
        del req.block_ids[num_blocks_kept:]
        cached = self._num_cached_blocks.get(req.request_id)
        if cached is not None and cached > num_blocks_kept:
            self._num_cached_blocks[req.request_id] = num_blocks_kept

    # ---- blocks outside any request (KV transfers) ----

    def acquire_blocks(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (a transfer reads or fills it)."""
        self.pool.acquire(block_ids)

    def release_blocks(self, block_ids: Sequence[int], tag: ReleaseTag | None = None) -> None:
        """Drop one reference on each block, tail first; `tag`: the class the blocks take
        on (None: a transfer's reference, which changes no block's class)."""
        self.pool.release(reversed(block_ids), tag)

    def num_cached_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading `keys` the prefix cache holds."""
        return self.pool.num_cached_prefix(keys) if self.enable_prefix_caching else 0

    def num_held_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading `keys` a prefix lookup (`cached_prefix`) would reach: the pool's
        run, the KV tier's run after it, and the pool's run after that. Nothing is loaded
        or referenced; the tier's entries found are touched (kept longer), and a store
        tier is asked once, within its deadline::

            keys     k0   k1 | k2   k3 | k4 | k5
            held     pool    | tier    | pool | -      -> 5
        """
        if not self.enable_prefix_caching:
            return 0
        num_held = self.pool.num_cached_prefix(keys)
        if self.tier is None or num_held == len(keys):
            return num_held
        num_run = self.tier.tier.find_run(keys[num_held:])
        if num_run == 0:
            return num_held
        num_held += num_run
        return num_held + self.pool.num_cached_prefix(keys[num_held:])

    def try_allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Fresh blocks (one reference each) for KV that arrives from elsewhere, evicting
        unreferenced cached blocks if needed; None if the pool cannot supply them now."""
        block_ids = self.pool.try_allocate(num_blocks)
        if block_ids is not None:
            self._forget_origins(block_ids)
        return block_ids

    def count_loaded(self, num_blocks: int, source: HitSource) -> None:
        """`num_blocks` of a prompt were loaded from `source` during its prefill instead of
        computed (a fetch read layer by layer): counted as hits from there."""
        self.num_hit_tokens_by_source[source] += num_blocks * self.block_size

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        keys: Sequence[BlockHash],
        origin: HitSource | None = None,
    ) -> int:
        """Insert filled blocks into the prefix cache under `keys`; the number newly cached
        (a key another block already holds keeps that block). `origin`: where their KV
        came from, counted at their first hit (None: computed here)."""
        if not self.enable_prefix_caching:
            return 0
        num_cached = 0
        for b, k in zip(block_ids, keys, strict=True):
            if self.pool.insert_cached(b, k) == b:
                num_cached += 1
                if origin is not None:
                    self._origins[b] = origin
        return num_cached

    def note_session(self, session_id: str | None) -> None:
        """A request arrived: its session's cached blocks count as live again."""
        if session_id:
            self.pool.note_session(session_id)

    def free(self, req: Request) -> None:
        """Release all of the request's blocks, tail first; cached ones stay reusable,
        tagged with the request's session (if it names one)."""
        self.pool.release(reversed(req.block_ids), ReleaseTag.of_request(req.session_id))
        req.block_ids.clear()
        self._num_cached_blocks.pop(req.request_id, None)


__all__ = ["HitSource", "KVCacheManager", "PrefixHit"]
