"""Decode attention over the paged pool: grouped copy + SDPA against FlexAttention in place (not a test).

One layer of the `small` preset's attention (9 query heads, 3 KV heads of 64,
16-token blocks), batches of 1 and 16 decodes at contexts of 512 to 4,096
tokens, each sequence's blocks scattered over the pool. Per case the two paths
run interleaved (A B A B), built by the runner's own input builder, so each
includes its per-layer work (block copies and masks, or the in-place kernel);
the per-step metadata (groups, block mask) is built once per case, as a step
does once for all layers. Also: the compile time of the FlexAttention kernel
and the largest difference between the two outputs.

With ``--batched``: batches of decodes copied against read in place (`PagedDecodes`) at
a few thresholds of ranges long enough to read in place, over three block layouts.

With ``--zero-copy``: one decode whose blocks fill a few ranges of the pool,
read in place (`DecodeGroup.in_place`) against the same step forced through
the block copy; three arrangements: one ascending run (what a fresh pool
hands a lone stream), one range in descending order (blocks from the prefix
cache's LRU) and two ranges; no FlexAttention, nothing compiled.

    .venv/bin/python benchmarks/bench_decode_attention.py
    .venv/bin/python benchmarks/bench_decode_attention.py --zero-copy
    .venv/bin/python benchmarks/bench_decode_attention.py --batched --batches 1 4 8 16 --contexts 1024 2048 4096

Writes results/bench_decode_attention.json and .md (``_zero_copy`` with the flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import pin
from benchmarks.common import write_results
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine import runner_inputs
from kvduplex.engine.block_table import BlockTables
from kvduplex.engine.runner_inputs import InputBuilder
from kvduplex.engine.runner_inputs import SeqInput
from kvduplex.model.attention import AttentionContext
from kvduplex.model.attention import paged_attention
from kvduplex.model.flex_decode import FlexDecode

HEADS, KV_HEADS, DIM, BS = 9, 3, 64, 16


def case(batch: int, context: int, flex: FlexDecode, reps: int, iters: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-(context + 1) // BS)
    num_blocks = batch * blocks_per_seq * 3 // 2 + 1
    layout = KVCacheLayout(1, num_blocks, BS, KV_HEADS, DIM)
    pool = torch.randn((2, num_blocks, BS, KV_HEADS, DIM), generator=gen)
    flex.num_pool_blocks = num_blocks
    flex._grow(max(64, batch))
    tables = BlockTables(num_blocks)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    for i in range(batch):
        tables.set(i, perm[i * blocks_per_seq : (i + 1) * blocks_per_seq])
    seqs = [SeqInput([1], context - i % 16, None, True) for i in range(batch)]  # contexts differ a little
    q = torch.randn((batch, HEADS, DIM), generator=gen)
    k = torch.randn((batch, KV_HEADS, DIM), generator=gen)
    ctxs = {
        "sdpa": InputBuilder(layout, torch.device("cpu")).build(seqs, list(range(batch)), tables).ctx,
        "flex": InputBuilder(layout, torch.device("cpu"), flex).build(seqs, list(range(batch)), tables).ctx,
    }
    outs, times = _interleaved(ctxs, q, k, pool, reps, iters)
    sdpa, fl = statistics.median(times["sdpa"]), statistics.median(times["flex"])
    return {
        "batch": batch, "context": context, "sdpa_ms": sdpa * 1e3, "flex_ms": fl * 1e3,
        "speedup": sdpa / fl, "max_abs_diff": float((outs["sdpa"] - outs["flex"]).abs().max()),
        "raw_ms": {n: [t * 1e3 for t in v] for n, v in times.items()},
    }  # fmt: skip


ARRANGEMENTS = ("ascending", "descending", "two ranges")


def zero_copy_case(context: int, reps: int, iters: int, seed: int, arrangement: str) -> dict[str, Any]:
    """One decode in blocks ``b .. b+m-1`` (in the order of `arrangement`, or split in two
    ranges): in place against the same step copied."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-(context + 1) // BS)
    num_blocks = blocks_per_seq * 3 // 2 + 1
    layout = KVCacheLayout(1, num_blocks, BS, KV_HEADS, DIM)
    pool = torch.randn((2, num_blocks, BS, KV_HEADS, DIM), generator=gen)
    tables = BlockTables(num_blocks)
    start = num_blocks - blocks_per_seq  # not at the pool's start
    blocks = list(range(start, start + blocks_per_seq))
    if arrangement == "descending":
        blocks.reverse()
    elif arrangement == "two ranges":
        half = blocks_per_seq // 2
        blocks = list(range(num_blocks - half, num_blocks)) + list(range(blocks_per_seq - half))[::-1]
    tables.set(0, blocks)
    in_place = InputBuilder(layout, torch.device("cpu")).build([SeqInput([1], context, None, True)], [0], tables).ctx
    runs = in_place.decode_groups[0].in_place
    assert runs is not None and len(runs.ranges) == (2 if arrangement == "two ranges" else 1)
    copied = dataclasses.replace(
        in_place,
        decode_groups=[dataclasses.replace(g, in_place=None) for g in in_place.decode_groups],
        decode_kv=torch.empty((2, blocks_per_seq, BS, KV_HEADS, DIM)),
        _masks={},
    )
    q = torch.randn((1, HEADS, DIM), generator=gen)
    k = torch.randn((1, KV_HEADS, DIM), generator=gen)
    outs, times = _interleaved({"copy": copied, "zero_copy": in_place}, q, k, pool, reps, iters)
    cp, zc = statistics.median(times["copy"]), statistics.median(times["zero_copy"])
    return {
        "batch": 1, "arrangement": arrangement, "context": context, "copy_ms": cp * 1e3, "zero_copy_ms": zc * 1e3, "speedup": cp / zc,
        "max_abs_diff": float((outs["copy"] - outs["zero_copy"]).abs().max()),
        "raw_ms": {n: [t * 1e3 for t in v] for n, v in times.items()},
    }  # fmt: skip


