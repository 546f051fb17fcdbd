"""Decode under load: two ways of running the same decode step side by side in one engine
(not a test). ``--compare attention`` (default): decode attention copying each sequence's
blocks against reading the pool in place; ``--compare kernel``: the in-place SDPA path
(``paged``) against the compiled CPU kernel (``kernel``). ``--compare matmul``: linear layers on the plain
weights (MKL) against the oneDNN-packed copies for batches of two or more rows.

For each context C, the largest concurrency's requests (C random token ids each, seeded,
greedy, ``ignore_eos``) are prefilled in one engine; then, for each concurrency B from
the largest down (requests beyond B aborted in between), whole engine steps (schedule,
forward, sample, detokenise) alternate between the decode attention paths in blocks::

    warm-up A, warm-up B, A x block, B x block, A x block, ...

Same engine, weights, requests and pool for both: for ``attention`` only
`ModelRunner.set_decode_attention` differs (``copy``: blocks copied into a scratch buffer
per group, the path before; ``sdpa``: every decode read in place where its blocks form long
ranges); for ``matmul`` only whether the linear layers hold their oneDNN-packed copies
(``plain``: MKL on the column-major weight at every batch, as with
``--no-cpu-packed-weights``; ``packed``: the default); for ``both``, the two together
(``paged+plain``, the state before either, against ``kernel+packed``). The context grows by one token a
step for both alike. Decode tok/s = B / step time.

    .venv/bin/python benchmarks/bench_decode_load.py                          # small, 1k/2k/4k
    .venv/bin/python benchmarks/bench_decode_load.py --contexts 2048 --concurrency 8 4 1
    .venv/bin/python benchmarks/bench_decode_load.py --compare matmul --model results/llama-50m

Writes results/bench_decode_load[-<tag>].json and .md. The JSON holds every step's time, the
machine's load from other processes during each cell (``/proc/stat`` minus this process)
and how many ranges of consecutive blocks each sequence's table formed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {
    "attention": ("copy", "paged"),
    "kernel": ("paged", "kernel"),
    "matmul": ("plain", "packed"),
    "both": ("paged+plain", "kernel+packed"),
}


class ForeignLoad:
    """Share of the machine's CPUs busy with processes other than this one, between marks."""

    def __init__(self) -> None:
        self._mark = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        own = sum(os.times()[:2]) * os.sysconf("SC_CLK_TCK")
        return time.monotonic(), busy, own

    def take(self) -> float:
        """Foreign busy CPUs (0 = none, 1 = one whole core) since the last call."""
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self._mark, now
        self._mark = now
        ticks = os.sysconf("SC_CLK_TCK") * max(t1 - t0, 1e-9)
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / ticks


def make_engine(model: str, seed: int, threads: int, max_seqs: int, kv_mb: int) -> Any:
    from kvduplex.common.engine_config import CacheConfig
    from kvduplex.common.engine_config import EngineConfig
    from kvduplex.common.engine_config import ModelLoadConfig
    from kvduplex.common.engine_config import SchedulerConfig
    from kvduplex.engine.engine import LLMEngine

    cfg = EngineConfig(
        model=ModelLoadConfig(model=model, seed=seed, dtype="float32", device="cpu", num_threads=threads),
        cache=CacheConfig(block_size=16, kv_cache_mb=kv_mb),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048),
    )
    return LLMEngine(cfg)


def table_ranges(engine: Any) -> list[int]:
    """Ranges of consecutive block ids each running request's table forms."""
    import numpy as np

    from kvduplex.engine.runner_inputs import pool_runs

    counts = []
    for req in engine.scheduler._running:
        ids = np.asarray(req.block_ids, dtype=np.int64)
        runs = pool_runs(ids, 16, ids.size + 1)
        counts.append(len(runs[0]) if runs else -1)
    return counts


class Variants:
    """Switches one engine between the two ways of `--compare`."""

    def __init__(self, engine: Any, compare: str) -> None:
        from kvduplex.model.decoder import Linear

        self.engine = engine
        self.names = VARIANTS[compare]
        self.compare = compare
        self._linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        self._packed = [m.packed for m in self._linears]
        self._tied = engine.runner.model.tied_head_packed
        if compare in ("matmul", "both") and not any(p is not None for p in self._packed):
            raise SystemExit("no linear weight is packed for oneDNN here (not float32 on CPU?)")

    def use(self, name: str) -> None:
        attention, _, weights = name.partition("+")
        if self.compare in ("attention", "kernel", "both"):
            self.engine.runner.set_decode_attention(attention)
        if self.compare in ("matmul", "both"):
            self._pack(weights == "packed" if self.compare == "both" else name == "packed")

    def _pack(self, packed: bool) -> None:
        for module, copy in zip(self._linears, self._packed, strict=True):
            module.packed = copy if packed else None
        self.engine.runner.model.tied_head_packed = self._tied if packed else None


