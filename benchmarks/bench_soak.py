"""Soak benchmark (not a test): minutes of concurrent multi-turn streaming sessions through a
push router with duplex return over one P and one D, and each process's memory over time.

    .venv/bin/python benchmarks/bench_soak.py                  # 10 minutes on tiny
    .venv/bin/python benchmarks/bench_soak.py --quick          # a 45-second smoke run
    .venv/bin/python benchmarks/bench_soak.py --minutes 60 --sessions 32 --model small

Sessions, seeds and checks are those of tests/integration/test_soak.py
(`benchmarks.soak`). The first `--warmup-s` seconds are load like the rest
but are left out of latencies and of memory growth. Afterwards both pools must
be clean (integrity check, no block in use, nothing running). Writes
results/soak-<model>.json (summary, every RSS sample, pool stats), .md and .png
(each process's RSS over time). Exits 1 if a request failed or a pool was not
clean.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS
from benchmarks.common import write_results
from benchmarks.soak import ProcessSampler
from benchmarks.soak import SoakConfig
from benchmarks.soak import SoakSummary
from benchmarks.soak import format_summary
from benchmarks.soak import run_sessions
from benchmarks.soak import summarize
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the run (default 10)")
    ap.add_argument("--warmup-s", type=float, default=60.0, help="seconds left out of the report")
    ap.add_argument("--quick", action="store_true", help="45 s, 15 s warm-up, 8 sessions")
    ap.add_argument("--model", default="tiny", help="preset or local HF folder (default tiny)")
    ap.add_argument("--sessions", type=int, default=16, help="sessions at once (default 16)")
    ap.add_argument("--turns", type=int, default=6, help="turns per session (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--kv-cache-mb", type=int, default=128, help="KV pool of each instance")
    ap.add_argument("--log-dir", default="", help="process logs (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.warmup_s, args.sessions = 0.75, 15.0, 8
    if args.minutes * 60 <= args.warmup_s:
        ap.error("--minutes must be longer than --warmup-s")
    return args


def start(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Process]:
    serve = ["serve", "--model", args.model, "--kv-cache-mb", str(args.kv_cache_mb)]
    p = cluster.start("prefill", [*serve, "--role", "prefill"], free_port())
    d = cluster.start("decode", [*serve, "--role", "decode"], free_port())
    cluster.wait_healthy(timeout_s=300)
    route = ["router", "--model", args.model, "--prefill", p.url, "--decode", d.url]
    router = cluster.start("router", [*route, "--return-mode", "push"], free_port())
    cluster.wait_healthy(timeout_s=60)
    return {"prefill": p, "decode": d, "router": router}


def pool_stats(url: str, settle_s: float = 20.0) -> dict[str, Any]:
    """An instance's pool once no block is in use (or after `settle_s`)."""
    deadline = time.monotonic() + settle_s
    while True:
        st: dict[str, Any] = httpx.get(url + "/internal/kv/stats", timeout=10).json()
        if st["num_in_use"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.2)  # polling a server we do not control


def is_clean(st: dict[str, Any]) -> bool:
    return bool(
        st["integrity_ok"] and st["num_in_use"] == 0 and st["num_running"] == 0
        and st["num_waiting"] == 0
    )  # fmt: skip


def plot(sampler: ProcessSampler, warmup_s: float, title: str, path: Path) -> Path | None:
    """Each process's RSS over time; None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in sampler.pids:
        series = [(t, s[name] / 2**20) for t, s in sampler.samples if name in s]
        ax.plot([t for t, _ in series], [m for _, m in series], label=name)
    ax.axvline(warmup_s, color="grey", linestyle="--", linewidth=1, label="end of warm-up")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(
    args: argparse.Namespace, cfg: SoakConfig, summary: SoakSummary, sampler: ProcessSampler,
    pools: dict[str, dict[str, Any]],
) -> tuple[Path, Path | None]:  # fmt: skip
    name = f"soak-{Path(args.model).name}"
    title = (
        f"soak: {args.model}, 1 P + 1 D + push router with duplex return, "
        f"{cfg.num_sessions} sessions x {cfg.num_turns} turns"
    )
    pool_lines = [
        f"- {role} pool: {'clean' if is_clean(st) else 'NOT clean'} ({st['num_free']} free, "
        f"{st['num_cached']} cached, {st['num_in_use']} in use of {st['total']})"
        for role, st in pools.items()
    ]
    table = "\n".join([f"# {title}", "", format_summary(summary), "", *pool_lines])
    data = {
        "args": vars(args), "config": {**vars(cfg), "max_tokens": list(cfg.max_tokens)},
        "summary": summary.to_dict(), "pools": pools,
        "rss_samples": [{"t_s": round(t, 2), "rss_bytes": s} for t, s in sampler.samples],
    }  # fmt: skip
    path = write_results(name, data, table)
    png = plot(sampler, args.warmup_s, title, RESULTS / f"{name}.png")
    print(table)
    return path, png


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster
    args = parse_args()
    cfg = SoakConfig(num_sessions=args.sessions, num_turns=args.turns, seed=args.seed)
    duration_s = args.minutes * 60
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvduplex-soak-"))
    with LocalCluster(log_dir=log_dir, env={"OMP_NUM_THREADS": "1"}) as cluster:
        procs = start(cluster, args)
        sampler = ProcessSampler({n: p.popen.pid for n, p in procs.items()}, args.sample_s).start()
        try:
            turns = asyncio.run(run_sessions(procs["router"].url, args.model, cfg, duration_s))
        finally:
            sampler.stop()
        pools = {role: pool_stats(procs[role].url) for role in ("prefill", "decode")}
    summary = summarize(turns, sampler, args.warmup_s, duration_s)
    path, png = report(args, cfg, summary, sampler, pools)
    print(
        f"written: {path}, {path.with_suffix('.md')}, {png or 'no plot (pip install matplotlib)'}"
    )
    print(f"process logs: {log_dir}")
    return 0 if summary.num_errors == 0 and all(is_clean(st) for st in pools.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
