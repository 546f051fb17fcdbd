"""One decode measurement in its own process, for `bench_engine.py` (not a test).

Imports kvduplex from `--src` (any checkout, e.g. an older commit), so the
engine benchmark can run the same workload on two source trees, A B A B.
Prints one JSON object:

* ``itl_ms``: inter-token latencies of one stream (`--context` prompt tokens,
  `--new-tokens` greedy tokens), each the wall time of the step that made it;
* ``concurrent``: `--concurrency` requests added at once (same prompt length,
  distinct prompts): output tokens / wall seconds from their arrival to the
  last token, and output tokens / seconds of the steps where all decode.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--model", default="small")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpus", default="0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-attention", default="")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.src).resolve()))
    import inspect
    import os

    import torch

    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")} & os.sched_getaffinity(0) or os.sched_getaffinity(0))
    torch.set_num_threads(args.threads)
    from kvduplex.common.engine_config import CacheConfig
    from kvduplex.common.engine_config import EngineConfig
    from kvduplex.common.engine_config import ModelLoadConfig
    from kvduplex.common.engine_config import SchedulerConfig
    from kvduplex.common.sampling import SamplingParams
    from kvduplex.engine.engine import LLMEngine
    from kvduplex.engine.request import Request

    extra = {"decode_attention": args.decode_attention} if args.decode_attention else {}
    cfg = EngineConfig(
        model=ModelLoadConfig(model=args.model, seed=args.seed, dtype=args.dtype, device="cpu", **extra),
        cache=CacheConfig(block_size=16, kv_cache_mb=1024),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )
    engine = LLMEngine(cfg)
    rng = random.Random(args.seed)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(args.context)]

    # A baseline checkout from before 2026-12-04 takes the request's fields, not a Request.
    takes_request = len(inspect.signature(engine.add_request).parameters) == 1

    def run(n: int, tag: str) -> dict[str, Any]:
        for i in range(n):
            if takes_request:
                engine.add_request(Request(f"{tag}-{i}", prompt(), params))
            else:
                engine.add_request(f"{tag}-{i}", prompt(), params)  # type: ignore[call-arg,arg-type]
        t0 = time.perf_counter()
        itl: list[float] = []
        decode_s, decode_tokens = 0.0, 0
        while engine.has_unfinished():
            all_decode = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler._running) \
                and engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == n
            s0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - s0
            made = sum(len(o.new_token_ids) for o in outs)
            if all_decode:
                decode_s += dt
                decode_tokens += made
                itl.append(dt)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "output_tokens": n * args.new_tokens, "itl_s": itl,
                "decode_s": decode_s, "decode_tokens": decode_tokens}

    run(1, "warm-a")  # compiles (flex), first-touch of everything
    run(2, "warm-b")
    single = run(1, "single")
    many = run(args.concurrency, "many")
    print(json.dumps({
        "decode_attention": getattr(engine.runner, "decode_attention", "sdpa"),
        "dtype": args.dtype,
        "itl_ms": [t * 1e3 for t in single["itl_s"]],
        "concurrent": {
            "output_tokens_per_s": many["output_tokens"] / many["wall_s"],
            "decode_tokens_per_s": many["decode_tokens"] / many["decode_s"],
            "wall_s": many["wall_s"],
        },
    }))


if __name__ == "__main__":
    main()
