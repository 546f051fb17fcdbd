"""The KV tier below the pool: store and load whole blocks by key, LRU bounds, and the
checks that keep a torn, truncated or foreign slot from ever being used."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import BlockPool
from kvduplex.engine.kv_tier import HEADER_BYTES
from kvduplex.engine.kv_tier import HostTier
from kvduplex.engine.kv_tier import SlotTier
from kvduplex.engine.kv_tier_file import FileTier
from kvduplex.engine.tier_link import TierLink
from kvduplex.engine.tier_link import build_tier

LAYOUT = KVCacheLayout(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
IDENTITY = b"test-model\x1ffloat32"


def key(n: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(n.to_bytes(8, "little"), digest_size=32).digest())


def random_pool(seed: int = 0) -> torch.Tensor:
    """A pool of LAYOUT filled with distinct values."""
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["host", "file"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SlotTier]:
    made: SlotTier = (
        HostTier(LAYOUT, IDENTITY, 3)
        if request.param == "host"
        else FileTier(LAYOUT, IDENTITY, 3, str(tmp_path))
    )
    yield made
    made.close()


def test_store_then_load_gives_the_same_bytes(tier: SlotTier) -> None:
    pool = random_pool()
    tier.store(key(1), pool[:, :, 2])
    tier.store(key(2), pool[:, :, 4])
    pool_before = pool.clone()
    pool[:, :, 2] = 0  # the pool block is reused at once: the tier kept its own copy
    out = torch.zeros(pool[:, :, 0].shape)
    assert tier.load(key(1), out)
    assert torch.equal(out, pool_before[:, :, 2])
    assert tier.load(key(2), out)
    assert torch.equal(out, pool_before[:, :, 4])
    assert not tier.load(key(3), out)
    s = tier.stats
    assert (s.num_stored_blocks, s.num_loaded_blocks, s.num_corrupt_blocks) == (2, 2, 0)
    tier.flush()
    one_slot = HEADER_BYTES + LAYOUT.bytes_per_block
    assert s.num_written_bytes == 2 * one_slot and s.num_read_bytes == 2 * one_slot


def test_storing_a_held_key_again_writes_nothing(tier: SlotTier) -> None:
    pool = random_pool()
    tier.store(key(1), pool[:, :, 0])
    tier.store(key(1), pool[:, :, 1])
    assert tier.stats.num_stored_blocks == 1 and tier.num_used == 1
    out = torch.zeros(pool[:, :, 0].shape)
    assert tier.load(key(1), out) and torch.equal(out, pool[:, :, 0])


def test_least_recently_used_entry_makes_room(tier: SlotTier) -> None:
    pool = random_pool()
    for n in range(3):
        tier.store(key(n), pool[:, :, n])
    tier.touch(key(0))  # now key(1) is the oldest use
    tier.store(key(3), pool[:, :, 3])
    assert [tier.contains(key(n)) for n in range(4)] == [True, False, True, True]
    assert tier.stats.num_evicted_blocks == 1 and tier.num_used == tier.num_slots == 3
    out = torch.zeros(pool[:, :, 0].shape)
    assert tier.load(key(2), out)  # a load is a use: key(0) goes next
    tier.store(key(4), pool[:, :, 4])
    assert not tier.contains(key(0))
    for n in (2, 3, 4):
        assert tier.load(key(n), out) and torch.equal(out, pool[:, :, n])


def flip_byte(tier: SlotTier, k: BlockHash, offset_in_slot: int) -> None:
    """Invert one byte of the slot holding `k`, where it is stored."""
    tier.flush()
    slot = tier.slot_of(k)
    assert slot is not None
    if isinstance(tier, HostTier):
        tier.slots[slot, offset_in_slot] ^= 0xFF
    else:
        assert isinstance(tier, FileTier)
        position = slot * tier.slot_bytes + offset_in_slot
        byte = os.pread(tier.fileno(), 1, position)
        os.pwrite(tier.fileno(), bytes([byte[0] ^ 0xFF]), position)


@pytest.mark.parametrize(
    "offset", [0, 20, 60, HEADER_BYTES + 5, HEADER_BYTES + LAYOUT.bytes_per_block - 1]
)
def test_a_flipped_byte_anywhere_is_caught_and_dropped(tier: SlotTier, offset: int) -> None:
    """Magic, key, length and payload bytes: each flip fails the check."""
    pool = random_pool()
    tier.store(key(1), pool[:, :, 1])
    tier.store(key(2), pool[:, :, 2])
    flip_byte(tier, key(1), offset)
    out = torch.full(pool[:, :, 0].shape, 7.0)
    assert not tier.load(key(1), out)
    assert torch.all(out == 7.0), "a corrupt slot must not reach the pool"
    assert tier.stats.num_corrupt_blocks == 1 and not tier.contains(key(1))
    assert tier.load(key(2), out) and torch.equal(out, pool[:, :, 2])
    tier.store(key(1), pool[:, :, 1])  # stored again, into a good slot
    assert tier.load(key(1), out) and torch.equal(out, pool[:, :, 1])


def test_a_well_formed_slot_of_another_key_is_refused(tier: SlotTier) -> None:
    """Copying a whole valid slot over another's passes the CRC; the key check stops it."""
    pool = random_pool()
    tier.store(key(1), pool[:, :, 1])
    tier.store(key(2), pool[:, :, 2])
    tier.flush()
    src, dst = tier.slot_of(key(1)), tier.slot_of(key(2))
    assert src is not None and dst is not None
    if isinstance(tier, HostTier):
        tier.slots[dst] = tier.slots[src]
    else:
        assert isinstance(tier, FileTier)
        data = os.pread(tier.fileno(), tier.slot_bytes, src * tier.slot_bytes)
        os.pwrite(tier.fileno(), data, dst * tier.slot_bytes)
    out = torch.zeros(pool[:, :, 0].shape)
    assert not tier.load(key(2), out)
    assert tier.stats.num_corrupt_blocks == 1
    assert tier.load(key(1), out) and torch.equal(out, pool[:, :, 1])


