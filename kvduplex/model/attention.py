"""Attention over a paged KV cache, with plain torch ops (same code on CPU and CUDA).

Design note. One engine step runs one flattened batch of tokens from many
sequences; each sequence contributes ``q_len`` new tokens at positions
``[start_pos, start_pos + q_len)`` and attends to its whole context
``[0, start_pos + q_len)``. Per layer:

1. the new K and V are scattered into the pool at ``slot_mapping``
   (``slot = block_table[pos // block_size] * block_size + pos % block_size``);
2. prefill sequences (``q_len > 1``) are attended one by one. On CPU with the
   prefill kernel (`cpu_prefill.py`), each reads all its keys, its own included, in
   place through its block table, causally (and within a sliding window). Else a fresh prompt
   (``start_pos == 0``) uses its own K/V with a causal mask; a continued one
   (chunked prefill or a prefix-cache hit), on CPU, attends to its cached
   context gathered from the pool without a mask and to its own K/V causally,
   the two merged by log-sum-exp (`continued_prefill`); elsewhere, or under a
   sliding window shorter than its context, to its whole gathered context with
   an offset causal mask;
3. decode sequences (``q_len == 1``), by default all together as `PagedDecodes`:
   each sequence's blocks that form long ranges of consecutive ids in the pool
   (in any order) are read in place, ``layer_pool[:, b:b+m]``, masked by the
   position each slot holds; its other blocks (a wrapped pool's fragments,
   decode blocks interleaved with other sequences') are copied, with every
   other sequence's, into a scratch buffer the runner owns, rows grouped by
   length. Each range and each copied row is one SDPA that also returns its
   log-sum-exp, and a sequence's partials merge by log-sum-exp (attention is a
   sum over keys, however they are split). With the ``copy`` path instead
   (models with sliding windows, or chosen), decodes go in groups of similar
   context length (the runner picks them): per group, the blocks of its
   sequences, padded to the group's longest context, are copied with one
   ``index_select`` per K and V into the scratch buffer, and one batched SDPA
   runs with a length mask; a group of one sequence whose blocks fill a few
   ranges skips the copy (`PoolRuns`). Or, when the runner enables it and the
   layer has no sliding window, all decodes in one compiled FlexAttention call
   that reads the pool in place (`flex_decode.py`). Or, on CPU with the ``kernel``
   path, all decodes in one call of a compiled C kernel that walks each sequence's
   block table (`cpu_decode.py`).

Why groups (copied rows): padding every decode to the longest context of the step, into a
fresh tensor in every layer, cost more on CPU than the attention itself; one
sequence at a time wastes nothing but issues many small ops, each a thread
barrier. Masks depend only on the step, not the layer, so `AttentionContext`
builds them once per step and per distinct sliding window.

::

    context of one sequence, block_size 4, start_pos 6, q_len 3
    positions  0 1 2 3 | 4 5 6 7 | 8 . . .
    blocks     [  b0   ] [  b1   ] [  b2   ]
    cached     x x x x   x x
    new                      q q   q
    query at 7 sees 0..7; the pool holds 0..8 after step 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import torch
import torch.nn.functional as F

from kvduplex.model.cpu_decode import KernelDecodes
from kvduplex.model.cpu_decode import PagedDecodeKernel
from kvduplex.model.cpu_prefill import PrefillKernel
from kvduplex.model.flex_decode import FlexDecode
from kvduplex.model.flex_decode import FlexDecodeBatch
from kvduplex.model.paged_decode import PagedDecodes
from kvduplex.model.paged_decode import additive_mask
from kvduplex.model.paged_decode import paged_decode_attention
from kvduplex.model.prefill_attention import continued_prefill
from kvduplex.model.prefill_attention import fresh_prefill


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence with several new tokens in this step."""

    token_start: int
    """Index of its first new token in the flattened batch."""
    q_len: int
    """New tokens."""
    start_pos: int
    """Tokens already in the cache before this step (position of the first new token)."""
    block_table: torch.Tensor  # (num_blocks_of_seq,) int64, on device
    """Blocks covering ``[0, start_pos + q_len)``."""

    @property
    def context_len(self) -> int:
        return self.start_pos + self.q_len


