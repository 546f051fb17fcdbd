"""A KV tier below the pool: whole blocks that the prefix cache evicted, kept by key.

Three implementations of one small protocol (`KVTier`): `HostTier` (host memory,
pinned on CUDA: the tier of GPU instances), `FileTier` (`kv_tier_file.py`: one
preallocated file of fixed-size slots, the tier of CPU instances) and `StoreTier`
(`kv_tier_store.py`: a distributed KV store that instances share). The first two
hold a bounded number of slots, reused least recently used first. One slot holds one
block, every layer's K and V as laid out in the pool (``pool[:, :, block]``),
and a header written with it (`kvduplex.engine.kv_tier_format`)::

    slot     [ header (128 B) | payload: bytes_per_block | padding to the slot size ]
    header   magic 8 | key 32 | layout id 16 | payload length u64 LE | crc32 u32 LE

The CRC-32 covers the key, the layout id, the length and the payload, so a load
that finds a torn, truncated, overwritten or foreign slot drops the entry
(`TierStats.num_corrupt_blocks`) and reports a miss: its tokens are recomputed,
never read from a bad slot. A store entry carries the same header (`entry_header`,
`entry_problem`).

Two ways back into the pool: `load`, a whole block on the engine thread (its header
CRC checked), and `read_layer`, one layer of a block on a loader's thread while the
forward runs (`kvduplex.engine.tier_load`): the slots read are pinned (`pin`) so that
no store reuses them meanwhile, and each layer is checked against its own CRC, which
the writer computed with the header's and the index keeps.

Threads: the engine thread owns the index (key -> slot, LRU order) and copies a
block out of the pool when it is stored (a plain, synchronous ``copy_``, also
from a GPU pool: the scheduler evicts between forwards), so the copy precedes
any reuse of the pool block. Checksumming and persisting the copy run on one
writer thread, first in first out, off the step's path; a load waits for its
slot's write (its future), and `flush` for all of them.
"""

from __future__ import annotations

import abc
import logging
from collections import Counter
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.kv_tier_format import HEADER_BYTES
from kvduplex.engine.kv_tier_format import HEADER_FIELDS_BYTES
from kvduplex.engine.kv_tier_format import entry_header
from kvduplex.engine.kv_tier_format import entry_problem
from kvduplex.engine.kv_tier_format import header_problem
from kvduplex.engine.kv_tier_format import layer_crc
from kvduplex.engine.kv_tier_format import layer_crcs
from kvduplex.engine.kv_tier_format import layout_id_of
from kvduplex.engine.kv_tier_format import slot_bytes
from kvduplex.model.dtypes import dtype_from_name

logger = logging.getLogger(__name__)


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


Bytes = npt.NDArray[np.uint8]
"""Host bytes a layer is read into (a contiguous array)."""

WRITE_FAILED = "its write failed"
"""`read_layer`'s answer for an entry whose write raised (the writer counted it)."""


@dataclass
class _Entry:
    slot: int
    write: Future[tuple[int, ...]]
    """Ends with the entry persisted; its result is the payload's layer CRCs."""