def test_a_truncated_file_is_caught(tmp_path: Path) -> None:
    tier = FileTier(LAYOUT, IDENTITY, 4, str(tmp_path))
    try:
        pool = random_pool()
        for n in range(3):
            tier.store(key(n), pool[:, :, n])
        tier.flush()
        last = max(tier.slot_of(key(n)) or 0 for n in range(3))
        os.ftruncate(tier.fileno(), last * tier.slot_bytes + HEADER_BYTES + 10)  # mid-payload
        out = torch.zeros(pool[:, :, 0].shape)
        loaded = [tier.load(key(n), out) for n in range(3)]
        assert loaded.count(False) == 1 and tier.stats.num_corrupt_blocks == 1
        os.ftruncate(tier.fileno(), 0)
        assert not any(tier.load(key(n), out) for n in range(3))
        assert tier.stats.num_corrupt_blocks == 3 and tier.num_used == 0
    finally:
        tier.close()


def test_a_slot_written_for_another_model_fails_the_check() -> None:
    """The layout id (model identity, shapes, dtype) is in the header and the CRC."""
    tier = HostTier(LAYOUT, IDENTITY, 2)
    other = HostTier(LAYOUT, b"other-model", 2)
    pool = random_pool()
    tier.store(key(1), pool[:, :, 1])
    other.store(key(1), pool[:, :, 1])
    tier.flush()
    other.flush()
    other.slots.copy_(tier.slots)
    out = torch.zeros(pool[:, :, 0].shape)
    assert not other.load(key(1), out) and other.stats.num_corrupt_blocks == 1
    tier.close()
    other.close()


class _FailingFileTier(FileTier):
    """A disk that refuses every write."""

    def _persist(self, slot: int, header: bytes, payload: torch.Tensor) -> None:
        raise OSError(28, "No space left on device")


def test_a_failed_write_is_counted_and_never_loaded(tmp_path: Path) -> None:
    tier = _FailingFileTier(LAYOUT, IDENTITY, 2, str(tmp_path))
    pool = random_pool()
    tier.store(key(1), pool[:, :, 1])
    out = torch.zeros(pool[:, :, 0].shape)
    assert not tier.load(key(1), out)
    assert tier.stats.num_write_failures == 1 and not tier.contains(key(1))
    tier.close()