@dataclass(frozen=True)
class PoolRuns:
    """A lone decode's blocks as a few ranges of consecutive block ids in the pool.

    Together the ranges hold exactly the sequence's blocks, in any order::

        block table (logical order)   40 41 42 | 39 38      ranges ((38, 5),)
        slot positions of the range   b38: 64..67  b39: 48..51  b40: 0..3  ...

    Attention reads each range in place and masks each slot by its position.
    """

    ranges: tuple[tuple[int, int], ...]
    """(first block id, number of blocks) of each range, ascending."""
    positions: torch.Tensor  # (sum of the ranges' blocks * block_size,) int64
    """The token position each slot of the ranges holds, the ranges concatenated."""


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences of similar context length, attended together in one SDPA.

    Each sequence's blocks are padded (with block 0, masked out) to the longest
    context of the group, never of the whole step.
    """

    token_index: torch.Tensor  # (num_seqs,) int64
    """Flattened-batch index of each sequence's new token."""
    block_index: torch.Tensor  # (num_seqs * width_blocks,) int64
    """Row-major ``(num_seqs, width_blocks)`` block tables, padded with block 0."""
    context_lens: torch.Tensor  # (num_seqs,) int64
    """Tokens each sequence attends to, its new token included."""
    width_blocks: int
    """Blocks per padded row."""
    in_place: PoolRuns | None = None
    """With one sequence whose blocks fill a few ranges of the pool: attention views them
    in place instead of copying; None: copy via `block_index`."""

    @property
    def num_seqs(self) -> int:
        return int(self.token_index.shape[0])


