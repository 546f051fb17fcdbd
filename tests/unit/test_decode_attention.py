"""Decode attention's zero-copy path: a lone sequence whose blocks are one ascending run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvduplex.engine.block_table import BlockTables
from kvduplex.engine.kv_cache import KVCacheLayout
from kvduplex.engine.runner_inputs import InputBuilder, SeqInput, try_run_start
from kvduplex.model.attention import AttentionContext, paged_attention

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
    groups = [dataclasses.replace(g, run_start=None) for g in ctx.decode_groups]
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
    assert group.run_start == 6 and group.width_blocks == 5
    assert ctx.decode_kv.shape[1] == 0  # no scratch needed for a view
    # 2. in place and copied give the same output, bit for bit (same layout, same SDPA)
    in_place = paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], pool, ctx, DIM**-0.5, window)
    copied = paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], pool, _copy_path(ctx), DIM**-0.5, window)
    assert torch.equal(in_place, copied)


def test_tables_that_are_not_one_ascending_run_take_the_copy_path() -> None:
    # descending, a gap, out of order: all copied
    for blocks in ([10, 9, 8], [6, 7, 9], [6, 8, 7, 9]):
        (group,) = _ctx({"a": blocks}, {"a": 10}).decode_groups
        assert group.run_start is None
    # one block is a run of one
    (group,) = _ctx({"a": [13]}, {"a": 3}).decode_groups
    assert group.run_start == 13
    # two sequences, each a run, share one group: no single view, copied
    ctx = _ctx({"a": [0, 1, 2], "b": [3, 4, 5]}, {"a": 10, "b": 11})
    (group,) = ctx.decode_groups
    assert group.num_seqs == 2 and group.run_start is None
    # the run is taken over the blocks the context uses, not the whole table
    (group,) = _ctx({"a": [2, 3, 17]}, {"a": 8}).decode_groups
    assert group.run_start == 2 and group.width_blocks == 2


def test_try_run_start() -> None:
    assert try_run_start(np.array([4, 5, 6, 7])) == 4
    assert try_run_start(np.array([0])) == 0
    assert try_run_start(np.array([4, 6, 5, 7])) is None  # ends match, order does not
    assert try_run_start(np.array([7, 6, 5, 4])) is None
    assert try_run_start(np.array([4, 5, 7])) is None
