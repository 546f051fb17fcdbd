"""What a KV tier entry holds besides the block, and its checks (`kvduplex.engine.kv_tier`).

::

    slot     [ header (128 B) | payload: bytes_per_block | padding to the slot size ]
    header   magic 8 | key 32 | layout id 16 | payload length u64 LE | crc32 u32 LE
    payload  layer 0: K V | layer 1: K V | ... (``pool[:, :, block]``, layer-major)

The header's CRC-32 covers the key, the layout id, the length and the payload: a load
of the whole block checks it. A load layer by layer (`kvduplex.engine.tier_load`)
cannot wait for the last layer to check the first, so the writer also computes one
CRC-32 per layer slice (`layer_crcs`), each seeded with the key, the layout id and the
layer's index; they stay in the tier's index, in memory, and the header's fields
(`header_problem`) and each layer (`layer_problem`) are checked as they are read. Kept
in memory, a layer's CRC cannot be torn or overwritten with its slot, and the slot
format (which the store's entries share) is unchanged.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_pool import BlockHash

HEADER_BYTES = 128
"""Bytes of a slot's header; the payload follows."""
_MAGIC = b"KVTIER\x00\x01"
_HEADER = struct.Struct("<8s32s16sQI")  # magic, key, layout id, payload length, crc32
HEADER_FIELDS_BYTES = _HEADER.size
"""Bytes of the header that carry fields (the rest is zero)."""


def slot_bytes(layout: KVCacheLayout, align: int) -> int:
    """Bytes of one slot holding a block of `layout`: header and payload, rounded up."""
    return -(-(HEADER_BYTES + layout.bytes_per_block) // align) * align


def entry_header(key: BlockHash, layout_id: bytes, payload: bytes | memoryview) -> bytes:
    """The header fields (`HEADER_FIELDS_BYTES`) of an entry holding `payload` under `key`,
    its CRC-32 included."""
    length = memoryview(payload).nbytes
    crc = zlib.crc32(payload, zlib.crc32(_covered_fields(key, layout_id, length)))
    return _HEADER.pack(_MAGIC, key, layout_id, length, crc)


def header_problem(
    key: BlockHash, layout_id: bytes, payload_bytes: int, header: bytes
) -> str | None:
    """Why a header read for `key` does not name an entry of `payload_bytes` bytes written
    under `key` with `layout_id` (its CRC aside); None if it does."""
    if len(header) < _HEADER.size:
        return "cut short"
    magic, stored_key, stored_layout_id, length, _ = _HEADER.unpack_from(header)
    if magic != _MAGIC:
        return "no slot header"
    if stored_key != key:
        return f"holds block {stored_key.hex()[:12]}"
    if stored_layout_id != layout_id or length != payload_bytes:
        return "written for another model or layout"
    return None


def entry_problem(
    key: BlockHash, layout_id: bytes, payload_bytes: int, header: bytes, payload: bytes | memoryview
) -> str | None:
    """Why an entry read for `key` (`header`, then `payload`) cannot be used as a block of
    `payload_bytes` bytes written with `layout_id`; None if it can."""
    if len(header) < _HEADER.size or memoryview(payload).nbytes != payload_bytes:
        return "cut short"
    problem = header_problem(key, layout_id, payload_bytes, header)
    if problem is not None:
        return problem
    crc = _HEADER.unpack_from(header)[4]
    if zlib.crc32(payload, zlib.crc32(_covered_fields(key, layout_id, payload_bytes))) != crc:
        return "checksum mismatch"
    return None


def layer_crcs(
    key: BlockHash, layout_id: bytes, payload: memoryview, num_layers: int
) -> tuple[int, ...]:
    """The CRC-32 of each layer slice of `payload` (a whole block, layer-major)."""
    size = payload.nbytes // num_layers
    flat = payload.cast("B")
    return tuple(
        layer_crc(key, layout_id, layer, [flat[layer * size : (layer + 1) * size]])
        for layer in range(num_layers)
    )


def layer_crc(key: BlockHash, layout_id: bytes, layer: int, parts: Sequence[memoryview]) -> int:
    """The CRC-32 of one layer's bytes (`parts`, in order) of the entry under `key`."""
    crc = zlib.crc32(key + layout_id + layer.to_bytes(4, "little"))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


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


__all__ = [
    "HEADER_BYTES",
    "HEADER_FIELDS_BYTES",
    "entry_header",
    "entry_problem",
    "header_problem",
    "layer_crc",
    "layer_crcs",
    "layout_id_of",
    "slot_bytes",
]
