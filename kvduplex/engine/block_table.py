"""The runner's block tables: one row per running request, kept across steps.

A step sends only the block ids a request gained (see `scheduler_output`), so
the runner appends them to that request's row instead of receiving and
copying every table every step. Rows live in one growable int64 array, which
is what slot mappings and attention metadata index in bulk::

    rows      a -> 0, b -> 1, c -> 2          (a row is reused once its request is dropped)
    table     [[ 7  2  9  4  .  . ]           num_blocks  [4,
               [ 3  .  .  .  .  . ]                        1,
               [11 12  5  .  .  . ]]                       3]

Entries past a row's ``num_blocks`` are stale but always valid block ids
(ids are checked when added), so attention may read them as padding that its
masks hide.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class BlockTables:
    """Per-request block tables of one runner (engine thread only)."""

    def __init__(self, num_pool_blocks: int, rows: int = 16, width: int = 64) -> None:
        self.num_pool_blocks = num_pool_blocks
        self.table: npt.NDArray[np.int64] = np.zeros((rows, width), dtype=np.int64)
        """(rows, width) block ids; row r holds ``num_blocks[r]`` valid leading entries."""
        self.num_blocks: npt.NDArray[np.int64] = np.zeros(rows, dtype=np.int64)
        self._rows: dict[Hashable, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def row_of(self, key: Hashable) -> int:
        """The row of `key`; KeyError if the runner holds no table for it."""
        return self._rows[key]

    def set(self, key: Hashable, block_ids: Sequence[int]) -> None:
        """Replace (or create) the table of `key`. ValueError for ids outside the pool."""
        row = self._rows.get(key)
        if row is None:
            row = self._take_row()
            self._rows[key] = row
        self.num_blocks[row] = 0
        self.extend(key, block_ids)

    def extend(self, key: Hashable, block_ids: Sequence[int]) -> None:
        """Append `block_ids` to the table of `key` (KeyError if none). ValueError for ids
        outside the pool."""
        row = self._rows[key]
        if not block_ids:
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_pool_blocks:
            raise ValueError(f"block ids must be in [0, {self.num_pool_blocks})")
        start = int(self.num_blocks[row])
        end = start + ids.shape[0]
        if end > self.table.shape[1]:
            self._widen(end)
        self.table[row, start:end] = ids
        self.num_blocks[row] = end

    def drop(self, key: Hashable) -> None:
        """Forget the table of `key` (nothing if none)."""
        row = self._rows.pop(key, None)
        if row is not None:
            self.num_blocks[row] = 0
            self._free.append(row)

    def _take_row(self) -> int:
        if not self._free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _widen(self, width: int) -> None:
        new_width = max(width, 2 * self.table.shape[1])
        wider = np.zeros((self.table.shape[0], new_width), dtype=np.int64)
        wider[:, : self.table.shape[1]] = self.table
        self.table = wider


__all__ = ["BlockTables"]
