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
from dataclasses import asdict
from dataclasses import dataclass

DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The KV pool's element types, by name, and their sizes in bytes."""


class KVKind(enum.IntEnum):
    """Which half of a layer's cache a region belongs to."""

    K = 0
    V = 1


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
    """Element type name, one of `DTYPE_ITEMSIZE`."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"unsupported dtype {self.dtype!r}; choose one of {sorted(DTYPE_ITEMSIZE)}"
            )

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

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