def timed_steps(engine: Any, variants: Variants, name: str, num: int) -> list[float]:
    variants.use(name)
    times = []
    for _ in range(num):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_context(
    engine: Any, variants: Variants, context: int, levels: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    from kvduplex.common.sampling import SamplingParams
    from kvduplex.engine.request import Request

    rng = random.Random(args.seed + context)
    vocab = engine.loaded.config.vocab_size
    steps_per_level = 2 * args.warmup + 2 * args.reps * args.block
    # the first requests decode while the later ones still prefill (chunks of 2,048 tokens)
    prefill_steps = -(-max(levels) * context // 2048) + 1
    max_tokens = len(levels) * (steps_per_level + 1) + prefill_steps + 8
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [f"c{context}-{i}" for i in range(max(levels))]
    for rid in rids:
        engine.add_request(Request(rid, [rng.randrange(3, vocab) for _ in range(context)], params))
    t0 = time.perf_counter()
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler._running
    ):
        engine.step()
    prefill_s = time.perf_counter() - t0
    cells = []
    for level in sorted(levels, reverse=True):
        for rid in rids[level:]:
            engine.abort_request(rid)
        rids = rids[:level]
        engine.step()  # the aborts' outputs
        assert len(engine.scheduler._running) == level, "every request must still decode"
        a, b = variants.names
        for name in variants.names:
            timed_steps(engine, variants, name, args.warmup)
        load = ForeignLoad()
        times: dict[str, list[list[float]]] = {n: [] for n in variants.names}
        for _ in range(args.reps):
            for name in variants.names:
                times[name].append(timed_steps(engine, variants, name, args.block))
        if len(engine.scheduler._running) != level:
            raise RuntimeError(f"context {context} x {level}: a request finished while timed")
        flat = {n: [t for block in times[n] for t in block] for n in variants.names}
        block_ratios = [
            statistics.median(x) / statistics.median(y) for x, y in zip(times[a], times[b], strict=True)
        ]
        cell = {
            "context": context,
            "concurrency": level,
            "prefill_s": prefill_s,
            "step_ms": times,
            "p50_ms": {n: statistics.median(flat[n]) for n in variants.names},
            "decode_tok_s": {n: level * 1e3 / statistics.median(flat[n]) for n in variants.names},
            "ratio": statistics.median(flat[a]) / statistics.median(flat[b]),
            "block_ratios": block_ratios,
            "foreign_load_cpus": load.take(),
            "ranges_per_table": table_ranges(engine),
        }
        print(
            f"context {context} x {level}: {a} {cell['p50_ms'][a]:.1f} ms, "
            f"{b} {cell['p50_ms'][b]:.1f} ms, {a}/{b} {cell['ratio']:.2f} "
            f"(blocks {min(block_ratios):.2f}-{max(block_ratios):.2f}), "
            f"foreign load {cell['foreign_load_cpus']:.2f} cpus",
            flush=True,
        )
        cells.append(cell)
    for rid in rids:
        engine.abort_request(rid)
    engine.step()
    return cells


def table(cells: list[dict[str, Any]], names: tuple[str, str]) -> str:
    from benchmarks.common import md_table

    a, b = names
    rows = []
    for c in cells:
        ranges = c["ranges_per_table"]
        rows.append([
            c["context"], c["concurrency"],
            f"{c['p50_ms'][a]:.1f}", f"{c['p50_ms'][b]:.1f}",
            f"{c['decode_tok_s'][a]:.1f}", f"{c['decode_tok_s'][b]:.1f}",
            f"**{c['ratio']:.2f}**",
            f"{min(c['block_ratios']):.2f}-{max(c['block_ratios']):.2f}",
            f"{statistics.median(ranges):.0f}" if ranges else "-",
            f"{c['foreign_load_cpus']:.2f}",
        ])  # fmt: skip
    header = ["context", "decodes", f"step p50 ms {a}", f"step p50 ms {b}", f"decode tok/s {a}",
              f"decode tok/s {b}", f"{a} / {b}", "per-block ratios", "ranges per table",
              "foreign load (cpus)"]  # fmt: skip
    return md_table(header, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--preset", default="small", help="a preset or a Hugging Face folder")
    ap.add_argument("--compare", choices=sorted(VARIANTS), default="attention")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 8, 4, 1])
    ap.add_argument("--reps", type=int, default=3, help="blocks of each path per cell")
    ap.add_argument("--block", type=int, default=4, help="steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="steps of each path before timing a cell")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpus", default="0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import torch

    from benchmarks.common import pin
    from benchmarks.common import write_results
    from kvduplex.common.model_source import model_config

    pinned = pin({int(c) for c in args.cpus.split(",")}, args.threads)
    torch.manual_seed(args.seed)
    cfg = model_config(args.model)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    steps = len(args.concurrency) * (2 * args.warmup + 2 * args.reps * args.block) + 32
    kv_mb = max(args.concurrency) * (max(args.contexts) + steps) * per_token // 2**20 + 64
    engine = make_engine(args.model, args.seed, args.threads, max(args.concurrency), kv_mb)
    engine.warmup()
    variants = Variants(engine, args.compare)
    cells = []
    for context in args.contexts:
        cells += run_context(engine, variants, context, args.concurrency, args)
    a, b = variants.names
    text = (
        f"`{args.model}` float32, whole engine steps, {pinned}; {args.reps} blocks of "
        f"{args.block} steps per variant and cell, interleaved {a}/{b}, after {args.warmup} "
        f"warm-up steps of each; KV pool {kv_mb} MiB\n\n" + table(cells, variants.names)
    )
    name = "bench_decode_load" + (f"-{args.compare}" if args.compare != "attention" else "")
    name += f"-{args.tag}" if args.tag else ""
    write_results(name, {"args": vars(args), "pinned": pinned, "kv_mb": kv_mb, "cells": cells}, text)
    print(text)


if __name__ == "__main__":
    main()
