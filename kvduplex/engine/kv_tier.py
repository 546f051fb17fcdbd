"""A KV tier below the pool: whole blocks that the prefix cache evicted, kept by key.

Three implementations of one small protocol (`KVTier`): `HostTier` (host memory,
pinned on CUDA: the tier of GPU instances), `FileTier` (`kv_tier_file.py`: one
preallocated file of fixed-size slots, the tier of CPU instances) and `StoreTier`
(`kv_tier_store.py`: a distributed KV store that instances share). The first two
hold a bounded number of slots, reused least recently used first. One slot holds one
block, every layer's K and V as laid out in the pool (``pool[:, :, block]``),
and a header written with it::

    slot     [ header (128 B) | payload: bytes_per_block | padding to the slot size ]
    header   magic 8 | key 32 | layout id 16 | payload length u64 LE | crc32 u32 LE

The CRC-32 covers the key, the layout id, the length and the payload, so a load
that finds a torn, truncated, overwritten or foreign slot drops the entry
(`TierStats.num_corrupt_blocks`) and reports a miss: its tokens are recomputed,
never read from a bad slot. A store entry carries the same header (`entry_header`,
`entry_problem`).

Threads: the engine thread owns the index (key -> slot, LRU order) and copies a
block out of the pool when it is stored (a plain, synchronous ``copy_``, also
from a GPU pool: the scheduler evicts between forwards), so the copy precedes
any reuse of the pool block. Checksumming and persisting the copy run on one
writer thread, first in first out, off the step's path; a load waits for its
slot's write (its future), and `flush` for all of them.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import struct
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_pool import BlockHash
from kvduplex.model.dtypes import dtype_from_name

logger = logging.getLogger(__name__)

HEADER_BYTES = 128
"""Bytes of a slot's header; the payload follows."""
_MAGIC = b"KVTIER\x00\x01"
_HEADER = struct.Struct("<8s32s16sQI")  # magic, key, layout id, payload length, crc32
HEADER_FIELDS_BYTES = _HEADER.size
"""Bytes of the header that carry fields (the rest is zero)."""


@dataclass
class TierStats:
    """Counters of one tier since it was made. Only the engine thread changes them, except
    the writer's two (`num_written_bytes`, `num_write_failures`)."""

    num_stored_blocks: int = 0
    """Blocks copied into the tier (a key it held already is not stored again)."""
    num_loaded_blocks: int = 0
    """Blocks loaded back, checksum verified (tier hits)."""
    num_evicted_blocks: int = 0
    """Entries dropped to make room for newer ones."""
    num_corrupt_blocks: int = 0
    """Loads that found a slot failing its check (or unreadable): dropped, recomputed."""
    num_write_failures: int = 0
    """Writes that raised (e.g. the disk is full): the entry is dropped at its load."""
    num_written_bytes: int = 0
    """Header and payload bytes persisted by the writer."""
    num_read_bytes: int = 0
    """Header and payload bytes of the blocks loaded back."""
    num_unavailable: int = 0
    """Store tier only: lookups, loads and writes that answered miss or were dropped because
    the store failed, was too slow or was being left alone after a failure."""


class KVTier(Protocol):
    """Whole blocks keyed by their prefix-cache key, bounded, least recently used out.

    Called from the engine thread only. ``block`` and ``out`` are one block of the
    pool, ``pool[:, :, block_id]``: (num_layers, 2, block_size, num_kv_heads, head_dim).
    """

    stats: TierStats

    @property
    def num_slots(self) -> int:
        """Blocks the tier holds at most."""
        ...

    @property
    def num_used(self) -> int:
        """Blocks it holds now."""
        ...

    def contains(self, key: BlockHash) -> bool:
        """Whether `key` has an entry (its slot is checked only at `load`)."""
        ...

    def touch(self, key: BlockHash) -> None:
        """Make `key` the most recently used entry (nothing if absent)."""
        ...

    def find_run(self, keys: Sequence[BlockHash]) -> int:
        """How many of `keys`, from the first, the tier holds (each made the most recently
        used): a prefix lookup's run to load. A miss never costs more than the tier's
        deadline."""
        ...

    def store(self, key: BlockHash, block: torch.Tensor) -> None:
        """Copy `block` into the tier under `key` (evicting the least recently used entry
        if full). The copy out of `block` is done when this returns; persisting it may
        still run. A key held already is only touched."""
        ...

    def load(self, key: BlockHash, out: torch.Tensor) -> bool:
        """Copy the block stored under `key` into `out` and return True; False (and `out`
        untouched) if absent, or if its slot fails its check (the entry is dropped)."""
        ...

    def flush(self) -> None:
        """Wait until every stored block is persisted."""
        ...

    def close(self) -> None:
        """Finish pending writes and free the tier's memory or file."""
        ...


