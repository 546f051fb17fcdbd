"""Decode attention's zero-copy path: a lone sequence whose blocks fill a few ranges of the pool."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvduplex.engine import runner_inputs
from kvduplex.engine.block_table import BlockTables
from kvduplex.engine.kv_cache import KVCacheLayout
from kvduplex.engine.runner_inputs import IN_PLACE_MAX_RANGES
from kvduplex.engine.runner_inputs import InputBuilder
from kvduplex.engine.runner_inputs import SeqInput
from kvduplex.engine.runner_inputs import pool_runs
from kvduplex.model.attention import AttentionContext
from kvduplex.model.attention import paged_attention

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
