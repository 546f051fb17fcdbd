"""What an idle instance costs, per role, and whether the next request pays for idling (not a test).

For each source tree (this checkout, and optionally `--baseline-src`, e.g. an
older commit exported with ``git archive``), start a prefill, a decode, a
colocated instance and a push router, send one request through the router
(so P and D have made their handshake and one transfer) and one to the
colocated instance, wait `--settle` seconds, then read each process's CPU time
(utime + stime of /proc/<pid>/stat, all threads) over `--duration` seconds.
Both trees' clusters idle at the same time, so they see the same machine.
Then, A B A B, requests through each router after `--gap` seconds of idling:
client TTFT and end-to-end time of the first request after a pause.

    .venv/bin/python benchmarks/bench_idle.py --baseline-src /tmp/kvd-base

Writes results/bench_idle.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import write_results
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port

TICKS = os.sysconf("SC_CLK_TCK")
ROLES = ("prefill", "decode", "colocated", "router")


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid` (``tid:name`` -> utime + stime)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def start(tree: str, log_dir: Path, model: str) -> tuple[LocalCluster, dict[str, Process]]:
    """P, D, a colocated instance and a push router, all running `tree`'s kvduplex."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": tree}
    cluster = LocalCluster(log_dir=log_dir, env=env)
    # ``python -m`` puts the working directory before PYTHONPATH: start from the tree.
    cwd = os.getcwd()
    os.chdir(tree)
    try:
        return _start(cluster, model)
    finally:
        os.chdir(cwd)


def _start(cluster: LocalCluster, model: str) -> tuple[LocalCluster, dict[str, Process]]:
    serve = ["serve", "--model", model, "--kv-cache-mb", "64", "--log-level", "warning"]
    procs = {
        "prefill": cluster.start("prefill", [*serve, "--role", "prefill"], free_port()),
        "decode": cluster.start("decode", [*serve, "--role", "decode"], free_port()),
        "colocated": cluster.start("colocated", [*serve, "--role", "both"], free_port()),
    }
    cluster.wait_healthy(300)
    router = ["router", "--mode", "push", "--model", model, "--return-mode", "none",
              "--prefill", procs["prefill"].url, "--decode", procs["decode"].url]  # fmt: skip
    procs["router"] = cluster.start("router", router, free_port())
    cluster.wait_healthy(120)
    return cluster, procs


def timed_request(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """Client TTFT and end-to-end seconds of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and ttft is None and json.loads(line[6:])["choices"]:
                ttft = time.perf_counter() - t0
    return ttft or float("nan"), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", default="", help="a second source tree to compare with")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--duration", type=float, default=60.0, help="idle seconds measured")
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before measuring")
    ap.add_argument("--gap", type=float, default=7.0, help="idle seconds before each latency probe")
    ap.add_argument("--probes", type=int, default=10, help="latency probes per tree")
    args = ap.parse_args()
    trees = {"this": str(Path(__file__).resolve().parent.parent)}
    if args.baseline_src:
        trees["baseline"] = str(Path(args.baseline_src).resolve())
    prompt = [(7 * i) % 200 + 3 for i in range(64)]
    clusters: dict[str, tuple[LocalCluster, dict[str, Process]]] = {}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, tree in trees.items():
                clusters[name] = start(tree, Path(tmp) / name, args.model)
            for _, procs in clusters.values():  # the handshake and one transfer
                timed_request(procs["router"].url, args.model, prompt, 4)
                timed_request(procs["colocated"].url, args.model, prompt, 4)
            time.sleep(args.settle)
            before = {n: {r: cpu_seconds(p.popen.pid) for r, p in procs.items()}
                      for n, (_, procs) in clusters.items()}  # fmt: skip
            time.sleep(args.duration)
            for n, (_, procs) in clusters.items():
                results[n] = {"idle": {}, "probes": []}
                for role, proc in procs.items():
                    after = cpu_seconds(proc.popen.pid)
                    per_thread = {t: after[t] - before[n][role].get(t, 0.0) for t in after}
                    results[n]["idle"][role] = {
                        "core_percent": 100 * sum(per_thread.values()) / args.duration,
                        "top_threads_percent": sorted(
                            ((t, 100 * v / args.duration) for t, v in per_thread.items() if v > 0),
                            key=lambda kv: -kv[1],
                        )[:4],
                    }
            for _ in range(args.probes):  # A B A B: after a pause, then at once again
                for n, (_, procs) in clusters.items():
                    time.sleep(args.gap)
                    ttft, e2e = timed_request(procs["router"].url, args.model, prompt, 8)
                    warm_ttft, warm_e2e = timed_request(procs["router"].url, args.model, prompt, 8)
                    results[n]["probes"].append({"ttft_s": ttft, "e2e_s": e2e,
                                                 "warm_ttft_s": warm_ttft, "warm_e2e_s": warm_e2e})
        finally:
            for cluster, _ in clusters.values():
                cluster.stop()
    rows = []
    for n, res in results.items():
        idle, probes = res["idle"], res["probes"]

        def med(key: str, probes: list[dict[str, float]] = probes) -> float:
            return statistics.median(p[key] for p in probes) * 1e3

        penalty = statistics.median(p["e2e_s"] - p["warm_e2e_s"] for p in probes) * 1e3
        rows.append([n, *(f"{idle[r]['core_percent']:.2f}" for r in ROLES),
                     f"{med('ttft_s'):.1f} / {med('warm_ttft_s'):.1f}",
                     f"{med('e2e_s'):.1f} / {med('warm_e2e_s'):.1f}", f"{penalty:+.1f}"])  # fmt: skip
    table = (
        f"Idle CPU over {args.duration:.0f} s after one request (push router, `{args.model}`), "
        f"% of one core; then, A B A B, a request after {args.gap:.0f} s idle and one right after "
        f"it (medians of {args.probes}; penalty: median of the paired e2e differences)\n\n"
        + md_table(["tree", *(f"{r} %" for r in ROLES), "TTFT ms after idle / warm",
                    "e2e ms (8 tokens) after idle / warm", "idle penalty e2e ms"], rows)
    )
    write_results("bench_idle", {"args": vars(args), "trees": trees, "results": results}, table)
    print(table)


if __name__ == "__main__":
    main()