@dataclass
class _Entry:
    slot: int
    write: Future[None]


class SlotTier(abc.ABC):
    """The index, the slot header and its check, and the writer thread of a `KVTier`;
    a subclass says where slots live (`_staging`, `_persist`, `_read`)."""

    ALIGN = 128
    """A slot's size is a multiple of this."""

    def __init__(self, layout: KVCacheLayout, identity: bytes, num_slots: int) -> None:
        """`identity` (the model's, as in block keys) and the layout but its block count
        make the layout id every header carries."""
        if num_slots < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        self.layout = layout
        self.block_shape = layout.shape[:2] + layout.shape[3:]  # (L, 2, BS, H, D)
        self.payload_bytes = layout.bytes_per_block
        self.slot_bytes = slot_bytes(layout, self.ALIGN)
        self.dtype = dtype_from_name(layout.dtype)
        self.layout_id = layout_id_of(layout, identity)
        self.stats = TierStats()
        self._num_slots = num_slots
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # oldest use first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._slot_writes: list[Future[None] | None] = [None] * num_slots
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvduplex-kv-tier")

    # ---- what a subclass provides ----

    @abc.abstractmethod
    def _staging(self, slot: int) -> torch.Tensor:
        """A host buffer (uint8, payload_bytes) to copy a block to be written into `slot`;
        free once this returns (a previous write from it is done)."""

    @abc.abstractmethod
    def _staged(self, write: Future[None]) -> None:
        """The buffer `_staging` gave is in use until `write` is done."""

    @abc.abstractmethod
    def _persist(self, slot: int, header: bytes, payload: torch.Tensor) -> None:
        """Writer thread: put `header` then `payload` into `slot`."""

    @abc.abstractmethod
    def _read(self, slot: int) -> tuple[bytes, torch.Tensor]:
        """The header and payload (uint8 host tensor) found in `slot`; shorter than
        written if the storage was cut short. Valid until the next `_read`."""

    def _release(self) -> None:  # noqa: B027 - optional: only a file has something to free
        """Free the storage (after the last write)."""

    # ---- KVTier ----

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_used(self) -> int:
        return len(self._index)

    def contains(self, key: BlockHash) -> bool:
        return key in self._index

    def touch(self, key: BlockHash) -> None:
        if key in self._index:
            self._index.move_to_end(key)

    def find_run(self, keys: Sequence[BlockHash]) -> int:
        num_held = 0
        for key in keys:
            if key not in self._index:
                break
            self._index.move_to_end(key)
            num_held += 1
        return num_held

    def store(self, key: BlockHash, block: torch.Tensor) -> None:
        if key in self._index:
            self._index.move_to_end(key)
            return
        slot = self._free_slots.pop() if self._free_slots else self._evict_oldest()
        previous = self._slot_writes[slot]
        if previous is not None:  # an evicted entry's write into the slot ends first
            settle(previous)
        buffer = self._staging(slot)
        buffer.view(self.dtype).view(self.block_shape).copy_(block)
        write = self._writer.submit(self._write, slot, key, buffer)
        self._staged(write)
        self._slot_writes[slot] = write
        self._index[key] = _Entry(slot, write)
        self.stats.num_stored_blocks += 1

    def load(self, key: BlockHash, out: torch.Tensor) -> bool:
        entry = self._index.get(key)
        if entry is None:
            return False
        if settle(entry.write) is not None:  # logged and counted by the writer
            self._drop(key)
            return False
        try:
            header, payload = self._read(entry.slot)
        except OSError as exc:
            return self._corrupt(key, entry.slot, f"unreadable: {exc}")
        problem = self._check(key, header, payload)
        if problem is not None:
            return self._corrupt(key, entry.slot, problem)
        out.copy_(payload.view(self.dtype).view(self.block_shape))
        self._index.move_to_end(key)
        self.stats.num_loaded_blocks += 1
        self.stats.num_read_bytes += HEADER_BYTES + self.payload_bytes
        return True

    def flush(self) -> None:
        for entry in list(self._index.values()):
            settle(entry.write)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._index.clear()
        self._release()

    def slot_of(self, key: BlockHash) -> int | None:
        """The slot holding `key`, if any (for inspection and tests)."""
        entry = self._index.get(key)
        return None if entry is None else entry.slot

    # ---- internals ----

    def _write(self, slot: int, key: BlockHash, payload: torch.Tensor) -> None:
        """Writer thread: checksum the staged copy and persist header and payload."""
        try:
            header = entry_header(key, self.layout_id, payload.numpy().data)
            self._persist(slot, header, payload)
        except Exception:
            self.stats.num_write_failures += 1
            logger.exception("KV tier: writing block %s into slot %d failed", key.hex()[:12], slot)
            raise
        self.stats.num_written_bytes += HEADER_BYTES + self.payload_bytes

    def _check(self, key: BlockHash, header: bytes, payload: torch.Tensor) -> str | None:
        """Why the slot read for `key` cannot be used, or None if it can."""
        if payload.numel() != self.payload_bytes:
            return "cut short"
        return entry_problem(key, self.layout_id, self.payload_bytes, header, payload.numpy().data)

    def _corrupt(self, key: BlockHash, slot: int, problem: str) -> bool:
        self.stats.num_corrupt_blocks += 1
        logger.warning(
            "KV tier: slot %d of block %s is corrupt (%s); dropped, its tokens are recomputed",
            slot, key.hex()[:12], problem,
        )  # fmt: skip
        self._drop(key)
        return False

    def _drop(self, key: BlockHash) -> None:
        entry = self._index.pop(key)
        self._free_slots.append(entry.slot)

    def _evict_oldest(self) -> int:
        _, entry = self._index.popitem(last=False)
        self.stats.num_evicted_blocks += 1
        return entry.slot


