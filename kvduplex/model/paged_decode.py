"""Decode attention for a whole batch that reads the paged KV pool in place (`PagedDecodes`).

Design note. A decode's attention is a softmax-weighted sum over its keys, so the keys
may be split into disjoint sets, each attended on its own, and the partial outputs
merged by their log-sum-exps (as flash-decoding merges its splits)::

    out = sum_i exp(lse_i - lse) * out_i,   lse = log(sum_i exp(lse_i))

The runner (`runner_inputs`) splits each sequence's block table into ranges of
consecutive block ids that are long enough to be worth one SDPA call each: those are
views of the pool, no copy (``layer_pool[:, b:b+m]``, masked by the position each
slot holds, since a range may hold the table's blocks in any order). The rest of
every sequence (short runs: decode blocks interleaved with other sequences', a
wrapped pool's fragments) is copied into one scratch buffer, rows grouped by length,
one SDPA per group. On CPU one flash kernel returns the output and the log-sum-exp;
elsewhere the same math runs in plain matmuls (`attend_with_lse_math`), so the code is
the same on every device. Requires layers without a sliding window (the runner keeps
the copy path for models that have one).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import torch


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, -inf elsewhere."""
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill_(~visible, float("-inf"))


@dataclass(frozen=True)
class GatheredRows:
    """Decodes whose remaining blocks (those outside long ranges) are copied, one SDPA."""

    rows: torch.Tensor  # (num_rows,) int64
    """Index of each row's sequence among the step's decodes (`PagedDecodes.token_index`)."""
    row_tokens: torch.Tensor  # (num_rows,) int64
    """Flattened-batch index of each row's token."""
    block_index: torch.Tensor  # (num_rows * width_blocks,) int64
    """Row-major ``(num_rows, width_blocks)`` block ids to copy, padded with block 0."""
    visible: torch.Tensor  # (num_rows, width_blocks * block_size) bool
    """Which copied slots the row's token sees (padding and unwritten slots do not)."""
    width_blocks: int