LAYOUTS = ("engine", "wrapped", "scattered")
MIN_RANGE_TOKENS = (64, 256, 1024)


def batched_case(batch: int, context: int, layout_name: str, reps: int, iters: int, seed: int) -> dict[str, Any]:
    """`batch` decodes copied (``copy``) against read in place (``sdpa``, `PagedDecodes`) at
    several thresholds of `IN_PLACE_MIN_RANGE_TOKENS`. Layouts: ``engine``: each prompt one
    ascending run, then 4 decode blocks per sequence interleaved between sequences (what a
    fresh pool hands concurrent decodes); ``wrapped``: runs of 8 blocks in random order and
    places (a pool that wrapped through the prefix cache's LRU); ``scattered``: every block
    anywhere."""
    import random

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt_blocks, decode_blocks = -(-context // BS), 4
    per_seq = prompt_blocks + decode_blocks
    num_blocks = batch * per_seq + 1
    layout = KVCacheLayout(1, num_blocks, BS, KV_HEADS, DIM)
    pool = torch.randn((2, num_blocks, BS, KV_HEADS, DIM), generator=gen)
    if layout_name == "engine":
        tables_l = [list(range(i * prompt_blocks, (i + 1) * prompt_blocks)) for i in range(batch)]
        base = batch * prompt_blocks
        for j in range(decode_blocks):
            for i in range(batch):
                tables_l[i].append(base + j * batch + i)
    else:
        ids = list(range(num_blocks - 1))
        if layout_name == "wrapped":
            chunks = [ids[a:a + 8] for a in range(0, len(ids), 8)]
            rng.shuffle(chunks)
            ids = [b for c in chunks for b in c]
        else:
            rng.shuffle(ids)
        tables_l = [ids[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    tables = BlockTables(num_blocks)
    for i, t in enumerate(tables_l):
        tables.set(i, t)
    ends = [context + decode_blocks * BS - rng.randrange(BS) for _ in range(batch)]
    seqs = [SeqInput([1], e - 1, None, True) for e in ends]
    keys = list(range(batch))
    ctxs = {"copy": InputBuilder(layout, torch.device("cpu")).build(seqs, keys, tables).ctx}
    default = runner_inputs.IN_PLACE_MIN_RANGE_TOKENS
    try:
        for tokens in MIN_RANGE_TOKENS:
            runner_inputs.IN_PLACE_MIN_RANGE_TOKENS = tokens
            builder = InputBuilder(layout, torch.device("cpu"), paged=True)
            ctxs[f"sdpa {tokens}"] = builder.build(seqs, keys, tables).ctx
    finally:
        runner_inputs.IN_PLACE_MIN_RANGE_TOKENS = default
    q = torch.randn((batch, HEADS, DIM), generator=gen)
    k = torch.randn((batch, KV_HEADS, DIM), generator=gen)
    outs, times = _interleaved(ctxs, q, k, pool, reps, iters)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    return {
        "batch": batch, "context": context, "layout": layout_name, "ms": med,
        "max_abs_diff": max(float((outs["copy"] - o).abs().max()) for o in outs.values()),
        "raw_ms": {n: [t * 1e3 for t in v] for n, v in times.items()},
    }  # fmt: skip


def _interleaved(
    ctxs: dict[str, AttentionContext], q: torch.Tensor, k: torch.Tensor, pool: torch.Tensor, reps: int, iters: int
) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """Each variant's output, and seconds per call of `reps` runs of `iters` calls, variants alternating."""
    scale = DIM**-0.5
    outs = {name: paged_attention(q, k, k, pool, ctx, scale, None) for name, ctx in ctxs.items()}
    times: dict[str, list[float]] = {name: [] for name in ctxs}
    for _ in range(reps):
        for name, ctx in ctxs.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                paged_attention(q, k, k, pool, ctx, scale, None)
            times[name].append((time.perf_counter() - t0) / iters)
    return outs, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zero-copy", action="store_true", help="one decode in place vs copied (batch 1 only)")
    ap.add_argument("--batched", action="store_true", help="batches copied vs read in place (PagedDecodes)")
    ap.add_argument("--cpus", default="0")
    args = ap.parse_args()
    pinned = pin({int(c) for c in args.cpus.split(",")}, args.threads)
    if args.batched:
        results = [
            batched_case(b, c, lay, args.reps, args.iters, args.seed)
            for lay in LAYOUTS for c in args.contexts for b in args.batches
        ]
        names = ["copy"] + [f"sdpa {t}" for t in MIN_RANGE_TOKENS]
        rows = [
            [r["layout"], r["batch"], r["context"]] + [f"{r['ms'][n]:.3f}" for n in names]
            + [f"{r['ms']['copy'] / r['ms'][f'sdpa {default}']:.2f}", f"{r['max_abs_diff']:.1e}"]
            for r in results
            for default in [runner_inputs.IN_PLACE_MIN_RANGE_TOKENS]
        ]  # fmt: skip
        header = ["layout", "decodes", "context", *[f"{n} ms" for n in names],
                  f"copy / sdpa {runner_inputs.IN_PLACE_MIN_RANGE_TOKENS}", "max abs diff"]  # fmt: skip
        table = (f"One layer, {HEADS}/{KV_HEADS} heads of {DIM}, {BS}-token blocks, ms per call "
                 f"(`sdpa N`: ranges of N+ tokens in place), median of {args.reps} interleaved runs "
                 f"of {args.iters} ({pinned})\n\n" + md_table(header, rows))
        write_results("bench_decode_attention_batched", {"pinned": pinned, "results": results}, table)
        print(table)
        return
    if args.zero_copy:
        zero_copy_main(args, pinned)
        return
    flex = FlexDecode(64, BS, torch.device("cpu"))
    compile_s = {}
    for b in (1, 2):  # batch 1 compiles apart from any other batch
        t0 = time.perf_counter()
        case(b, 64, flex, 1, 1, args.seed)
        compile_s[f"batch {b}"] = time.perf_counter() - t0
    results = [case(b, c, flex, args.reps, args.iters, args.seed)
               for b in args.batches for c in args.contexts]  # fmt: skip
    rows = [[r["batch"], r["context"], f"{r['sdpa_ms']:.3f}", f"{r['flex_ms']:.3f}",
             f"{r['speedup']:.2f}", f"{r['max_abs_diff']:.1e}"] for r in results]  # fmt: skip
    table = (
        f"Decode attention of one layer (`small` shapes: 9/3 heads x 64, 16-token blocks), ms per "
        f"call, median of {args.reps} interleaved runs of {args.iters} ({pinned}). FlexAttention "
        f"compile: {compile_s['batch 1']:.1f} s (batch 1) + {compile_s['batch 2']:.1f} s (any other "
        "batch), with inductor's on-disk cache as this machine had it\n\n"
        + md_table(["decodes", "context", "grouped copy + SDPA", "FlexAttention in place",
                    "speed-up", "max abs diff"], rows)
    )
    write_results("bench_decode_attention", {"pinned": pinned, "compile_s": compile_s,
                                             "results": results}, table)  # fmt: skip
    print(table)


def zero_copy_main(args: argparse.Namespace, pinned: str) -> None:
    results = [zero_copy_case(c, args.reps, args.iters, args.seed, a)
               for a in ARRANGEMENTS for c in args.contexts]  # fmt: skip
    rows = [[r["arrangement"], r["context"], f"{r['copy_ms']:.3f}", f"{r['zero_copy_ms']:.3f}",
             f"{r['speedup']:.2f}", f"{r['max_abs_diff']:.1e}"] for r in results]  # fmt: skip
    table = (
        f"One decode's attention in one layer (`small` shapes: 9/3 heads x 64, 16-token blocks), "
        f"ms per call, median of {args.reps} interleaved runs of {args.iters} ({pinned})\n\n"
        + md_table(["blocks", "context", "copy + SDPA", "in place", "speed-up", "max abs diff"], rows)
    )
    write_results("bench_decode_attention_zero_copy", {"pinned": pinned, "results": results}, table)
    print(table)


if __name__ == "__main__":
    main()