def test_file_tier_file_is_unnamed_and_preallocated(tmp_path: Path) -> None:
    tier = FileTier(LAYOUT, IDENTITY, 5, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing to clean up after a crash
    assert os.fstat(tier.fileno()).st_size == 5 * tier.slot_bytes
    assert tier.slot_bytes % 4096 == 0
    tier.close()


def test_build_tier_sizes_from_config(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert build_tier(CacheConfig(), LAYOUT, IDENTITY, cpu) is None
    host = build_tier(CacheConfig(kv_tier=KVTierKind.HOST, kv_tier_blocks=7), LAYOUT, IDENTITY, cpu)
    assert isinstance(host, HostTier) and host.num_slots == 7
    gib = 64 * 4096 / 2**30  # 64 file slots of 4 KiB
    cfg = CacheConfig(kv_tier=KVTierKind.FILE, kv_tier_gib=gib, kv_tier_path=str(tmp_path))
    file = build_tier(cfg, LAYOUT, IDENTITY, cpu)
    assert isinstance(file, FileTier) and file.num_slots == 64 and file.directory == str(tmp_path)
    tiny = CacheConfig(kv_tier=KVTierKind.HOST, kv_tier_gib=1e-9)
    with pytest.raises(ValueError, match="raise kv_tier_gib"):
        build_tier(tiny, LAYOUT, IDENTITY, cpu)
    for made in (host, file):
        made.close()


def test_pool_demotes_evicted_blocks_and_promotes_them_back() -> None:
    """Through the link: an evicted block's bytes land in the tier; a lookup past the
    pool's hit loads the run the tier holds into fresh blocks, cached under their keys."""
    kv_pool = random_pool()
    pool = BlockPool(LAYOUT.num_blocks)
    link = TierLink(HostTier(LAYOUT, IDENTITY, 8), kv_pool, pool)
    keys = [key(n) for n in range(4)]
    blocks = pool.try_allocate(4)
    assert blocks is not None
    for b, k in zip(blocks, keys, strict=True):
        pool.insert_cached(b, k)
    pool.release(reversed(blocks))  # cached; the tail is the oldest
    content = {k: kv_pool[:, :, b].clone() for b, k in zip(blocks, keys, strict=True)}
    fresh = pool.try_allocate(LAYOUT.num_blocks)  # evicts all four: demoted
    assert fresh is not None
    assert all(link.tier.contains(k) for k in keys) and pool.lookup(keys) == []
    kv_pool[:, :, fresh] = -1.0  # their KV is overwritten in the pool
    pool.release(fresh)

    assert link.promote(keys, []) == 4
    hit = pool.lookup(keys)
    assert len(hit) == 4 and all(pool.is_evictable(b) for b in hit)
    for b, k in zip(hit, keys, strict=True):
        assert torch.equal(kv_pool[:, :, b], content[k])
    pool.check_integrity()
    assert link.promote(keys, hit) == 0  # nothing past a whole hit

    pool.reset_prefix_cache()  # a reset forgets: nothing is demoted again
    assert link.tier.stats.num_stored_blocks == 4
    link.close()
    assert pool.on_evict is None


def test_promotion_keeps_the_hit_it_extends() -> None:
    """A pool whose every other block is the hit: promoting must not evict the hit."""
    kv_pool = random_pool()
    pool = BlockPool(3)
    link = TierLink(HostTier(LAYOUT, IDENTITY, 8), kv_pool, pool)
    keys = [key(n) for n in range(3)]
    blocks = pool.try_allocate(3)
    assert blocks is not None
    for b, k in zip(blocks, keys, strict=True):
        pool.insert_cached(b, k)
    pool.release(reversed(blocks))
    other = pool.try_allocate(2)  # evicts keys 2 and 1 (the tail first)
    assert other is not None and pool.lookup(keys) == [blocks[0]]
    pool.release(other)
    # Three blocks: one the hit, two free. Two tier keys fit; the hit stays.
    assert link.promote(keys, [blocks[0]]) == 2
    assert len(pool.lookup(keys)) == 3 and pool.lookup(keys)[0] == blocks[0]
    pool.check_integrity()
    link.close()


def test_writes_run_on_the_writer_and_loads_wait_for_them(tmp_path: Path) -> None:
    """A load right after a store sees the stored bytes (it waits for the slot's write)."""
    tier = FileTier(LAYOUT, IDENTITY, 16, str(tmp_path))
    pool = random_pool()
    for n in range(16):  # more than the staging buffers: the engine side waits, in order
        tier.store(key(n), pool[:, :, n % LAYOUT.num_blocks])
    out = torch.zeros(pool[:, :, 0].shape)
    for n in range(16):
        assert tier.load(key(n), out) and torch.equal(out, pool[:, :, n % LAYOUT.num_blocks])
    tier.close()
