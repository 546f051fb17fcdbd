"""Decode attention that reads the paged pool in place: FlexAttention over a block mask.

Design note. Each layer's K (and V) pool ``(num_blocks, block_size, kv_heads,
head_dim)`` is viewed, without a copy, as one long sequence
``(1, kv_heads, num_blocks * block_size, head_dim)``; every decode token is a
query of batch row ``b`` whose visible keys are the slots of its own blocks.
A `BlockMask` with KV blocks of ``block_size`` says which: all of a
sequence's blocks but the last are *full* (no masking), the last is
*partial*, where ``mask_mod`` hides the slots past the context::

    pool slots   ...| b7: x x x x | ... | b2: x x x x | ... | b9: x x . . |...
    seq 0 table  [7, 2, 9], context 10     full: 7, 2       partial: 9 (2 slots)

The kernel is `flex_attention` compiled by `torch.compile` (inductor, C++ on
CPU) with dynamic shapes: one compile for a batch of one decode and one for
any other batch, whatever the context lengths (about 10-20 s together on the
2-core development machine, cached on disk for the next process). Nothing is
gathered, so the cost stays with the context actually read, not with copying
it into a scratch buffer first. Sliding-window layers are not handled here.

The per-step index arrays live in buffers that grow but are reused, and the
mask's per-row tensors keep their identity across steps, so a step never
triggers a recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


@dataclass(frozen=True)
class FlexDecodeBatch:
    """One step's decodes for `FlexDecode.attend` (built once per step, used by every layer)."""

    token_index: torch.Tensor  # (num_decodes,) int64
    """Flattened-batch index of each decode's new token."""
    block_mask: Any
    """The `BlockMask` over the pool's slots."""


class FlexDecode:
    """Compiled paged decode attention of one runner (engine thread only)."""

    def __init__(self, num_pool_blocks: int, block_size: int, device: torch.device) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.num_pool_blocks = num_pool_blocks
        self.block_size = block_size
        self.device = device
        self._rows = 0
        self._grow(64)
        self._compiled: Callable[..., torch.Tensor] = torch.compile(flex_attention, dynamic=True)

    def _grow(self, rows: int) -> None:
        """Room for `rows` decodes; the mask's captured tensors change identity only here."""
        nb, dev = self.num_pool_blocks, self.device
        self._kv_indices = torch.zeros(rows, nb, dtype=torch.int32, device=dev)
        self._full_indices = torch.zeros(rows, nb, dtype=torch.int32, device=dev)
        self._last_block = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._last_len = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._rows = rows
        bs, last_block, last_len = self.block_size, self._last_block, self._last_len

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx // bs != last_block[b]) | (kv_idx % bs < last_len[b])

        self._mask_mod = mask_mod

    def batch(
        self,
        token_index: torch.Tensor,  # (n,) int64
        tables: npt.NDArray[np.int64],  # (n, width) block ids, row i valid up to its context
        context_lens: npt.NDArray[np.int64],  # (n,)
    ) -> FlexDecodeBatch:
        """The block mask of `n` decodes with these block tables and context lengths."""
        from torch.nn.attention.flex_attention import BlockMask

        n = int(context_lens.shape[0])
        if n > self._rows:
            self._grow(max(n, 2 * self._rows))
        bs = self.block_size
        num_blocks = -(-context_lens // bs)
        last = tables[np.arange(n), num_blocks - 1]
        width = tables.shape[1]
        self._full_indices[:n, :width] = torch.from_numpy(np.ascontiguousarray(tables, np.int32))
        self._kv_indices[:n, 0] = torch.from_numpy(last.astype(np.int32))
        self._last_block[:n] = torch.from_numpy(last)
        self._last_len[:n] = torch.from_numpy((context_lens - 1) % bs + 1)
        block_mask = BlockMask.from_kv_blocks(
            torch.ones((n, 1, 1), dtype=torch.int32, device=self.device),
            self._kv_indices[:n].view(n, 1, 1, -1),
            torch.from_numpy((num_blocks - 1).astype(np.int32)).view(n, 1, 1).to(self.device),
            self._full_indices[:n].view(n, 1, 1, -1),
            BLOCK_SIZE=(1, bs),
            mask_mod=self._mask_mod,
            seq_lengths=(1, self.num_pool_blocks * bs),
            compute_q_blocks=False,
        )
        return FlexDecodeBatch(token_index=token_index, block_mask=block_mask)

    def attend(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        batch: FlexDecodeBatch,
        scale: float,
        out: torch.Tensor,  # (num_tokens, num_heads, head_dim), written at the decode tokens
    ) -> None:
        """Attention of every decode token over its blocks, read in place from `layer_pool`."""
        _, nb, bs, kv_heads, dim = layer_pool.shape
        k = layer_pool[0].view(1, nb * bs, kv_heads, dim).transpose(1, 2)  # (1, kv_heads, slots, dim)
        v = layer_pool[1].view(1, nb * bs, kv_heads, dim).transpose(1, 2)
        qd = q.index_select(0, batch.token_index)[:, :, None, :]  # (n, num_heads, 1, head_dim)
        o = self._compiled(
            qd, k, v, block_mask=batch.block_mask, scale=scale, enable_gqa=q.shape[1] != kv_heads
        )  # (n, num_heads, 1, head_dim)
        out.index_copy_(0, batch.token_index, o[:, :, 0, :])


__all__ = ["FlexDecode", "FlexDecodeBatch"]