class HostTier(SlotTier):
    """Slots in one host tensor (pinned with `pin_memory`, for fast copies to a GPU pool).
    A block is copied straight into its slot; the writer adds the header."""

    def __init__(
        self, layout: KVCacheLayout, identity: bytes, num_slots: int, *, pin_memory: bool = False
    ) -> None:
        super().__init__(layout, identity, num_slots)
        self.slots = torch.zeros(
            num_slots, self.slot_bytes, dtype=torch.uint8, pin_memory=pin_memory
        )
        """The tier's memory: row ``slot`` is one slot."""

    def _staging(self, slot: int) -> torch.Tensor:
        return self.slots[slot, HEADER_BYTES : HEADER_BYTES + self.payload_bytes]

    def _staged(self, write: Future[None]) -> None:
        pass  # the slot is the buffer: `store` waits for a slot's last write before reuse

    def _persist(self, slot: int, header: bytes, payload: torch.Tensor) -> None:
        self.slots[slot, : len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)

    def _read(self, slot: int) -> tuple[bytes, torch.Tensor]:
        row = self.slots[slot]
        header = row[: _HEADER.size].numpy().tobytes()
        return header, row[HEADER_BYTES : HEADER_BYTES + self.payload_bytes]

    def _release(self) -> None:
        self.slots = torch.empty(0, dtype=torch.uint8)


def slot_bytes(layout: KVCacheLayout, align: int) -> int:
    """Bytes of one slot holding a block of `layout`: header and payload, rounded up."""
    return -(-(HEADER_BYTES + layout.bytes_per_block) // align) * align


def entry_header(key: BlockHash, layout_id: bytes, payload: bytes | memoryview) -> bytes:
    """The header fields (`HEADER_FIELDS_BYTES`) of an entry holding `payload` under `key`,
    its CRC-32 included."""
    length = memoryview(payload).nbytes
    crc = zlib.crc32(payload, zlib.crc32(_covered_fields(key, layout_id, length)))
    return _HEADER.pack(_MAGIC, key, layout_id, length, crc)


def entry_problem(
    key: BlockHash, layout_id: bytes, payload_bytes: int, header: bytes, payload: bytes | memoryview
) -> str | None:
    """Why an entry read for `key` (`header`, then `payload`) cannot be used as a block of
    `payload_bytes` bytes written with `layout_id`; None if it can."""
    if len(header) < _HEADER.size or memoryview(payload).nbytes != payload_bytes:
        return "cut short"
    magic, stored_key, stored_layout_id, length, crc = _HEADER.unpack_from(header)
    if magic != _MAGIC:
        return "no slot header"
    if stored_key != key:
        return f"holds block {stored_key.hex()[:12]}"
    if stored_layout_id != layout_id or length != payload_bytes:
        return "written for another model or layout"
    if zlib.crc32(payload, zlib.crc32(_covered_fields(key, layout_id, length))) != crc:
        return "checksum mismatch"
    return None


def _covered_fields(key: BlockHash, layout_id: bytes, length: int) -> bytes:
    return key + layout_id + length.to_bytes(8, "little")


def layout_id_of(layout: KVCacheLayout, identity: bytes) -> bytes:
    """What every entry's header names as its model and layout: `identity` (the model's,
    as in block keys) and the layout's shapes and dtype, its block count aside."""
    fields = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim)
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<I", len(identity)) + identity)
    h.update(struct.pack("<4I", *fields) + layout.dtype.encode())
    return h.digest()


def settle(write: Future[None]) -> BaseException | None:
    """Wait for a write; its exception, if it failed."""
    return write.exception()


__all__ = [
    "HEADER_BYTES",
    "HEADER_FIELDS_BYTES",
    "HostTier",
    "KVTier",
    "SlotTier",
    "TierStats",
    "entry_header",
    "entry_problem",
    "layout_id_of",
    "settle",
    "slot_bytes",
]
