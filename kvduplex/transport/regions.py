"""Region indices: which (layer, K|V, block) regions of a pool a transfer names.

Both transports turn a transfer request into two equal-length int32 arrays of
region indices (local and remote) and hand them to ``Transport._post``. The
blocks×layers form expands with numpy in layer-major, K-before-V, block order,
which is also pool memory order, so runs of consecutive blocks are contiguous
in memory::

    layers [l0, l1] × kinds [K, V] × blocks [b0, b1, b2]
    → (l0,K,b0) (l0,K,b1) (l0,K,b2) (l0,V,b0) ... (l1,V,b2)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.kv_layout import KVKind
from kvduplex.transport.protocol import ALL_KINDS
from kvduplex.transport.protocol import Region

IndexArray = npt.NDArray[np.int32]


def _as_index_array(
    values: Sequence[int] | npt.NDArray[np.integer], what: str
) -> npt.NDArray[np.int64]:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of ints, got shape {arr.shape}")
    return arr


def _check_range(arr: npt.NDArray[np.int64], limit: int, what: str) -> None:
    # One reduction: negative values wrap to huge unsigned ones.
    if arr.size and int(arr.view(np.uint64).max()) >= limit:
        bad = arr[(arr < 0) | (arr >= limit)][0]
        raise ValueError(f"{what} {int(bad)} out of range [0, {limit})")


class RegionIndexer:
    """Expands ``layers × kinds × blocks`` to region indices of one layout.

    Keeps the row offsets per (layers, kinds) selection, so a transfer costs a
    few numpy operations on its block list. Not thread-safe for writers of the
    cache, but a lost cache entry is only recomputed.
    """

    _MAX_CACHED = 256

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self._rows: dict[tuple[tuple[int, ...] | None, tuple[int, ...]], npt.NDArray[np.int64]] = {}

    def rows(
        self, layers: Sequence[int] | npt.NDArray[np.integer] | None, kinds: Sequence[KVKind]
    ) -> npt.NDArray[np.int64]:
        """Offset of block 0 of each selected (layer, kind), shape (layers * kinds, 1)."""
        key = (
            None if layers is None else tuple(int(x) for x in layers),
            tuple(int(k) for k in kinds),
        )
        rows = self._rows.get(key)
        if rows is None:
            lay = (
                np.arange(self.layout.num_layers, dtype=np.int64)
                if layers is None
                else _as_index_array(layers, "layers")
            )
            _check_range(lay, self.layout.num_layers, "layer")
            kv = np.asarray(key[1], dtype=np.int64)
            _check_range(kv, 2, "kind")
            rows = ((lay[:, None] * 2 + kv[None, :]) * self.layout.num_blocks).reshape(-1, 1)
            if len(self._rows) >= self._MAX_CACHED:
                self._rows.clear()
            self._rows[key] = rows
        return rows

    def __call__(
        self,
        blocks: Sequence[int] | npt.NDArray[np.integer],
        layers: Sequence[int] | npt.NDArray[np.integer] | None = None,
        kinds: Sequence[KVKind] = ALL_KINDS,
    ) -> IndexArray:
        """Region indices; ValueError naming the offending value if one is out of range."""
        b = _as_index_array(blocks, "blocks")
        _check_range(b, self.layout.num_blocks, "block id")
        return (self.rows(layers, kinds) + b).reshape(-1).astype(np.int32)  # (layers*kinds*blocks,)


def block_region_indices(
    layout: KVCacheLayout,
    blocks: Sequence[int] | npt.NDArray[np.integer],
    layers: Sequence[int] | npt.NDArray[np.integer] | None = None,
    kinds: Sequence[KVKind] = ALL_KINDS,
) -> IndexArray:
    """Region indices of ``layers × kinds × blocks`` in ``layout``'s pool, in that order.

    Raises ValueError naming the offending value if a block or layer is out of range.
    """
    return RegionIndexer(layout)(blocks, layers, kinds)


def region_indices(layout: KVCacheLayout, regions: Sequence[Region]) -> IndexArray:
    """Region indices of arbitrary regions; ValueError if any is out of range."""
    out = np.empty(len(regions), dtype=np.int64)
    for i, r in enumerate(regions):
        if not (0 <= r.layer < layout.num_layers and 0 <= r.block < layout.num_blocks):
            raise ValueError(f"region {r} out of range for layout {layout}")
        out[i] = layout.region_index(r.layer, r.kv, r.block)
    return out.astype(np.int32)


__all__ = ["IndexArray", "RegionIndexer", "block_region_indices", "region_indices"]