@dataclass
class AttentionContext:
    """Everything attention needs about one step, shared by all layers.

    Built by the runner before the forward pass; read-only during it except for
    the mask cache (filled on first use per window) and `decode_kv`, which
    attention overwrites for every layer and group.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) int64
    """Pool slot of every new token."""
    block_size: int
    """Tokens per block."""
    prefills: list[PrefillSpan]
    """Sequences with more than one new token, in batch order."""
    decode_groups: list[DecodeGroup]
    """Sequences with one new token, grouped by context length."""
    decode_kv: torch.Tensor  # (2, max group blocks, block_size, num_kv_heads, head_dim)
    """Scratch for one group's K and V in one layer (no allocation per layer); garbage in between."""
    flex: FlexDecode | None = None
    """In-place decode attention; with `flex_batch`, used instead of the groups."""
    flex_batch: FlexDecodeBatch | None = None
    """This step's decodes for `flex` (None: the decodes go through `decode_groups`)."""
    paged: PagedDecodes | None = None
    """This step's decodes read in place (layers without a sliding window only); None:
    through `decode_groups` or `flex_batch`."""
    kernel: PagedDecodeKernel | None = None
    """The CPU decode kernel; with `kernel_batch`, used for all decodes."""
    kernel_batch: KernelDecodes | None = None
    """This step's decodes for `kernel`."""
    prefill_kernel: PrefillKernel | None = None
    """The CPU prefill kernel: every prefill span attends through it (None: SDPA)."""
    _masks: dict[tuple[str, int, int | None], torch.Tensor | None] = field(default_factory=dict)
    _ranges: dict[tuple[int, int | None], list[tuple[int, int, int]]] = field(default_factory=dict)

    @property
    def num_decodes(self) -> int:
        if self.flex_batch is not None:
            return int(self.flex_batch.token_index.shape[0])
        if self.paged is not None:
            return self.paged.num_seqs
        if self.kernel_batch is not None:
            return int(self.kernel_batch.lens.shape[0])
        return sum(group.num_seqs for group in self.decode_groups)

    def decode_mask(self, index: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``(num_seqs, 1, 1, width_blocks * block_size)`` of decode group `index`."""
        key = ("decode", index, window)
        mask = self._masks.get(key)
        if mask is None:
            group = self.decode_groups[index]
            device = group.context_lens.device
            if group.in_place is not None:
                kpos = group.in_place.positions[None, :]
            else:
                kpos = torch.arange(group.width_blocks * self.block_size, device=device)[None, :]
            last = (group.context_lens - 1)[:, None]
            visible = kpos <= last
            if window is not None:
                visible &= kpos > last - window
            mask = additive_mask(visible, dtype)[:, None, None, :]
            self._masks[key] = mask
        return mask

    def visible_ranges(self, index: int, window: int | None, dtype: torch.dtype) -> list[tuple[int, int, int]]:
        """(first block, blocks, offset in the mask) of each range of decode group `index`'s
        `PoolRuns` that holds a slot its token sees (a sliding window may hide whole ranges)."""
        key = (index, window)
        found = self._ranges.get(key)
        if found is None:
            runs = self.decode_groups[index].in_place
            assert runs is not None
            seen = torch.isfinite(self.decode_mask(index, window, dtype)[0, 0, 0])
            found, offset = [], 0
            for lo, m in runs.ranges:
                width = m * self.block_size
                if bool(seen[offset:offset + width].any()):
                    found.append((lo, m, offset))
                offset += width
            self._ranges[key] = found
        return found

    def prefill_mask(self, index: int, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask ``(q_len, context_len)`` of prefill `index`, or None when plain causal suffices."""
        key = ("prefill", index, window)
        if key in self._masks:
            return self._masks[key]
        span = self.prefills[index]
        needs_window = window is not None and span.context_len > window
        mask: torch.Tensor | None = None
        if span.start_pos > 0 or needs_window:
            device = span.block_table.device
            qpos = torch.arange(span.start_pos, span.context_len, device=device)[:, None]
            kpos = torch.arange(span.context_len, device=device)[None, :]
            visible = kpos <= qpos
            if needs_window:
                assert window is not None
                visible &= kpos > qpos - window
            mask = additive_mask(visible, dtype)
        self._masks[key] = mask
        return mask


def write_kv(
    layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> None:
    """Scatter the new K and V of one layer into their slots."""
    heads, dim = layer_pool.shape[-2:]
    layer_pool[0].view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    layer_pool[1].view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    ctx: AttentionContext,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """Attention output of every new token; K/V of this step must already be in `layer_pool`.

    Tokens that belong to neither a prefill span nor the decode set do not exist:
    the runner puts every sequence in exactly one of them.
    """
    if ctx.prefill_kernel is not None:
        out = q.new_empty(q.shape)
        for span in ctx.prefills:
            rows = slice(span.token_start, span.token_start + span.q_len)
            ctx.prefill_kernel.attend(q[rows], layer_pool, span.block_table, span.start_pos, scale, window, out[rows])
    elif _is_one_fresh_prompt(q, ctx):
        # The whole batch is one fresh prompt: the kernel's output, (1, q_len, heads, dim) in
        # memory, is already `out`'s layout, so it is returned without a copy.
        mask = ctx.prefill_mask(0, window, q.dtype)
        return fresh_prefill(q, k, v, mask, scale)[0].transpose(0, 1)
    else:
        out = q.new_empty(q.shape)
        _sdpa_prefills(q, k, v, layer_pool, ctx, scale, window, out)
    if ctx.kernel is not None and ctx.kernel_batch is not None:
        ctx.kernel.attend(q, layer_pool, ctx.kernel_batch, scale, window, out)
    elif ctx.paged is not None:
        assert window is None, "paged decodes are built only for models without sliding windows"
        paged_decode_attention(q, layer_pool, ctx.paged, ctx.decode_kv, scale, out)
    elif ctx.flex is not None and ctx.flex_batch is not None:
        assert window is None, "in-place decode attention has no sliding window"
        ctx.flex.attend(q, layer_pool, ctx.flex_batch, scale, out)
    elif ctx.decode_groups:
        _decode_attention(q, layer_pool, ctx, scale, window, out)
    return out


def _sdpa_prefills(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    ctx: AttentionContext,
    scale: float,
    window: int | None,
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim), written at the prefill tokens
) -> None:
    """Every prefill span by SDPA: a fresh prompt over its own K/V, a continued one split
    (`continued_prefill`) or over its whole context gathered from the pool."""
    k_cache, v_cache = layer_pool[0], layer_pool[1]  # (num_blocks, block_size, kv_heads, head_dim)
    for i, span in enumerate(ctx.prefills):
        end = span.token_start + span.q_len
        rows = slice(span.token_start, end)
        if span.start_pos > 0 and can_split_prefill(q, window, span):
            continued_prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span.block_table,
                              span.start_pos, scale, out[rows].transpose(0, 1)[None])  # fmt: skip
            continue
        mask = ctx.prefill_mask(i, window, q.dtype)
        if span.start_pos == 0:
            o = fresh_prefill(q[rows], k[rows], v[rows], mask, scale)
        else:
            qs = q[rows].transpose(0, 1)  # (num_heads, q_len, head_dim)
            ks = _gather(k_cache, span.block_table, span.context_len)
            vs = _gather(v_cache, span.block_table, span.context_len)
            # With a batch dim (4-D inputs) CPU SDPA takes the flash kernel; 3-D falls back to the math path.
            o = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )  # (1, num_heads, q_len, head_dim)
        out[rows] = o[0].transpose(0, 1)


