"""Moves blocks between the KV pool and the tier below it (`kvduplex.engine.kv_tier`).

Demote: the block pool hands every CACHED block it evicts to `TierLink.demote`
before the block can be handed out again, and its KV is copied into the tier
under its prefix-cache key.

Promote: when a prefix lookup stops at a key the pool lacks, `TierLink.promote`
loads the run of following keys the tier holds into fresh pool blocks and
registers them in the prefix cache, so the lookup goes on through them::

    keys        k0   k1   k2 | k3   k4   k5 | k6
    pool        b7   b2   -  |              |         lookup stops at k2
    tier                  k2   k3   k4      |         run: k2 k3 k4 (k5 absent)
    after       b7   b2   b5   b9   b1              promoted: cached, unreferenced

The hit blocks are referenced while the run is allocated, so that allocation
(which may evict, and so demote, other blocks) cannot evict them. A load that
fails its check ends the run there: the rest is computed.

A new request's lookup may leave a long run in the tier instead (``defer_from``):
its first forward reads it layer by layer (`kvduplex.engine.tier_load`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.kv_store_client import MooncakeSettings
from kvduplex.engine.kv_store_client import connect_mooncake
from kvduplex.engine.kv_store_client import require_mooncake
from kvduplex.engine.kv_tier import HostTier
from kvduplex.engine.kv_tier import KVTier
from kvduplex.engine.kv_tier import slot_bytes
from kvduplex.engine.kv_tier_file import FileTier
from kvduplex.engine.kv_tier_store import StoreTier

if TYPE_CHECKING:
    from kvduplex.engine.tier_load import TierLoads

logger = logging.getLogger(__name__)


class TierLink:
    """One pool and its tier. Engine thread only; becomes the pool's `on_evict`."""

    def __init__(self, tier: KVTier, kv_pool: torch.Tensor, pool: BlockPool) -> None:
        """`kv_pool`: the pool's memory, (num_layers, 2, num_blocks, block_size, heads, dim)."""
        self.tier = tier
        self.kv_pool = kv_pool
        self.pool = pool
        self.is_shared = isinstance(tier, StoreTier)
        """The tier is the store that instances share (its hits count as the store's)."""
        self.loads: TierLoads | None = None
        """The layer-wise loads of long hits, if this tier serves them (the engine's)."""
        pool.on_evict = self.demote

    def demote(self, block_id: int, key: BlockHash) -> None:
        """Copy an evicted block's KV into the tier (the pool's eviction hook)."""
        self.tier.store(key, self.kv_pool[:, :, block_id])

    def promote(self, keys: Sequence[BlockHash], hit: Sequence[int], *, defer_from: int = 0) -> int:
        """Load the keys after the cached prefix `hit` (block ids of ``keys[:len(hit)]``)
        that the tier holds, in order, into fresh blocks cached under them; return how
        many were loaded. The blocks are left CACHED and unreferenced, right after `hit`
        in the chain, like any prefix-cache hit. A run of `defer_from` blocks or more
        (0: none) is left in the tier, touched, for a layer-wise load, unless the pool
        holds the key after it (`is_deferrable`)."""
        following = keys[len(hit) :]
        # Touched by the lookup: outlives the demotions the allocation below may cause.
        run = following[: self.tier.find_run(following)]
        if not run or (defer_from and is_deferrable(run, following, self.pool, defer_from)):
            return 0
        pool = self.pool
        pool.acquire(hit)
        try:
            block_ids = pool.try_allocate(min(len(run), pool.num_allocatable_blocks)) or []
            num_loaded = 0
            for block_id, key in zip(block_ids, run, strict=False):
                if not self.tier.load(key, self.kv_pool[:, :, block_id]):
                    break
                pool.insert_cached(block_id, key)
                num_loaded += 1
            pool.release(reversed(block_ids))  # the loaded ones stay cached, the rest free
        finally:
            pool.release(reversed(hit))
        if num_loaded:
            logger.debug("KV tier: %d blocks promoted after a %d-block hit", num_loaded, len(hit))
        return num_loaded

    def close(self) -> None:
        """Detach from the pool, stop the layer-wise loader and close the tier (pending
        writes finish first)."""
        self.pool.on_evict = None
        if self.loads is not None:
            self.loads.close()
        self.tier.close()


