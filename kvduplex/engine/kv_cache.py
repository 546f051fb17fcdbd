"""The paged KV pool: one tensor for all layers, addressed as (layer, K|V, block).

Layout (C-contiguous)::

    pool[layer, kv, block, slot, head, dim]
         L      2   NB     BS    H     D

so a block's K (or V) for one layer is one contiguous region of
``block_bytes = BS * H * D * itemsize`` bytes at byte offset
``((layer * 2 + kv) * NB + block) * block_bytes``. A transfer descriptor is
therefore exactly (layer, kv, block); the transfer layer registers the whole
pool once and addresses regions by index.
"""

from __future__ import annotations

import enum
import logging
import mmap
import sys
from dataclasses import asdict
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class KVKind(enum.IntEnum):
    """Which half of a layer's cache a region belongs to."""

    K = 0
    V = 1


def dtype_from_name(name: str) -> torch.dtype:
    """Map a dtype name (``float32``, ``bfloat16``, ``float16``) to torch."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def num_blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: ``ceil(num_tokens / block_size)``, in integers."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape of one instance's KV pool; two instances can exchange blocks only if equal."""

    num_layers: int
    """Decoder layers."""
    num_blocks: int
    """Blocks in the pool (per layer)."""
    block_size: int
    """Tokens per block."""
    num_kv_heads: int
    """KV heads per layer."""
    head_dim: int
    """Dimension of one head."""
    dtype: str = "float32"
    """Element type name, see `dtype_from_name`."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheLayout.{name} must be >= 1, got {getattr(self, name)}")
        dtype_from_name(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one (layer, kv, block) region."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across every layer: what moving one block costs."""
        return self.num_layers * 2 * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    def region_index(self, layer: int, kv: KVKind | int, block: int) -> int:
        """Index of region (layer, kv, block) in the pool's flat list of regions."""
        return (layer * 2 + int(kv)) * self.num_blocks + block

    def region_offset(self, layer: int, kv: KVKind | int, block: int) -> int:
        """Byte offset of region (layer, kv, block) from the pool's base address."""
        return self.region_index(layer, kv, block) * self.block_bytes

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def incompatibility(self, other: KVCacheLayout) -> str | None:
        """Why blocks cannot move between pools of these layouts, or None if they can.

        The block count may differ: each side addresses its own blocks.
        """
        diffs = [
            f"{name}: {getattr(self, name)!r} here vs {getattr(other, name)!r} there"
            for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) if diffs else None


def allocate_kv_pool(layout: KVCacheLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """Allocate a zeroed pool of ``layout.shape``, every page of it resident.

    On CPU the memory is page-aligned and advised for transparent huge pages,
    which roughly doubles shared-memory transfer throughput, and populated
    here, at startup: the first touch of a page otherwise lands on whatever
    touches it first, a prefill's forward, or a peer's WRITE or this
    instance's READ of a request's blocks, where it costs up to a hundred
    times the copy (on a VM, host memory the guest never used is slowest).
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device)
    nbytes = layout.total_bytes
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    madv_hugepage = getattr(mmap, "MADV_HUGEPAGE", None)
    if madv_hugepage is not None:
        try:
            buf.madvise(madv_hugepage)
        except OSError:  # pragma: no cover - kernel without THP
            logger.debug("MADV_HUGEPAGE not available for the KV pool")
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    _populate(buf, flat)
    pool = flat.view(layout.torch_dtype).view(layout.shape)
    # Keep the mapping alive as long as the tensor lives.
    pool._kvduplex_mmap = buf  # type: ignore[attr-defined]
    return pool


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it


def _populate(buf: mmap.mmap, flat: torch.Tensor) -> None:
    """Fault every page of ``buf`` in (the kernel zeroes them), or write zeros."""
    if sys.platform == "linux":
        try:
            buf.madvise(_MADV_POPULATE_WRITE)
            return
        except OSError:  # older kernel: touch the pages ourselves
            pass
    flat.zero_()


def pool_base_address(pool: torch.Tensor) -> int:
    """Address of the pool's first byte (for registering it with a transport)."""
    return int(pool.data_ptr())


__all__ = [
    "KVCacheLayout",
    "KVKind",
    "allocate_kv_pool",
    "dtype_from_name",
    "pool_base_address",
]