@dataclass(frozen=True)
class PagedDecodes:
    """All decodes of a step, read from the pool in place wherever their blocks form long
    ranges of consecutive ids (in any order); each sequence's other blocks are copied.

    Every range and every copied row is one partial attention with its log-sum-exp;
    a sequence's partials merge by log-sum-exp (a sum over keys does not care how the
    keys are split)::

        seq 0 table  40 41 42 43 | 7 | 9       range (40, 4) in place; 7, 9 copied
        seq 1 table  12 13 14 15 16 | 20 21    ranges (12, 5), (20, 2) in place
        partials     [0: (40,4)] [1: (12,5)] [1: (20,2)] [0: row 7 9]
    """

    token_index: torch.Tensor  # (num_seqs,) int64
    """Flattened-batch index of each decode's new token."""
    ranges: tuple[tuple[int, int, int], ...]
    """(flattened-batch index of the sequence's token, first block id, number of blocks) of
    each range read in place."""
    range_visible: torch.Tensor  # (sum of the ranges' blocks * block_size,) bool
    """Which slots of the ranges (concatenated) their sequence's token sees."""
    gathered: tuple[GatheredRows, ...]
    """The copied rest, grouped by length."""
    part_seq: torch.Tensor  # (num_parts,) int64
    """Sequence of each partial: the ranges in order, then the gathered rows in order."""
    part_tokens: torch.Tensor  # (num_parts,) int64
    """Flattened-batch index of each partial's token."""
    single_part: bool
    """Every sequence is exactly one partial (no merge needed)."""
    _masks: dict[torch.dtype, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.token_index.shape[0])

    def masks(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Additive masks, built once per step (on first use) for all layers: ``(1, 1, 1, range slots)`` for the ranges and
        ``(num_rows, 1, 1, width_blocks * block_size)`` per gathered group."""
        found = self._masks.get(dtype)
        if found is None:
            found = (
                additive_mask(self.range_visible, dtype)[None, None, None, :],
                [additive_mask(g.visible, dtype)[:, None, None, :] for g in self.gathered],
            )
            self._masks[dtype] = found
        return found


def paged_decode_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    layer_pool: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    pd: PagedDecodes,
    decode_kv: torch.Tensor,  # (2, >= blocks of the largest gathered group, block_size, kv_heads, head_dim)
    scale: float,
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim), written at the decode tokens
) -> None:
    """Attention of every decode in `pd` over one layer's pool: a partial attention per
    range (in place) and per gathered group (copied into the scratch `decode_kv`), merged
    per sequence by log-sum-exp."""
    _, _, bs, kv_heads, dim = layer_pool.shape
    n, heads = pd.num_seqs, q.shape[1]
    group = heads // kv_heads  # the query heads sharing a KV head ride as the query length
    range_mask, group_masks = pd.masks(q.dtype)
    outs: list[torch.Tensor] = []  # (rows, kv_heads, group, dim) each
    lses: list[torch.Tensor] = []  # (rows, kv_heads, group) each
    offset = 0
    for token, lo, m in pd.ranges:
        width = m * bs
        kd = layer_pool[0, lo:lo + m].view(1, width, kv_heads, dim).transpose(1, 2)  # (1, kv_heads, width, dim)
        vd = layer_pool[1, lo:lo + m].view(1, width, kv_heads, dim).transpose(1, 2)
        qd = q[token:token + 1].reshape(1, kv_heads, group, dim)
        o, lse = attend_with_lse(qd, kd, vd, range_mask[..., offset:offset + width], scale)
        outs.append(o)
        lses.append(lse)
        offset += width
    for grp, mask in zip(pd.gathered, group_masks, strict=True):
        rows, width = grp.rows.shape[0], grp.width_blocks * bs
        num_blocks = grp.block_index.shape[0]
        k_rows, v_rows = decode_kv[0, :num_blocks], decode_kv[1, :num_blocks]
        torch.index_select(layer_pool[0], 0, grp.block_index, out=k_rows)
        torch.index_select(layer_pool[1], 0, grp.block_index, out=v_rows)
        kd = k_rows.view(rows, width, kv_heads, dim).transpose(1, 2)  # (rows, kv_heads, width, dim)
        vd = v_rows.view(rows, width, kv_heads, dim).transpose(1, 2)
        qd = q.index_select(0, grp.row_tokens).view(rows, kv_heads, group, dim)
        o, lse = attend_with_lse(qd, kd, vd, mask, scale)
        outs.append(o)
        lses.append(lse)
    o_all = outs[0] if len(outs) == 1 else torch.cat(outs)  # (num_parts, kv_heads, group, dim)
    if pd.single_part:
        out.index_copy_(0, pd.part_tokens, o_all.reshape(-1, heads, dim).to(out.dtype))
        return
    merged = merge_partials(o_all, torch.cat(lses), pd.part_seq, n)
    out.index_copy_(0, pd.token_index, merged.view(n, heads, dim).to(out.dtype))


def attend_with_lse(
    q: torch.Tensor,  # (b, kv_heads, group, dim)
    k: torch.Tensor,  # (b, kv_heads, keys, dim), any strides
    v: torch.Tensor,  # (b, kv_heads, keys, dim)
    mask: torch.Tensor,  # additive, broadcast to (b, kv_heads, group, keys)
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (b, kv_heads, group, dim), (b, kv_heads, group) float32
    """Attention output and the log-sum-exp of its scores. On CPU the flash kernel returns
    both; elsewhere the same math in plain ops (every row must see at least one key)."""
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return o, lse.float()
    return attend_with_lse_math(q, k, v, mask, scale)


def attend_with_lse_math(
    q: torch.Tensor,  # (b, kv_heads, group, dim)
    k: torch.Tensor,  # (b, kv_heads, keys, dim)
    v: torch.Tensor,  # (b, kv_heads, keys, dim)
    mask: torch.Tensor,  # additive, broadcast to (b, kv_heads, group, keys)
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (b, kv_heads, group, dim), (b, kv_heads, group) float32
    """`attend_with_lse` in plain matmuls, softmax in float32 (any device)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + mask  # (b, kv_heads, group, keys)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, v), lse


def merge_partials(
    outs: torch.Tensor,  # (num_parts, kv_heads, group, dim)
    lses: torch.Tensor,  # (num_parts, kv_heads, group) float32
    part_seq: torch.Tensor,  # (num_parts,) int64: sequence of each partial
    num_seqs: int,
) -> torch.Tensor:  # (num_seqs, kv_heads, group, dim) float32
    """Each sequence's attention from its partials over disjoint key sets:
    ``sum_i exp(lse_i - lse) * out_i`` with ``lse`` the log-sum-exp of the ``lse_i``."""
    shape = (num_seqs, *lses.shape[1:])
    index = part_seq[:, None, None].expand_as(lses)
    top = lses.new_full(shape, float("-inf")).scatter_reduce_(0, index, lses, "amax")
    weights = torch.exp(lses - top.index_select(0, part_seq))  # (num_parts, kv_heads, group)
    total = lses.new_zeros(shape).index_add_(0, part_seq, weights)
    summed = lses.new_zeros((*shape, outs.shape[-1])).index_add_(0, part_seq, outs.float() * weights[..., None])
    return summed / total[..., None]