def is_deferrable(
    run: Sequence[BlockHash], following: Sequence[BlockHash], pool: BlockPool, min_blocks: int
) -> bool:
    """Whether the tier's `run` (the head of `following`, the keys after a pool hit) is
    for a layer-wise load: `min_blocks` long or longer, and neither it nor the key after
    it held by the pool too. A layer-wise load ends the hit where the run ends, so a pool
    run after it (a duplex return's blocks after the part the tier kept) would be
    computed again: such a run is promoted whole, and the lookup goes on through the
    pool's blocks after it."""
    if len(run) < min_blocks:
        return False
    return not any(pool.num_cached_prefix([key]) for key in following[: len(run) + 1])


def build_tier(
    config: CacheConfig, layout: KVCacheLayout, identity: bytes, device: torch.device
) -> KVTier | None:
    """The tier `config` asks for (None for ``kv_tier none``), sized in whole slots.

    Raises ValueError if the size holds no block or the store's client is not
    installed, OSError if the file tier's space cannot be reserved; each says what to
    change.
    """
    kind = config.kv_tier
    if kind is KVTierKind.NONE:
        return None
    align = {KVTierKind.FILE: FileTier.ALIGN, KVTierKind.HOST: HostTier.ALIGN}.get(kind, 1)
    num_slots = config.kv_tier_blocks or int(config.kv_tier_gib * 2**30) // slot_bytes(
        layout, align
    )
    if num_slots < 1:
        raise ValueError(
            f"kv_tier_gib {config.kv_tier_gib} holds no block of "
            f"{slot_bytes(layout, align) / 2**20:.2f} MiB; raise kv_tier_gib or set "
            "kv_tier_blocks"
        )
    tier: KVTier
    if kind is KVTierKind.STORE:
        tier = _store_tier(config, layout, identity, num_slots)
    elif kind is KVTierKind.FILE:
        tier = FileTier(layout, identity, num_slots, config.kv_tier_path)
    else:
        tier = HostTier(layout, identity, num_slots, pin_memory=device.type == "cuda")
    logger.info(
        "KV tier: %s, %d blocks, %.2f GiB",
        kind.value, num_slots, num_slots * slot_bytes(layout, align) / 2**30,
    )  # fmt: skip
    return tier


def _store_tier(
    config: CacheConfig, layout: KVCacheLayout, identity: bytes, num_slots: int
) -> StoreTier:
    """A store tier joining the Mooncake store `config` names (in the background)."""
    require_mooncake()
    settings = MooncakeSettings(
        master=config.kv_store_master,
        metadata_url=config.store_metadata_url(),
        local_host=config.kv_store_local_host,
        # A put or get passes through it: room for a few blocks.
        local_buffer_bytes=max(64 * 2**20, 4 * slot_bytes(layout, 1)),
    )
    logger.info(
        "KV tier: joining the Mooncake store at %s (metadata %s)",
        settings.master, settings.metadata_url,
    )  # fmt: skip
    return StoreTier(
        layout, identity, num_slots, partial(connect_mooncake, settings),
        timeout_s=config.kv_store_timeout_s, retry_s=config.kv_store_retry_s,
    )  # fmt: skip


def attach_tier(
    config: CacheConfig,
    layout: KVCacheLayout,
    identity: bytes,
    kv_pool: torch.Tensor,
    pool: BlockPool,
) -> TierLink | None:
    """The tier `config` asks for, linked below `pool`; None without one."""
    tier = build_tier(config, layout, identity, kv_pool.device)
    return None if tier is None else TierLink(tier, kv_pool, pool)


__all__ = ["TierLink", "attach_tier", "build_tier", "is_deferrable"]
