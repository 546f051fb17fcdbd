"""Decode attention over the paged pool: grouped copy + SDPA against FlexAttention in place (not a test).

One layer of the `small` preset's attention (9 query heads, 3 KV heads of 64,
16-token blocks), batches of 1 and 16 decodes at contexts of 512 to 4,096
tokens, each sequence's blocks scattered over the pool. Per case the two paths
run interleaved (A B A B), built by the runner's own input builder, so each
includes its per-layer work (block copies and masks, or the in-place kernel);
the per-step metadata (groups, block mask) is built once per case, as a step
does once for all layers. Also: the compile time of the FlexAttention kernel
and the largest difference between the two outputs.

    .venv/bin/python benchmarks/bench_decode_attention.py

Writes results/bench_decode_attention.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table, pin, write_results
from kvduplex.engine.block_table import BlockTables
from kvduplex.engine.kv_cache import KVCacheLayout
from kvduplex.engine.runner_inputs import InputBuilder, SeqInput
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
    scale = DIM**-0.5
    outs = {name: paged_attention(q, k, k, pool, ctx, scale, None) for name, ctx in ctxs.items()}
    times: dict[str, list[float]] = {name: [] for name in ctxs}
    for _ in range(reps):
        for name, ctx in ctxs.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                paged_attention(q, k, k, pool, ctx, scale, None)
            times[name].append((time.perf_counter() - t0) / iters)
    sdpa, fl = statistics.median(times["sdpa"]), statistics.median(times["flex"])
    return {
        "batch": batch, "context": context, "sdpa_ms": sdpa * 1e3, "flex_ms": fl * 1e3,
        "speedup": sdpa / fl, "max_abs_diff": float((outs["sdpa"] - outs["flex"]).abs().max()),
        "raw_ms": {n: [t * 1e3 for t in v] for n, v in times.items()},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    pinned = pin({0}, args.threads)
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


if __name__ == "__main__":
    main()
