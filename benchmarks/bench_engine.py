"""Single-instance engine benchmark (not a test).

1. ``throughput``: output tokens/s for 16 concurrent requests of mixed prompt
   (128-1024) and output (32-256) lengths on the `small` preset: our engine
   (continuous batching, paged KV) vs Hugging Face transformers `generate` on
   the same weights, sequential and batched with left padding, in one run.
2. ``ttft``: TTFT of a 2,048-token prompt, cold vs prefix-cache hit (interleaved).
3. ``decode``: single-stream inter-token latency and 16-concurrent output
   tokens/s (512-token prompts, 64 greedy tokens), each variant in its own
   process (`decode_worker.py`) pinned to one core, variants interleaved
   A B A B: this checkout, this checkout with ``--decode-attention flex``
   (``--flex``) or in bfloat16 (``--bf16``), and another checkout (``--baseline-src``, e.g. the commit
   before a change, exported with ``git archive``).
4. ``breakdown``: where a decode step goes at batch 1 and 16 (`profile_step.py`).

    .venv/bin/python benchmarks/bench_engine.py                          # everything
    .venv/bin/python benchmarks/bench_engine.py --sections decode breakdown \
        --baseline-src /tmp/kvd-base --flex                              # the decode path
    .venv/bin/python benchmarks/bench_engine.py --quick                  # smaller, a smoke run

Writes results/bench_engine.json and .md and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import pin
from benchmarks.common import write_results
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.model.loader import load_model
from kvduplex.model.loader import load_safetensors
from kvduplex.model.loader import weight_files


def hf_model_and_ours(preset: str, seed: int) -> tuple[torch.nn.Module, object]:
    """An HF LlamaForCausalLM and our LoadedModel holding the very same weights."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    ours = load_model(ModelLoadConfig(model=preset, seed=seed, dtype="float32", device="cpu"))
    c = ours.config
    hf_cfg = LlamaConfig(  # type: ignore[call-arg]
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        load_safetensors(ours.model, weight_files(Path(tmp)))
    return hf, ours


def workload(
    n: int, seed: int, vocab: int, prompt_range: tuple[int, int], out_range: tuple[int, int]
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
        for _ in range(n)
    ]


def run_ours(engine: LLMEngine, reqs: list[tuple[list[int], int]], tag: str) -> tuple[float, int]:
    for i, (prompt, out_len) in enumerate(reqs):
        engine.add_request(
            Request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
        )
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            produced += len(out.new_token_ids)
    return time.perf_counter() - t0, produced


@torch.inference_mode()
def run_hf_sequential(hf: torch.nn.Module, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    t0 = time.perf_counter()
    produced = 0
    for prompt, out_len in reqs:
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                          min_new_tokens=out_len, do_sample=False)  # type: ignore[operator]
        produced += out.shape[1] - len(prompt)
    return time.perf_counter() - t0, produced


@torch.inference_mode()
def run_hf_batched(hf: torch.nn.Module, reqs: list[tuple[list[int], int]]) -> tuple[float, int, int]:
    """Left-padded batch; every row generates max(out) tokens, the useful ones are counted."""
    width = max(len(p) for p, _ in reqs)
    ids = torch.zeros((len(reqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    max_out = max(o for _, o in reqs)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_out, min_new_tokens=max_out,
                      do_sample=False)  # type: ignore[operator]
    elapsed = time.perf_counter() - t0
    return elapsed, sum(o for _, o in reqs), int(out.shape[0] * (out.shape[1] - width))


def ttft(engine: LLMEngine, prompt: list[int], tag: str) -> tuple[float, int]:
    engine.add_request(Request(tag, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    t0 = time.perf_counter()
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                elapsed = time.perf_counter() - t0
                cached = out.num_cached_tokens
    return elapsed, cached


def decode_section(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Single-stream ITL and concurrent tokens/s per variant, variants interleaved A B A B."""
    here = Path(__file__).resolve().parent
    variants: dict[str, tuple[str, list[str]]] = {"this": (str(here.parent), [])}
    if args.flex:
        variants["this, flex"] = (str(here.parent), ["--decode-attention", "flex"])
    if args.bf16:
        variants["this, bfloat16"] = (str(here.parent), ["--dtype", "bfloat16"])
    if args.baseline_src:
        variants["baseline"] = (str(Path(args.baseline_src).resolve()), [])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    common = ["--model", args.preset, "--context", str(args.decode_context), "--new-tokens",
              str(args.decode_tokens), "--concurrency", str(args.num_requests)]  # fmt: skip
    for _ in range(args.decode_reps):
        for name, (src, extra) in variants.items():
            cmd = [sys.executable, str(here / "decode_worker.py"), "--src", src, *common, *extra]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    rows, summary = [], {}
    ref = None
    for name, rs in runs.items():
        itl = statistics.median(statistics.median(r["itl_ms"]) for r in rs)
        tps = statistics.median(r["concurrent"]["output_tokens_per_s"] for r in rs)
        dtps = statistics.median(r["concurrent"]["decode_tokens_per_s"] for r in rs)
        summary[name] = {"itl_ms": itl, "output_tokens_per_s": tps, "decode_tokens_per_s": dtps}
        ref = ref or summary[name]
        rows.append([name, f"{itl:.2f}", f"{ref['itl_ms'] / itl:.3f}", f"{tps:.1f}",
                     f"{dtps:.1f}", f"{dtps / ref['decode_tokens_per_s']:.3f}"])  # fmt: skip
    table = (
        f"Decode, `{args.preset}` float32, one core each (cpu 0, 1 torch thread), prompts of "
        f"{args.decode_context} tokens, {args.decode_tokens} greedy tokens; medians of "
        f"{args.decode_reps} interleaved runs per variant\n\n"
        + md_table(["variant", "single-stream ITL ms", "ITL: this / variant",
                    f"{args.num_requests}-concurrent output tok/s (incl. prefill)",
                    f"{args.num_requests}-concurrent decode tok/s", "decode tok/s: variant / this"],
                   rows)
    )
    return {"variants": {n: " ".join(v[1]) or "default" for n, v in variants.items()}, "summary": summary,
            "runs": runs}, table  # fmt: skip


def breakdown_section(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Per-part decode step times of this checkout at batch 1 and 16 (profile_step)."""
    from benchmarks import profile_step

    ns = argparse.Namespace(context=args.decode_context, reps=4, block=5, warmup=3,
                            seed=args.seed, torch_profiler=False)  # fmt: skip
    engine = profile_step.make_engine(args.preset, args.seed, 1, 16)
    results = [profile_step.profile_batch(engine, b, ns) for b in (1, 16)]
    return ({"results": results, "summary": [profile_step.summarize(r) for r in results]},
            "Decode step by part (ms, median; this checkout, 1 torch thread)\n\n"
            + profile_step.table(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--ttft-prompt", type=int, default=2048)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check that it runs")
    ap.add_argument("--sections", nargs="+", default=["throughput", "ttft", "decode", "breakdown"],
                    choices=["throughput", "ttft", "decode", "breakdown"])
    ap.add_argument("--baseline-src", default="", help="decode: also run this checkout")
    ap.add_argument("--flex", action="store_true", help="decode: also run --decode-attention flex")
    ap.add_argument("--bf16", action="store_true", help="decode: also run the model in bfloat16")
    ap.add_argument("--decode-reps", type=int, default=3)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    prompt_range, out_range = (128, 1024), (32, 256)
    if args.quick:
        args.num_requests, args.ttft_prompt, args.ttft_reps = 4, 256, 1
        prompt_range, out_range = (16, 64), (4, 16)
        args.decode_reps, args.decode_context, args.decode_tokens = 1, 64, 8
    data: dict[str, Any] = {"preset": args.preset, "sections": args.sections}
    tables: list[str] = []
    if "decode" in args.sections:
        data["decode"], text = decode_section(args)
        tables.append(text)
    if "breakdown" in args.sections:
        data["breakdown"], text = breakdown_section(args)
        tables.append(text)
    if "throughput" in args.sections or "ttft" in args.sections:
        data["throughput_ttft"], text = throughput_and_ttft(args, prompt_range, out_range)
        tables.append(text)
    table = "\n\n".join(tables)
    write_results("bench_engine", data, table)
    print(table)


def throughput_and_ttft(
    args: argparse.Namespace, prompt_range: tuple[int, int], out_range: tuple[int, int]
) -> tuple[dict[str, Any], str]:
    """Sections 1 and 2 (they share one engine and the HF model)."""
    pinned = pin(set(range(args.threads)), args.threads)
    hf, ours = hf_model_and_ours(args.preset, args.seed)
    cfg = EngineConfig(
        model=ModelLoadConfig(model=args.preset, seed=args.seed),
        cache=CacheConfig(block_size=16, kv_cache_mb=2048),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )
    engine = LLMEngine(cfg, loaded=ours)  # type: ignore[arg-type]
    vocab = ours.config.vocab_size  # type: ignore[attr-defined]
    reqs = workload(args.num_requests, args.seed, vocab, prompt_range, out_range)
    warm = workload(2, args.seed + 1, vocab, (16, 32), (4, 8))
    run_ours(engine, warm, "warm")
    run_hf_sequential(hf, warm)
    t_ours, n_ours = run_ours(engine, reqs, "thr")
    t_seq, n_seq = run_hf_sequential(hf, reqs)
    t_bat, n_bat_useful, n_bat_all = run_hf_batched(hf, reqs)

    rng = random.Random(args.seed + 7)
    cold, hit, hit_cached = [], [], []
    for rep in range(args.ttft_reps):
        prompt = [rng.randrange(3, vocab) for _ in range(args.ttft_prompt)]
        c, _ = ttft(engine, prompt, f"cold-{rep}")
        h, cached = ttft(engine, prompt, f"hit-{rep}")
        cold.append(c)
        hit.append(h)
        hit_cached.append(cached)
    engine.check_integrity()

    thr = {
        "kvduplex": n_ours / t_ours,
        "hf_sequential": n_seq / t_seq,
        "hf_batched_useful": n_bat_useful / t_bat,
    }
    rows: list[list[Any]] = [
        ["kvduplex (continuous batching)", f"{t_ours:.1f}", n_ours, f"{thr['kvduplex']:.1f}", "1.00"],
        ["HF generate, sequential", f"{t_seq:.1f}", n_seq, f"{thr['hf_sequential']:.1f}",
         f"{thr['kvduplex'] / thr['hf_sequential']:.2f}"],
        ["HF generate, batched (padded)", f"{t_bat:.1f}", f"{n_bat_useful} useful / {n_bat_all} made",
         f"{thr['hf_batched_useful']:.1f}", f"{thr['kvduplex'] / thr['hf_batched_useful']:.2f}"],
    ]
    table = (
        f"Throughput, {args.num_requests} concurrent requests, prompts {prompt_range}, outputs "
        f"{out_range}, preset {args.preset} float32, {pinned}\n\n"
        + md_table(["engine", "wall s", "output tokens", "tokens/s", "kvduplex speed-up"], rows)
        + f"\n\nTTFT of a {args.ttft_prompt}-token prompt, median of {args.ttft_reps} (interleaved cold/hit)\n\n"
        + md_table(
            ["case", "TTFT ms (median)", "cached tokens", "cold / hit"],
            [
                ["cold (prefix miss)", f"{statistics.median(cold) * 1e3:.1f}", 0, ""],
                ["prefix-cache hit", f"{statistics.median(hit) * 1e3:.1f}", hit_cached[0],
                 f"{statistics.median(cold) / statistics.median(hit):.1f}x"],
            ],
        )
    )
    return {
        "pinned": pinned, "num_requests": args.num_requests,
        "workload": [[len(p), o] for p, o in reqs],
        "throughput_tokens_per_s": thr,
        "wall_s": {"kvduplex": t_ours, "hf_sequential": t_seq, "hf_batched": t_bat},
        "ttft_s": {"cold": cold, "hit": hit, "hit_cached_tokens": hit_cached},
    }, table  # fmt: skip


if __name__ == "__main__":
    main()
