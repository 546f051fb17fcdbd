"""Decode attention read from the pool in place: a lone sequence over a few ranges (the copy
path's exception), and every decode of a batch (`PagedDecodes`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine import runner_inputs
from kvduplex.engine.block_table import BlockTables
from kvduplex.engine.runner_inputs import IN_PLACE_MAX_RANGES
from kvduplex.engine.runner_inputs import InputBuilder
from kvduplex.engine.runner_inputs import SeqInput
from kvduplex.engine.runner_inputs import pool_runs
from kvduplex.model import paged_decode
from kvduplex.model.attention import AttentionContext
from kvduplex.model.attention import paged_attention
from kvduplex.model.paged_decode import attend_with_lse
from kvduplex.model.paged_decode import attend_with_lse_math
from kvduplex.model.paged_decode import merge_partials

HEADS, KV_HEADS, DIM, BS, NUM_BLOCKS = 4, 2, 8, 4, 24


def _ctx(tables: dict[str, list[int]], contexts: dict[str, int]) -> AttentionContext:
    bt = BlockTables(NUM_BLOCKS)
    for key, block_ids in tables.items():
        bt.set(key, block_ids)
    builder = InputBuilder(KVCacheLayout(1, NUM_BLOCKS, BS, KV_HEADS, DIM), torch.device("cpu"))
    seqs = [SeqInput([1], contexts[key] - 1, None, True, key) for key in tables]
    return builder.build(seqs, list(tables), bt).ctx


def _copy_path(ctx: AttentionContext) -> AttentionContext:
    """The same step with every group forced through the block copy."""
    groups = [dataclasses.replace(g, in_place=None) for g in ctx.decode_groups]
    width = max(g.block_index.shape[0] for g in groups)
    scratch = torch.empty((2, width, BS, KV_HEADS, DIM))
    return dataclasses.replace(ctx, decode_groups=groups, decode_kv=scratch, _masks={})


@pytest.mark.parametrize("window", [None, 5])
def test_contiguous_lone_decode_reads_the_pool_in_place_with_the_copy_paths_output(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn((2, NUM_BLOCKS, BS, KV_HEADS, DIM), generator=gen)
    q = torch.randn((1, HEADS, DIM), generator=gen)
    # 1. blocks 6..10, context 18 (the last block holds 2 tokens; its 2 stale slots are masked)
    ctx = _ctx({"a": [6, 7, 8, 9, 10]}, {"a": 18})
    (group,) = ctx.decode_groups
    assert group.in_place is not None and group.in_place.ranges == ((6, 5),) and group.width_blocks == 5
    assert ctx.decode_kv.shape[1] == 0  # no scratch needed for a view
    # 2. in place and copied give the same output, bit for bit (same layout, same SDPA)
    in_place = paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], pool, ctx, DIM**-0.5, window)
    copied = paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], pool, _copy_path(ctx), DIM**-0.5, window)
    assert torch.equal(in_place, copied)


def _ranges(tables: dict[str, list[int]], contexts: dict[str, int]) -> list[tuple[tuple[int, int], ...] | None]:
    return [g.in_place.ranges if g.in_place else None for g in _ctx(tables, contexts).decode_groups]


@pytest.mark.parametrize("window", [None, 5, 30])
@pytest.mark.parametrize(
    "blocks",
    [
        [10, 9, 8, 7, 6],  # one range, descending (the LRU's order)
        [8, 9, 10, 7, 6],  # one range: a prompt's ascending run, then decode blocks below it
        [3, 4, 5, 20, 19],  # two ranges
        [0, 2, 4, 6, 8],  # five ranges: copied
    ],
)
def test_blocks_in_any_order_over_a_few_ranges_read_in_place_match_the_copy(
    blocks: list[int], window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_inputs, "IN_PLACE_TOKENS_PER_RANGE", 4)  # contexts here are short
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn((2, NUM_BLOCKS, BS, KV_HEADS, DIM), generator=gen)
    q = torch.randn((1, HEADS, DIM), generator=gen)
    ctx = _ctx({"a": blocks}, {"a": 18})
    (group,) = ctx.decode_groups
    expected = pool_runs(np.array(blocks), BS, IN_PLACE_MAX_RANGES)
    assert (group.in_place is None) == (expected is None)
    in_place = paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], pool, ctx, DIM**-0.5, window)
    copied = paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], pool, _copy_path(ctx), DIM**-0.5, window)
    torch.testing.assert_close(in_place, copied, rtol=1e-5, atol=1e-6)


def test_which_tables_are_read_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # each range beyond the first needs IN_PLACE_TOKENS_PER_RANGE tokens of context
    assert _ranges({"a": [3, 4, 9]}, {"a": 12}) == [None]
    monkeypatch.setattr(runner_inputs, "IN_PLACE_TOKENS_PER_RANGE", 6)
    assert _ranges({"a": [3, 4, 9]}, {"a": 12}) == [((3, 2), (9, 1))]
    assert _ranges({"a": [3, 4, 9]}, {"a": 11}) == [None]
    monkeypatch.setattr(runner_inputs, "IN_PLACE_TOKENS_PER_RANGE", 1)
    assert _ranges({"a": [10, 9, 8]}, {"a": 10}) == [((8, 3),)]
    assert _ranges({"a": [13]}, {"a": 3}) == [((13, 1),)]  # one block is a range of one
    assert _ranges({"a": [1, 3, 5, 7, 9]}, {"a": 20}) == [None]  # five ranges: copied
    # two sequences, each a run, share one group: no single view, copied
    ctx = _ctx({"a": [0, 1, 2], "b": [3, 4, 5]}, {"a": 10, "b": 11})
    (group,) = ctx.decode_groups
    assert group.num_seqs == 2 and group.in_place is None
    # the ranges are taken over the blocks the context uses, not the whole table
    assert _ranges({"a": [2, 3, 17]}, {"a": 8}) == [((2, 2),)]


def test_pool_runs() -> None:
    ranges, positions = pool_runs(np.array([6, 7, 8, 4, 5, 12]), 2, 4) or ((), None)
    assert ranges == ((4, 5), (12, 1))
    # slots of blocks 4, 5, 6, 7, 8, 12 hold the sequence's blocks 3, 4, 0, 1, 2, 5
    assert positions is not None
    assert positions.tolist() == [6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 10, 11]
    ranges, positions = pool_runs(np.array([4, 5, 6, 7]), 4, 1) or ((), None)
    assert ranges == ((4, 4),) and positions is not None and positions.tolist() == list(range(16))
    assert pool_runs(np.array([4, 6]), 4, 1) is None  # two ranges, one allowed
    assert pool_runs(np.array([4, 4]), 4, 4) is None  # an id twice


# ------------------------------------------- every decode of a batch read in place (PagedDecodes)


def _paged_ctx(
    tables: dict[str, list[int]], contexts: dict[str, int], kv_heads: int = KV_HEADS, paged: bool = True
) -> AttentionContext:
    bt = BlockTables(NUM_BLOCKS)
    for key, block_ids in tables.items():
        bt.set(key, block_ids)
    layout = KVCacheLayout(1, NUM_BLOCKS, BS, kv_heads, DIM)
    builder = InputBuilder(layout, torch.device("cpu"), paged=paged)
    seqs = [SeqInput([1], contexts[key] - 1, None, True, key) for key in tables]
    return builder.build(seqs, list(tables), bt).ctx


def _reference(
    q: torch.Tensor,  # (num_seqs, heads, dim)
    pool: torch.Tensor,  # (2, num_blocks, block_size, kv_heads, dim)
    tables: dict[str, list[int]],
    contexts: dict[str, int],
) -> torch.Tensor:  # (num_seqs, heads, dim)
    """Each sequence's K/V gathered in logical order, attention in float64."""
    outs = []
    heads, kv_heads = q.shape[1], pool.shape[3]
    for i, key in enumerate(tables):
        n = contexts[key]
        blocks = torch.tensor(tables[key][: -(-n // BS)])
        k = pool[0, blocks].reshape(-1, kv_heads, DIM)[:n].double()  # (n, kv_heads, dim)
        v = pool[1, blocks].reshape(-1, kv_heads, DIM)[:n].double()
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * DIM**-0.5
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(outs).float()


BATCHES = {
    # different context lengths, each table one ascending run
    "runs": ({"a": [0, 1, 2, 3, 4], "b": [8, 9, 10], "c": [12, 13, 14, 15, 16, 17, 18]}, {"a": 18, "b": 9, "c": 28}),
    # a wrapped pool: prompt runs in any order, decode blocks interleaved between sequences
    "wrapped": ({"a": [14, 15, 16, 3, 5, 7], "b": [10, 11, 12, 13, 4, 6], "c": [20, 19, 18]}, {"a": 22, "b": 23, "c": 10}),
    # fragmented: nothing long enough, everything copied
    "fragmented": ({"a": [1, 3, 5, 7], "b": [0, 2], "c": [9, 11, 13, 15, 17, 19]}, {"a": 15, "b": 6, "c": 24}),
    # a lone decode over two ranges and a stray block
    "lone": ({"a": [6, 7, 8, 20, 21, 22, 2]}, {"a": 26}),
}


@pytest.mark.parametrize("heads,kv_heads", [(HEADS, KV_HEADS), (6, 2), (4, 4)])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_batched_decodes_read_in_place_match_a_dense_reference_and_the_copy_path(
    batch: str, heads: int, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_inputs, "IN_PLACE_MIN_RANGE_TOKENS", 2 * BS)  # ranges of 2+ blocks in place
    tables, contexts = BATCHES[batch]
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn((2, NUM_BLOCKS, BS, kv_heads, DIM), generator=gen)
    q = torch.randn((len(tables), heads, DIM), generator=gen)
    ctx = _paged_ctx(tables, contexts, kv_heads)
    assert ctx.paged is not None and not ctx.decode_groups
    kv = q[:, :kv_heads]
    got = paged_attention(q, kv, kv, pool, ctx, DIM**-0.5, None)
    torch.testing.assert_close(got, _reference(q, pool, tables, contexts), rtol=1e-5, atol=1e-5)
    copied = paged_attention(q, kv, kv, pool, _paged_ctx(tables, contexts, kv_heads, paged=False), DIM**-0.5, None)
    torch.testing.assert_close(got, copied, rtol=1e-5, atol=1e-6)


def test_which_blocks_are_read_in_place_and_which_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_inputs, "IN_PLACE_MIN_RANGE_TOKENS", 2 * BS)
    tables, contexts = BATCHES["wrapped"]
    pd = _paged_ctx(tables, contexts).paged
    assert pd is not None
    # (token, first block, blocks): a's 14..16, b's 10..13, c's 18..20 (descending is one range)
    assert pd.ranges == ((0, 14, 3), (1, 10, 4), (2, 18, 3))
    # b's blocks 4 6 and a's 3 5 7 are copied, in logical order, in one group (shortest first)
    (grp,) = pd.gathered
    assert grp.rows.tolist() == [1, 0] and grp.width_blocks == 3
    assert grp.block_index.tolist() == [4, 6, 0, 3, 5, 7]
    assert grp.visible[0].tolist() == [True] * 7 + [False] * 5  # b: 23 tokens, one pad block
    # a's context 22: blocks 3, 4 and 5 of the table hold positions 12..23; 22, 23 unwritten
    assert grp.visible[1].tolist() == [True] * 10 + [False] * 2
    assert pd.part_seq.tolist() == [0, 1, 2, 1, 0] and not pd.single_part
    assert pd.part_tokens.tolist() == [0, 1, 2, 1, 0]  # one token per sequence here
    # c's range reads blocks 18, 19, 20 = its table's blocks 2, 1, 0: positions 8..11, 4..7, 0..3
    # of a 10-token context
    assert pd.range_visible[-12:].tolist() == [True, True, False, False] + [True] * 8
    assert ctx_scratch_blocks(tables, contexts) == 6

    pd = _paged_ctx(*BATCHES["runs"]).paged
    assert pd is not None and pd.single_part and not pd.gathered


def ctx_scratch_blocks(tables: dict[str, list[int]], contexts: dict[str, int]) -> int:
    return int(_paged_ctx(tables, contexts).decode_kv.shape[1])


def test_lse_math_path_and_merge_match_one_attention() -> None:
    """The plain-ops kernel (used off CPU) matches CPU's flash kernel, and partials over
    disjoint keys merge into the attention over all of them."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn((2, 2, 3, DIM), generator=gen)
    k = torch.randn((2, 2, 20, DIM), generator=gen)
    v = torch.randn((2, 2, 20, DIM), generator=gen)
    mask = torch.zeros((2, 1, 1, 20)).masked_fill_(torch.arange(20) >= torch.tensor([[17], [20]])[:, None, None], float("-inf"))
    o_cpu, lse_cpu = attend_with_lse(q, k, v, mask, 0.3)
    o_math, lse_math = attend_with_lse_math(q, k, v, mask, 0.3)
    torch.testing.assert_close(o_math, o_cpu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_math, lse_cpu, rtol=1e-5, atol=1e-5)
    # split the keys 0..7 | 8..19 of each row: four partials, merged per row
    parts = [attend_with_lse_math(q, k[:, :, a:b], v[:, :, a:b], mask[..., a:b], 0.3) for a, b in ((0, 8), (8, 20))]
    outs = torch.cat([parts[0][0], parts[1][0]])
    lses = torch.cat([parts[0][1], parts[1][1]])
    merged = merge_partials(outs, lses, torch.tensor([0, 1, 0, 1]), 2)
    torch.testing.assert_close(merged, o_cpu, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", ["wrapped", "lone"])
def test_batched_decodes_in_place_with_the_plain_ops_kernel_match_the_reference(
    batch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole in-place path as other devices run it (log-sum-exp in plain matmuls)."""
    monkeypatch.setattr(runner_inputs, "IN_PLACE_MIN_RANGE_TOKENS", 2 * BS)
    monkeypatch.setattr(paged_decode, "attend_with_lse", attend_with_lse_math)
    tables, contexts = BATCHES[batch]
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn((2, NUM_BLOCKS, BS, KV_HEADS, DIM), generator=gen)
    q = torch.randn((len(tables), HEADS, DIM), generator=gen)
    got = paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], pool, _paged_ctx(tables, contexts), DIM**-0.5, None)
    torch.testing.assert_close(got, _reference(q, pool, tables, contexts), rtol=1e-5, atol=1e-5)