@dataclass(frozen=True)
class LayerSource:
    """One pinned entry that a layer-wise load reads (`SlotTier.pin`)."""

    key: BlockHash
    slot: int
    write: Future[tuple[int, ...]]


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
        self._slot_writes: list[Future[Any] | None] = [None] * num_slots
        self._pins: Counter[int] = Counter()
        """Slots a layer-wise load reads now: no store reuses them."""
        self._unpinned_free: set[int] = set()
        """Pinned slots whose entry was dropped: free once unpinned."""
        self.layer_bytes = self.payload_bytes // layout.num_layers
        """Bytes of one layer's K and V of a block (a contiguous slice of the payload)."""
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvduplex-kv-tier")

    # ---- what a subclass provides ----

    @abc.abstractmethod
    def _staging(self, slot: int) -> torch.Tensor:
        """A host buffer (uint8, payload_bytes) to copy a block to be written into `slot`;
        free once this returns (a previous write from it is done)."""

    @abc.abstractmethod
    def _staged(self, write: Future[Any]) -> None:
        """The buffer `_staging` gave is in use until `write` is done."""

    @abc.abstractmethod
    def _persist(self, slot: int, header: bytes, payload: torch.Tensor) -> None:
        """Writer thread: put `header` then `payload` into `slot`."""

    @abc.abstractmethod
    def _read(self, slot: int) -> tuple[bytes, torch.Tensor]:
        """The header and payload (uint8 host tensor) found in `slot`; shorter than
        written if the storage was cut short. Valid until the next `_read`."""

    @abc.abstractmethod
    def _read_header(self, slot: int) -> bytes:
        """Loader thread: the header fields found in `slot` (shorter if cut short)."""

    @abc.abstractmethod
    def _read_layer(self, slot: int, layer: int, parts: Sequence[Bytes]) -> int:
        """Loader thread: fill `parts` (layer_bytes in all) with `layer`'s bytes of the
        payload in `slot`, in order; the bytes filled (fewer if cut short)."""

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
        if slot is None:  # every slot is read by a load now: this block is not kept
            return
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

    def _write(self, slot: int, key: BlockHash, payload: torch.Tensor) -> tuple[int, ...]:
        """Writer thread: checksum the staged copy (whole, and layer by layer) and persist
        header and payload; the layer CRCs."""
        try:
            data = payload.numpy().data
            header = entry_header(key, self.layout_id, data)
            crcs = layer_crcs(key, self.layout_id, data, self.layout.num_layers)
            self._persist(slot, header, payload)
        except Exception:
            self.stats.num_write_failures += 1
            logger.exception("KV tier: writing block %s into slot %d failed", key.hex()[:12], slot)
            raise
        self.stats.num_written_bytes += HEADER_BYTES + self.payload_bytes
        return crcs

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
        if self._pins[entry.slot]:
            self._unpinned_free.add(entry.slot)
        else:
            self._free_slots.append(entry.slot)

    def _evict_oldest(self) -> int | None:
        """The slot of the least recently used entry no load reads (dropped); None if none."""
        for key, entry in self._index.items():
            if not self._pins[entry.slot]:
                del self._index[key]
                self.stats.num_evicted_blocks += 1
                return entry.slot
        return None

    # ---- layer-wise loads ----

    def pin(self, keys: Sequence[BlockHash]) -> list[LayerSource]:
        """Engine thread: the entries of the leading `keys` the tier holds (stopping at the
        first it lacks), pinned until `unpin`: their slots are not reused meanwhile."""
        sources = []
        for key in keys:
            entry = self._index.get(key)
            if entry is None:
                break
            self._index.move_to_end(key)
            self._pins[entry.slot] += 1
            sources.append(LayerSource(key, entry.slot, entry.write))
        return sources

    def read_layer(self, source: LayerSource, layer: int, parts: Sequence[Bytes]) -> str | None:
        """Loader thread: read `layer` of the pinned entry `source` into `parts` (host bytes,
        in order, `layer_bytes` in all: the layer's K then V; e.g. a host pool's own K and
        V of one block, so that what is checked is what attention reads) and check it;
        why it cannot be used, or None. Layer 0 waits for the entry's write and checks
        the slot's header first. After an answer other than None, `parts` hold garbage."""
        try:
            if layer == 0:
                if settle(source.write) is not None:
                    return WRITE_FAILED
                header = self._read_header(source.slot)
                problem = header_problem(source.key, self.layout_id, self.payload_bytes, header)
                if problem is not None:
                    return problem
            if self._read_layer(source.slot, layer, parts) < self.layer_bytes:
                return "cut short"
        except OSError as exc:
            return f"unreadable: {exc}"
        views = [part.data for part in parts]
        if layer_crc(source.key, self.layout_id, layer, views) != source.write.result()[layer]:
            return "checksum mismatch"
        return None

    def unpin(self, sources: Sequence[LayerSource], problems: dict[BlockHash, str]) -> None:
        """Engine thread, once the loader is done with `sources`: unpin them, and drop the
        entries found unusable (`problems`, by key: counted corrupt unless their write
        failed). Entries a store replaced meanwhile are left alone."""
        for source in sources:
            self._pins[source.slot] -= 1
            if self._pins[source.slot] == 0:
                del self._pins[source.slot]
                if source.slot in self._unpinned_free:
                    self._unpinned_free.discard(source.slot)
                    self._free_slots.append(source.slot)
        for key, problem in problems.items():
            entry = self._index.get(key)
            if entry is None or entry.write is not next(s.write for s in sources if s.key == key):
                continue
            if problem == WRITE_FAILED:
                self._drop(key)
            else:
                self._corrupt(key, entry.slot, problem)

    def count_loaded(self, num_blocks: int) -> None:
        """Engine thread: `num_blocks` blocks were loaded layer by layer, every layer checked."""
        self.stats.num_loaded_blocks += num_blocks
        self.stats.num_read_bytes += num_blocks * (HEADER_BYTES + self.payload_bytes)


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
        self._slots_bytes = self.slots.numpy()

    def _staging(self, slot: int) -> torch.Tensor:
        return self.slots[slot, HEADER_BYTES : HEADER_BYTES + self.payload_bytes]

    def _staged(self, write: Future[Any]) -> None:
        pass  # the slot is the buffer: `store` waits for a slot's last write before reuse

    def _persist(self, slot: int, header: bytes, payload: torch.Tensor) -> None:
        self.slots[slot, : len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)

    def _read(self, slot: int) -> tuple[bytes, torch.Tensor]:
        row = self.slots[slot]
        header = row[:HEADER_FIELDS_BYTES].numpy().tobytes()
        return header, row[HEADER_BYTES : HEADER_BYTES + self.payload_bytes]

    def _read_header(self, slot: int) -> bytes:
        return self.slots[slot, :HEADER_FIELDS_BYTES].numpy().tobytes()

    def _read_layer(self, slot: int, layer: int, parts: Sequence[Bytes]) -> int:
        row = self._slots_bytes[slot]
        offset = HEADER_BYTES + layer * self.layer_bytes
        for part in parts:
            flat = part.reshape(-1)
            np.copyto(flat, row[offset : offset + flat.size])  # releases the GIL
            offset += flat.size
        return self.layer_bytes

    def _release(self) -> None:
        self.slots = torch.empty(0, dtype=torch.uint8)
        self._slots_bytes = self.slots.numpy()


def settle(write: Future[Any]) -> BaseException | None:
    """Wait for a write; its exception, if it failed."""
    return write.exception()


__all__ = [
    "HEADER_BYTES",
    "HEADER_FIELDS_BYTES",
    "WRITE_FAILED",
    "HostTier",
    "KVTier",
    "LayerSource",
    "SlotTier",
    "TierStats",
    "entry_header",
    "entry_problem",
    "layout_id_of",
    "settle",
    "slot_bytes",
]
