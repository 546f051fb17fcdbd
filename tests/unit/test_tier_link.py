"""The pool and its tier under a seeded random workload: every block the prefix cache
holds (from the pool, or promoted from the tier) has exactly the KV of its key, even
while tier slots are corrupted, and the pool's accounting stays consistent."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.kv_tier import HEADER_BYTES
from kvduplex.engine.kv_tier import HostTier
from kvduplex.engine.kv_tier import SlotTier
from kvduplex.engine.kv_tier_file import FileTier
from kvduplex.engine.request import Request
from kvduplex.engine.tier_link import TierLink

BS = 4
NUM_BLOCKS = 12
LAYOUT = KVCacheLayout(
    num_layers=2, num_blocks=NUM_BLOCKS, block_size=BS, num_kv_heads=1, head_dim=4
)
IDENTITY = b"m"
BLOCK_SHAPE = LAYOUT.shape[:2] + LAYOUT.shape[3:]


def kv_of(key: BlockHash) -> torch.Tensor:
    """The KV a block with this key holds when computed: distinct per key."""
    base = float(int.from_bytes(key[:3], "little"))
    return torch.arange(LAYOUT.bytes_per_block // 4, dtype=torch.float32).view(BLOCK_SHAPE) + base


def check_cache(pool: BlockPool, kv_pool: torch.Tensor) -> None:
    """Every cached key's block holds that key's KV; the accounting holds."""
    pool.check_integrity()
    for block_id in range(pool.num_blocks):
        key = pool.key_of(block_id)
        if key is not None:
            assert torch.equal(kv_pool[:, :, block_id], kv_of(key)), f"block {block_id}"


def flip_random_slot(tier: SlotTier, rng: random.Random) -> None:
    tier.flush()
    slot = rng.randrange(tier.num_slots)
    offset = slot * tier.slot_bytes + rng.choice(
        [10, 50, HEADER_BYTES + rng.randrange(LAYOUT.bytes_per_block)]
    )
    if isinstance(tier, HostTier):
        tier.slots.view(-1)[offset] ^= 0x01
    else:
        assert isinstance(tier, FileTier)
        byte = os.pread(tier.fileno(), 1, offset)
        if byte:
            os.pwrite(tier.fileno(), bytes([byte[0] ^ 0x01]), offset)


@pytest.mark.parametrize("kind", ["host", "file"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_blocks_always_hold_their_keys_kv(kind: str, seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    kv_pool = torch.zeros(LAYOUT.shape)
    pool = BlockPool(NUM_BLOCKS)
    tier: SlotTier = (
        HostTier(LAYOUT, IDENTITY, 6)
        if kind == "host"
        else FileTier(LAYOUT, IDENTITY, 6, str(tmp_path))
    )
    link = TierLink(tier, kv_pool, pool)
    kv = KVCacheManager(pool, BS, IDENTITY, link)
    stems = [[rng.randrange(1, 9) for _ in range(12)] for _ in range(4)]
    live: list[Request] = []
    num_flips = num_tier_hits = 0
    for step in range(250):
        if live and rng.random() < 0.5:
            kv.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.08:
            flip_random_slot(tier, rng)
            num_flips += 1
        else:
            prompt = rng.choice(stems)[: rng.randrange(4, 13)] + [
                rng.randrange(1, 9) for _ in range(rng.randrange(0, 9))
            ]
            req = Request(f"r{step}", prompt, SamplingParams(max_tokens=1))
            loaded_before = tier.stats.num_loaded_blocks
            hit = kv.find_prefix_hit(req)
            num_tier_hits += tier.stats.num_loaded_blocks - loaded_before
            for i, block_id in enumerate(hit.block_ids):
                assert torch.equal(kv_pool[:, :, block_id], kv_of(req.block_hashes[i]))
            if kv.try_allocate_slots(req, req.num_tokens - hit.num_tokens, hit) is not None:
                for i in range(len(hit.block_ids), req.num_tokens // BS):  # "compute" the rest
                    kv_pool[:, :, req.block_ids[i]] = kv_of(req.block_hashes[i])
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
                live.append(req)
        check_cache(pool, kv_pool)
    assert num_tier_hits > 0 and tier.stats.num_stored_blocks > 0
    assert tier.stats.num_corrupt_blocks <= num_flips
    link.close()
