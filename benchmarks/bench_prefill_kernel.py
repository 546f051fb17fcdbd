"""One layer's prefill attention: the CPU kernel against torch's flash SDPA (not a test).

For each (cached keys, chunk) pair, one layer of `llama-50m`'s shapes by default (8 query
heads, 4 KV heads, 64 dims; blocks of 16 in a pool), one thread pinned to `--cpu`, best of
`--reps` (after one warm-up call each):

* kernel: `PrefillKernel.attend` over the pool in place (the engine's path);
* SDPA: torch's causal flash SDPA over dense head-major K/V already copied out of the pool
  (for a continued chunk, two calls, cached keys unmasked and the chunk causal, without
  the merge), i.e. less work than the engine's SDPA path does;
* the core's float32 FMA peak (`csrc/fma_peak.c`), measured in the same run.

    .venv/bin/python benchmarks/bench_prefill_kernel.py
    .venv/bin/python benchmarks/bench_prefill_kernel.py --cases 0:1024 0:2048 2048:2048 14336:2048

Writes results/bench_prefill_kernel[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import md_table
from benchmarks.common import write_results
from kvduplex.model import cpu_prefill
from kvduplex.model.cpu_build import build_library


def fma_peak() -> float:
    lib = ctypes.CDLL(str(build_library(Path(__file__).with_name("csrc") / "fma_peak.c", {})))
    lib.kvd_fma_gflops.restype = ctypes.c_double
    lib.kvd_fma_gflops.argtypes = [ctypes.c_int64]
    return max(lib.kvd_fma_gflops(50_000_000) for _ in range(3))


def best(fn: object, reps: int) -> float:
    assert callable(fn)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(
    kernel: cpu_prefill.PrefillKernel, cached: int, chunk: int, h: int, kvh: int, d: int, reps: int
) -> tuple[float, float]:
    """Best seconds of (the kernel, SDPA) for one chunk after `cached` keys."""
    bs, end = 16, cached + chunk
    blocks = -(-end // bs)
    pool = torch.randn(2, blocks, bs, kvh, d)
    table = torch.arange(blocks)
    q = torch.randn(chunk, h, d)
    out = torch.empty_like(q)
    k_all = pool[0].reshape(-1, kvh, d)[:end].transpose(0, 1).contiguous()[None]
    v_all = pool[1].reshape(-1, kvh, d)[:end].transpose(0, 1).contiguous()[None]
    qs = q.transpose(0, 1)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def sdpa() -> None:
        own = (k_all[:, :, cached:], v_all[:, :, cached:])
        if cached == 0:
            F.scaled_dot_product_attention(qs, *own, is_causal=True, enable_gqa=True)
            return
        flash(qs, k_all[:, :, :cached], v_all[:, :, :cached], 0.0, False, scale=d**-0.5)
        flash(qs, *own, 0.0, True, scale=d**-0.5)

    def ours() -> None:
        kernel.attend(q, pool, table, cached, d**-0.5, None, out)

    return best(ours, reps), best(sdpa, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["0:1024", "0:2048", "2048:2048", "6144:2048"],
                    help="cached:chunk token counts")  # fmt: skip
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    kernel = cpu_prefill.load_kernel(d, h // kvh)
    if kernel is None:
        raise SystemExit("the CPU prefill kernel cannot be built here")
    peak = fma_peak()
    rows, raw = [], []
    for case in args.cases:
        cached, chunk = (int(x) for x in case.split(":"))
        t_k, t_s = measure(kernel, cached, chunk, h, kvh, d, args.reps)
        gflop = 4 * d * h * (chunk * cached + chunk * (chunk + 1) / 2) / 1e9
        raw.append({"cached": cached, "chunk": chunk, "kernel_s": t_k, "sdpa_s": t_s, "gflop": gflop})
        rows.append([cached, chunk, f"{t_k * 1e3:.1f} ({gflop / t_k:.0f} GFLOP/s, {gflop / t_k / peak:.0%})",
                     f"{t_s * 1e3:.1f} ({gflop / t_s:.0f} GFLOP/s, {gflop / t_s / peak:.0%})", f"**{t_k / t_s:.2f}**"])  # fmt: skip
        print(rows[-1], flush=True)
    table_md = (
        f"One layer's prefill attention ({h} heads, {kvh} KV heads, {d} dims), one thread on cpu {args.cpu}, "
        f"best of {args.reps}; core FMA peak {peak:.0f} GFLOP/s\n\n"
        + md_table(["cached keys", "chunk", "kernel ms", "SDPA ms (dense, copied)", "kernel / SDPA"], rows)
    )
    path = write_results("bench_prefill_kernel" + (f"-{args.tag}" if args.tag else ""),
                         {"args": vars(args), "peak_gflops": peak, "raw": raw}, table_md)  # fmt: skip
    print(table_md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