def _decode_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    ctx: AttentionContext,
    scale: float,
    window: int | None,
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim), written at the decode tokens
) -> None:
    _, _, bs, kv_heads, dim = layer_pool.shape
    heads = q.shape[1]
    for i, group in enumerate(ctx.decode_groups):
        mask = ctx.decode_mask(i, window, q.dtype)
        if group.in_place is not None:
            _attend_ranges(q, layer_pool, group.token_index, ctx.visible_ranges(i, window, q.dtype),
                           mask, scale, out)  # fmt: skip
            continue
        n, width = group.num_seqs, group.width_blocks * bs
        num_blocks = group.block_index.shape[0]
        k_rows, v_rows = ctx.decode_kv[0, :num_blocks], ctx.decode_kv[1, :num_blocks]
        torch.index_select(layer_pool[0], 0, group.block_index, out=k_rows)
        torch.index_select(layer_pool[1], 0, group.block_index, out=v_rows)
        kd = k_rows.view(n, width, kv_heads, dim).transpose(1, 2)  # (n, kv_heads, width, head_dim)
        vd = v_rows.view(n, width, kv_heads, dim).transpose(1, 2)
        # the query heads sharing a KV head ride as the query length (GQA without expanding K/V)
        qd = q.index_select(0, group.token_index).view(n, kv_heads, heads // kv_heads, dim)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        out.index_copy_(0, group.token_index, o.view(n, heads, dim))


def _attend_ranges(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    token_index: torch.Tensor,  # (1,): the lone decode's token
    ranges: list[tuple[int, int, int]],  # (first block, blocks, offset in the mask), each seen
    mask: torch.Tensor,  # (1, 1, 1, total slots of the ranges)
    scale: float,
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim)
) -> None:
    """One decode over ranges read in place: one SDPA for one range; on CPU, for several, a
    flash SDPA per range merged by log-sum-exp. The query heads sharing a KV head ride as
    the query length (GQA without expanding K/V)."""
    _, _, bs, kv_heads, dim = layer_pool.shape
    heads = q.shape[1]
    qg = q.index_select(0, token_index).view(1, kv_heads, heads // kv_heads, dim)

    def view(lo: int, m: int, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V (1, kv_heads, m * block_size, head_dim) of blocks lo..lo+m-1, and their mask."""
        width = m * bs
        kd = layer_pool[0, lo:lo + m].view(1, width, kv_heads, dim).transpose(1, 2)
        vd = layer_pool[1, lo:lo + m].view(1, width, kv_heads, dim).transpose(1, 2)
        return kd, vd, mask[..., offset:offset + width]

    if len(ranges) == 1:
        kd, vd, seen = view(*ranges[0])
        merged = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=seen, scale=scale)
    else:
        outs, lses = [], []
        for r in ranges:
            kd, vd, seen = view(*r)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qg, kd, vd, 0.0, False, attn_mask=seen, scale=scale
            )  # (1, kv_heads, group, dim), (1, kv_heads, group)
            outs.append(o)
            lses.append(lse)
        weights = torch.softmax(torch.stack(lses), dim=0)[..., None]  # exp(lse_i - lse of all)
        merged = (torch.stack(outs) * weights).sum(0)
    out.index_copy_(0, token_index, merged.view(1, heads, dim))


def can_split_prefill(q: torch.Tensor, window: int | None, span: PrefillSpan) -> bool:
    """Whether a continued prefill takes `continued_prefill`: on CPU (the flash kernel that
    returns its log-sum-exp), when no sliding window hides part of the context."""
    return q.device.type == "cpu" and (window is None or span.context_len <= window)


def _is_one_fresh_prompt(q: torch.Tensor, ctx: AttentionContext) -> bool:
    """Whether the step's tokens are exactly one prompt's first chunk (no decodes)."""
    if len(ctx.prefills) != 1 or ctx.num_decodes:
        return False
    span = ctx.prefills[0]
    return span.start_pos == 0 and span.token_start == 0 and span.q_len == q.shape[0]


def _gather(
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (num_blocks_of_seq,)
    context_len: int,
) -> torch.Tensor:  # (num_kv_heads, context_len, head_dim)
    heads, dim = cache.shape[-2:]
    flat = cache.index_select(0, block_table).view(-1, heads, dim)[:context_len]
    return flat.transpose(0, 1)
