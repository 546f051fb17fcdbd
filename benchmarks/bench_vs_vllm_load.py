"""Concurrent decode: kvduplex against vLLM's CPU build, same model, same core (not a test).

Both servers load the same Llama-shaped Hugging Face folder (`llama_folder.py`, random
weights, float32), stay resident, and are pinned to `--core` with one thread each, as in
`bench_vs_vllm.py` (whose server start-up this reuses). vLLM gets ``--max-num-seqs`` as
large as the largest burst, the same token budget per step as kvduplex (2,048) and its
prefix cache on (kvduplex's is on by default).

A cell is (context C, streams B). Its burst: B fresh random token-id prompts of C tokens
(seeded; distinct, so no burst shares KV with another), first prefilled by one
``max_tokens=1`` request each (their KV stays in each server's prefix cache), then all B
streamed together with ``--max-tokens`` greedy tokens and ``ignore_eos``. The burst's
prompts are then a prefix-cache hit but for their last block, so the burst measures B
decodes at once, not B prefills (``--cold`` skips the pre-fill: the streams' TPOT then
includes the prefills interleaved with the decodes).

Per burst, at the client (this process, on `--client-core`):

* TPOT of each stream: (last token - first token) / (tokens - 1);
* decode tok/s: tokens that arrived while all B streams were decoding (after the last
  stream's first token, up to the first stream's last token) over that window;
* the servers' share of the core and what other processes took meanwhile.

Rounds interleave systems, contexts and stream counts (the system order reverses every
burst), after a warm-up burst per (system, context), each burst followed by `--settle-s`
of quiet (vLLM keeps its core busy for ~2 s after a request).

    .venv/bin/python benchmarks/bench_vs_vllm_load.py --vllm-bin /work/vllm-venv/bin/vllm
    .venv/bin/python benchmarks/bench_vs_vllm_load.py --vllm-bin /work/vllm-venv/bin/vllm --quick

Writes results/vs-vllm-load[-<tag>].json (every token's arrival time per stream, CPU
figures, versions, pinning) and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_vs_vllm import SERVED_NAME
from benchmarks.bench_vs_vllm import core_busy_s
from benchmarks.bench_vs_vllm import start_kvduplex
from benchmarks.bench_vs_vllm import start_vllm
from benchmarks.bench_vs_vllm import tree_cpu_s
from benchmarks.bench_vs_vllm import tree_pids
from benchmarks.bench_vs_vllm import versions
from benchmarks.bench_vs_vllm import vllm_preload
from benchmarks.common import RESULTS
from benchmarks.common import md_table
from benchmarks.common import write_results
from benchmarks.llama_folder import LLAMA_50M
from benchmarks.llama_folder import build_llama_folder
from kvduplex.bench.client import percentile
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process

KVDUPLEX, VLLM = "kvduplex", "vllm"
MAX_NUM_BATCHED_TOKENS = 2048
"""kvduplex's default token budget per step; vLLM gets the same."""


@dataclass
class StreamTimes:
    """One streamed request: when it was sent and when each token-carrying chunk arrived."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    """Tokens each chunk carried."""
    error: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens)

    def tpot_s(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (self.num_tokens - 1)

    def gaps_s(self) -> list[float]:
        """Per-token gaps after the first chunk (a chunk of n tokens: n gaps of 1/n)."""
        out: list[float] = []
        for t0, t1, n in zip(self.arrivals, self.arrivals[1:], self.tokens[1:], strict=False):
            out += [(t1 - t0) / n] * n
        return out


@dataclass
class Burst:
    """B streams of one system started together."""

    system: str
    context: int
    num_streams: int
    round: int
    streams: list[StreamTimes]
    server_cpu_s: float = 0.0
    """CPU seconds the system's process tree used during the burst."""
    other_cpu_s: float = 0.0
    """CPU seconds the other system's process tree used meanwhile."""
    foreign_share: float = 0.0
    """Share of the core other processes (neither server) took meanwhile."""
    wall_s: float = 0.0

    def ok(self) -> bool:
        return all(not s.error and s.num_tokens > 0 for s in self.streams)

    def decode_window(self) -> tuple[float, float, int] | None:
        """(start, end, tokens) while every stream decoded: after the last first token,
        up to the first last token; None when no stream was still decoding by then."""
        start = max(s.arrivals[0] for s in self.streams)
        end = min(s.arrivals[-1] for s in self.streams)
        if end <= start:
            return None
        tokens = sum(
            n
            for s in self.streams
            for t, n in zip(s.arrivals, s.tokens, strict=True)
            if start < t <= end
        )
        return start, end, tokens

    def decode_tok_s(self) -> float | None:
        window = self.decode_window()
        return None if window is None else window[2] / (window[1] - window[0])


async def stream_times(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> StreamTimes:
    """Stream one greedy completion of `prompt`, timestamping every token-carrying chunk."""
    body = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    out = StreamTimes(sent=time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                out.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                msg = json.loads(line[5:])
                if "error" in msg:
                    out.error = str(msg["error"])
                    return out
                for choice in msg.get("choices", []):
                    n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                    if n:
                        out.arrivals.append(time.perf_counter())
                        out.tokens.append(n)
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    return out


async def prefill(client: httpx.AsyncClient, url: str, prompts: list[list[int]]) -> None:
    """One ``max_tokens=1`` request per prompt, together: their KV stays in the prefix cache."""
    got = await asyncio.gather(*(stream_times(client, url, p, 1) for p in prompts))
    errors = [s.error for s in got if s.error]
    if errors:
        raise RuntimeError(f"pre-fill at {url} failed: {errors[0]}")


async def run_burst(
    client: httpx.AsyncClient,
    servers: dict[str, Process],
    name: str,
    prompts: list[list[int]],
    rnd: int,
    args: argparse.Namespace,
) -> Burst:
    url = servers[name].url
    if not args.cold:
        await prefill(client, url, prompts)
    own = servers[name].popen.pid
    others = [p.popen.pid for n, p in servers.items() if n != name]
    own0, others0 = tree_cpu_s(own), sum(map(tree_cpu_s, others))
    core0, t0 = core_busy_s(args.core), time.perf_counter()
    streams = await asyncio.gather(
        *(stream_times(client, url, p, args.max_tokens) for p in prompts)
    )
    wall, core_s = time.perf_counter() - t0, core_busy_s(args.core) - core0
    burst = Burst(name, len(prompts[0]), len(prompts), rnd, list(streams), wall_s=wall)
    burst.server_cpu_s = tree_cpu_s(own) - own0
    burst.other_cpu_s = sum(map(tree_cpu_s, others)) - others0
    burst.foreign_share = max(0.0, core_s - burst.server_cpu_s - burst.other_cpu_s) / wall
    return burst


def random_prompts(rng: random.Random, num: int, length: int) -> list[list[int]]:
    vocab = int(LLAMA_50M["vocab_size"])
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


async def measure(args: argparse.Namespace, servers: dict[str, Process]) -> list[Burst]:
    """Warm-up bursts, then rounds of one burst per (context, streams, system), interleaved."""
    rng = random.Random(args.seed)
    names = list(servers)
    bursts: list[Burst] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(1800.0, connect=10.0), limits=limits
    ) as client:
        for ctx in args.contexts:
            for name in names:
                prompts = random_prompts(rng, min(args.streams[-1], 2), ctx)
                warm = await run_burst(client, servers, name, prompts, -1, args)
                if not warm.ok():
                    raise RuntimeError(
                        f"warm-up on {name} failed: {[s.error for s in warm.streams]}"
                    )
                await asyncio.sleep(args.settle_s)
        order = 0
        for rnd in range(args.rounds):
            for ctx in args.contexts:
                for num in args.streams:
                    for name in names if order % 2 == 0 else names[::-1]:
                        burst = await run_burst(
                            client, servers, name, random_prompts(rng, num, ctx), rnd, args
                        )
                        bursts.append(burst)
                        tpots = [t for s in burst.streams if (t := s.tpot_s()) is not None]
                        rate = burst.decode_tok_s()
                        print(f"round {rnd} ctx {ctx} streams {num} {name}: TPOT p50 "
                              f"{percentile(tpots, 50) * 1e3:.1f} ms, decode "
                              f"{'-' if rate is None else f'{rate:.1f}'} tok/s, foreign load "
                              f"{burst.foreign_share:.0%}"
                              f"{'' if burst.ok() else ' ERRORS ' + str([s.error for s in burst.streams][:2])}",
                              flush=True)  # fmt: skip
                        await asyncio.sleep(args.settle_s)
                    order += 1
    return bursts


def cell_summary(bursts: list[Burst]) -> dict[str, Any]:
    """One (system, context, streams): TPOT over all its streams, decode tok/s over its bursts."""
    streams = [s for b in bursts for s in b.streams]
    tpot_ms = [t * 1e3 for s in streams if (t := s.tpot_s()) is not None]
    gaps_ms = [g * 1e3 for s in streams for g in s.gaps_s()]
    rates = [r for b in bursts if (r := b.decode_tok_s()) is not None]
    ttft_ms = [(s.arrivals[0] - s.sent) * 1e3 for s in streams if s.arrivals]
    return {
        "bursts": len(bursts), "failed_bursts": sum(not b.ok() for b in bursts),
        "streams": len(streams), "tpot_p50_ms": percentile(tpot_ms, 50),
        "tpot_p90_ms": percentile(tpot_ms, 90), "itl_p50_ms": percentile(gaps_ms, 50),
        "itl_p90_ms": percentile(gaps_ms, 90),
        "decode_tok_s_median": statistics.median(rates) if rates else None,
        "bursts_without_window": len(bursts) - len(rates),
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "server_cpu_s_per_token": sum(b.server_cpu_s for b in bursts) / max(sum(s.num_tokens for s in streams), 1),
        "foreign_share_p50": percentile([b.foreign_share for b in bursts], 50),
        "foreign_share_max": max((b.foreign_share for b in bursts), default=0.0),
        "other_server_cpu_s": sum(b.other_cpu_s for b in bursts),
    }  # fmt: skip


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(bursts: list[Burst], args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Per (context, streams): both systems side by side and kvduplex's ratio to vLLM."""
    summary: dict[str, Any] = {}
    rows = []
    systems = list(dict.fromkeys(b.system for b in bursts))
    for ctx in args.contexts:
        for num in args.streams:
            cell = {
                s: cell_summary(
                    [b for b in bursts if (b.system, b.context, b.num_streams) == (s, ctx, num)]
                )
                for s in systems
            }
            summary[f"{ctx}x{num}"] = cell
            ours, theirs = cell[KVDUPLEX], cell.get(VLLM)
            row = [
                ctx,
                num,
                _fmt(ours["tpot_p50_ms"], ".1f"),
                _fmt(ours["decode_tok_s_median"], ".1f"),
            ]
            if theirs is not None:
                row += [_fmt(theirs["tpot_p50_ms"], ".1f"), _fmt(theirs["decode_tok_s_median"], ".1f"),
                        f"**{_fmt(_ratio(ours['tpot_p50_ms'], theirs['tpot_p50_ms']), '.2f')}**",
                        f"**{_fmt(_ratio(ours['decode_tok_s_median'], theirs['decode_tok_s_median']), '.2f')}**",
                        f"{ours['server_cpu_s_per_token'] * 1e3:.1f} / {theirs['server_cpu_s_per_token'] * 1e3:.1f}",
                        f"{_fmt(ours['ttft_p50_ms'], '.0f')} / {_fmt(theirs['ttft_p50_ms'], '.0f')}"]  # fmt: skip
            row += [
                " / ".join(f"{cell[s]['foreign_share_p50']:.0%}" for s in systems),
                " / ".join(f"{cell[s]['other_server_cpu_s']:.2f}" for s in systems),
                " / ".join(
                    f"{cell[s]['bursts'] - cell[s]['failed_bursts']}/{cell[s]['bursts']}"
                    for s in systems
                ),
            ]
            rows.append(row)
    header = ["context", "streams", "kvduplex TPOT p50 ms", "kvduplex decode tok/s"]
    if VLLM in systems:
        header += ["vLLM TPOT p50 ms", "vLLM decode tok/s", "TPOT kvduplex / vLLM",
                   "decode tok/s kvduplex / vLLM", "server CPU ms/token kvduplex / vLLM",
                   "TTFT p50 ms kvduplex / vLLM"]  # fmt: skip
    header += ["foreign load p50 (" + " / ".join(systems) + ")",
               "other server's CPU s during the cell's bursts", "bursts ok"]  # fmt: skip
    prefilled = (
        "prompts pre-filled (prefix-cache hits but the last block)"
        if not args.cold
        else "cold prompts"
    )
    table = (
        f"Concurrent decode, `{SERVED_NAME}` HF folder (random weights), float32; every server "
        f"process pinned to cpu {args.core}, {args.threads} thread; client on cpu {args.client_core}; "
        f"B streams started together, random token-id prompts ({prefilled}), {args.max_tokens} "
        f"greedy tokens (ignore_eos); {args.rounds} burst(s) per cell, systems interleaved, "
        f"{args.settle_s} s apart. TPOT p50 over all streams of the cell; decode tok/s: tokens "
        "while all B streams decoded over that window, median over bursts (TPOT ratio < 1 and "
        "tok/s ratio > 1: kvduplex faster)\n\n" + md_table(header, rows)
    )
    return summary, table


def start(
    cluster: LocalCluster, folder: Path, args: argparse.Namespace, data: dict[str, Any]
) -> dict[str, Process]:
    """kvduplex, then vLLM (if `--vllm-bin`); a vLLM that fails to start is recorded, not fatal."""
    servers = {KVDUPLEX: start_kvduplex(cluster, folder, args)}
    cluster.wait_healthy(args.start_timeout)
    if not args.vllm_bin:
        return servers
    preload = vllm_preload(args)
    data["vllm_env"] = {"LD_PRELOAD": preload, "OMP_NUM_THREADS": str(args.threads),
                        "VLLM_CPU_OMP_THREADS_BIND": str(args.core),
                        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}  # fmt: skip
    extra = ("--enable-prefix-caching", "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS))
    max_len = max(args.contexts) + args.max_tokens + 64
    servers[VLLM] = start_vllm(cluster, VLLM, folder, args, preload, max_num_seqs=max(args.streams),
                               max_model_len=max(4096, max_len), extra=extra)  # fmt: skip
    try:
        cluster.wait_healthy(args.start_timeout)
    except RuntimeError as exc:
        print(f"vllm did not start (log {servers[VLLM].log_path}):\n{exc}", flush=True)
        data["vllm_start_error"] = str(exc)[-4000:]
        cluster.stop_process(servers.pop(VLLM))
    return servers


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
        "--model-dir", default=str(RESULTS / "llama-50m"), help="HF folder, built if absent"
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument(
        "--streams", type=int, nargs="+", default=[1, 4, 8, 16], help="streams per burst"
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="bursts per (system, context, streams)")
    ap.add_argument(
        "--cold", action="store_true", help="no pre-fill: bursts prefill their prompts too"
    )
    ap.add_argument("--settle-s", type=float, default=2.5, help="quiet after each burst")
    ap.add_argument("--core", type=int, default=1, help="the core both servers are pinned to")
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--kvduplex-kv-mb", type=int, default=1536, help="kvduplex's KV pool")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="results/vs-vllm-load-<tag>.json")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 256 tokens, 1 and 4 streams, 8 tokens, 1 round",
    )
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.streams, args.max_tokens, args.rounds = [256], [1, 4], 8, 1
        args.vllm_kv_gib, args.kvduplex_kv_mb = 1, 256
    args.streams = sorted(args.streams)
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    args = parse_args()
    os.sched_setaffinity(0, {args.client_core})
    folder = Path(args.model_dir)
    if not (folder / "config.json").exists():
        build_llama_folder(folder, args.seed)
    if args.vllm_bin and not Path(args.vllm_bin).exists():
        sys.exit(f"--vllm-bin {args.vllm_bin} does not exist")
    log_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-load-"))
    data: dict[str, Any] = {"args": vars(args), "log_dir": str(log_dir), "model": LLAMA_50M}
    with LocalCluster(log_dir=log_dir) as cluster:
        servers = start(cluster, folder, args, data)
        print(f"servers {list(servers)} on cpu {args.core}; logs in {log_dir}", flush=True)
        bursts = asyncio.run(measure(args, servers))
        data["pinning"] = {n: {pid: sorted(os.sched_getaffinity(pid)) for pid in tree_pids(p.popen.pid)}
                           for n, p in servers.items()} | {"client": sorted(os.sched_getaffinity(0))}  # fmt: skip
        data["versions"] = versions(args, servers)
    data["summary"], table = summarize(bursts, args)
    data["bursts"] = [asdict(b) for b in bursts]
    if "vllm_start_error" in data:
        table += f"\n\nvLLM did not start:\n\n```\n{data['vllm_start_error'][-1500:]}\n```"
    elif not args.vllm_bin:
        table += "\n\nvLLM not measured: no --vllm-bin."
    table += f"\n\nVersions: {data['versions']}; vLLM env: {data.get('vllm_env')}"
    name = "vs-vllm-load" + (f"-{args.tag}" if args.tag else "") + ("-quick" if args.quick else "")
    path = write_results(name, data, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
