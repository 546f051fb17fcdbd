"""Disaggregated serving benchmark: colocated, pull and push side by side in one run.

One colocated instance, one prefill (P) and one decode (D) instance, and two
routers over the same P and D (``--mode pull`` and ``--mode push``). P and the
colocated instance are pinned to the same core (they never run at the same
time: modes are interleaved request round by request round), D to the other;
every engine gets one torch thread. Each cell (prompt length x load) runs its
rounds as A B C A B C ..., after a warm-up request per mode.

Workload: single-turn token-id prompts (seeded, distinct per request, so no
prefix cache hits), greedy, ``--max-tokens`` output tokens; "low" load sends
one request at a time, "queue" sends ``--concurrency`` at once (they queue on
P, which prefills one chunk budget per step). Figures are client-observed
from streaming responses.

At low load the benchmark also reads, around each request, the TTFT histogram
of the instance that computed the prompt (colocated, or P): the request's
engine-side TTFT. Client TTFT minus it is the request's handoff (HTTP, router,
and for pull D's READ and first step), free of the prefill's own run-to-run
noise; a mode's handoff minus colocated's estimates its PD overhead without
that noise (the prefill is the same computation on the same core). For a
load that queues, ``push_p90_over_pull_floor`` is the lowest push/pull TTFT
ratio a queue on P allows given those low-load handoffs (a queue adds the
same wait to both modes); it needs the low load in the same run.

Optionally (``--netns``) P runs in its own network namespace joined to D's by
a veth link shaped with tc to ``--link-gbit`` (two hosts on one machine; UCX
over TCP on the link).

    python -m kvduplex bench --model small
    python -m kvduplex bench --model kv-heavy --netns --link-gbit 10
    python benchmarks/bench_serving.py --quick      # a smoke run on tiny
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
from contextlib import ExitStack
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import ClassVar
from typing import Literal

import httpx
import numpy as np

from kvduplex.bench.client import RequestResult
from kvduplex.bench.client import stream_request
from kvduplex.bench.report import metric_sum
from kvduplex.bench.report import scrape
from kvduplex.bench.tables import cell
from kvduplex.bench.tables import markdown_table
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from kvduplex.common.settings import IntList
from kvduplex.common.settings import ProcessSettings
from kvduplex.common.settings import StrList

MODES = ("colocated", "pull", "push")


@dataclass
class Cell:
    mode: str
    prompt_len: int
    load: str
    results: list[RequestResult] = field(default_factory=list)
    handoff_s: list[float] = field(default_factory=list)
    """Low load: client TTFT minus the computing instance's engine-side TTFT, per request."""

    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def stat(self, what: str, q: float) -> float:
        """The q-th percentile (0-100) of `what` over the successful requests; 0.0 for none."""
        values = [getattr(r, what) for r in self.ok()]
        return float(np.percentile(values, q)) if values else 0.0

    def handoff(self, q: float) -> float | None:
        return float(np.percentile(self.handoff_s, q)) if self.handoff_s else None


class ServingBenchSettings(ProcessSettings):
    """Single-turn serving benchmark: colocated, pull and push side by side on local
    instances (TTFT, TPOT, the PD handoff)."""

    command: ClassVar[str] = "bench"
    reads_environment: ClassVar[bool] = False

    workload: Literal["serving"] = "serving"
    """serving (single-turn) or agentic (multi-turn sessions); each takes its own flags:
    kvduplex bench --workload agentic --help."""
    model: str = "small"
    """Preset (small, kv-heavy, tiny, long)."""
    prompt_lens: IntList = (512, 2048)
    """Prompt lengths, in tokens."""
    max_tokens: int = 64
    """Output tokens per request."""
    rounds: int = 3
    """Low load: requests per (mode, prompt length). Queue load: bursts."""
    queue_rounds: int = 1
    """Bursts per mode."""
    concurrency: int = 4
    """Requests per burst."""
    loads: StrList = ("low", "queue")
    """low, queue."""
    modes: StrList = MODES
    """colocated, pull, push."""
    kv_cache_mb: int = 2048
    """KV pool per instance, in MiB."""
    netns: bool = False
    """P in a network namespace over veth."""
    link_gbit: float = 10.0
    """tc rate of the veth."""
    seed: int = 0
    """Seed of the prompts."""
    log_dir: str = ""
    """Process logs (empty: a temp dir)."""
    quick: bool = False
    """A smoke run on tiny."""
    out: str = ""
    """Write JSON here (empty: print only)."""
    log_level: str = "warning"
    """Python log level."""

    def options(self) -> ServingBenchSettings:
        """What runs: the modes in their order, ``--quick``'s overrides applied."""
        update: dict[str, Any] = {"modes": tuple(m for m in MODES if m in self.modes)}
        if self.quick:
            update.update(model="tiny", prompt_lens=(64, 256), max_tokens=8, rounds=2,
                          concurrency=3, kv_cache_mb=256)  # fmt: skip
        return self.model_copy(update=update)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(n)]


async def _burst(
    client: httpx.AsyncClient, url: str, model: str, prompts: list[list[int]], max_tokens: int
) -> list[RequestResult]:
    bodies = [
        {
            "model": model,
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        for p in prompts
    ]
    return list(
        await asyncio.gather(*(stream_request(client, url, "/v1/completions", b) for b in bodies))
    )


_TTFT = "kvduplex_time_to_first_token_seconds"


async def _engine_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of an instance's engine-side TTFT histogram."""
    samples = await asyncio.to_thread(scrape, url)
    return metric_sum(samples, _TTFT + "_sum"), metric_sum(samples, _TTFT + "_count")


def _start(
    cluster: LocalCluster, opts: ServingBenchSettings, stack: ExitStack
) -> tuple[dict[str, str], str, str, str]:
    """Start the instances and routers; returns (front door per mode, P, D, how pinned)."""
    serve = [
        "serve",
        "--model",
        opts.model,
        "--num-threads",
        "1",
        "--kv-cache-mb",
        str(opts.kv_cache_mb),
    ]
    serve += ["--log-level", "warning", "--kv-wait-timeout-s", "120", "--transfer-timeout-s", "120"]
    serve += ["--pull-lease-s", "300"]
    cpus = sorted(os.sched_getaffinity(0))
    p_cpu, d_cpu = [cpus[0]], [cpus[-1]]
    p_host = d_host = "127.0.0.1"
    p_env: dict[str, str] = {}
    d_env: dict[str, str] = {}
    netns = None
    if opts.netns:
        from kvduplex.bench.netns import NetnsHost
        from kvduplex.bench.netns import netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"--netns: {reason}")
        host = stack.enter_context(NetnsHost(rate_mbit=int(opts.link_gbit * 1000)))
        netns = host
        p_host, d_host = host.inner.ip, host.outer.ip
        p_env, d_env = host.inner.ucx_env(), host.outer.ucx_env()
    fronts: dict[str, str] = {}
    if "colocated" in opts.modes:
        c = cluster.start("colocated", [*serve, "--role", "both"], free_port(), cpus=p_cpu)
        fronts["colocated"] = c.url
    p = cluster.start(
        "prefill", [*serve, "--role", "prefill"], free_port(), cpus=p_cpu, host=p_host,
        env=p_env, netns=netns.inner.netns if netns is not None else None,
    )  # fmt: skip
    d = cluster.start(
        "decode", [*serve, "--role", "decode"], free_port(), cpus=d_cpu, host=d_host, env=d_env
    )
    cluster.wait_healthy(timeout_s=600)
    for mode in ("pull", "push"):
        if mode in opts.modes:
            # Single-turn requests: no next turn would hit a return.
            args = ["router", "--mode", mode, "--model", opts.model, "--return-mode", "none",
                    "--prefill", p.url, "--decode", d.url]  # fmt: skip
            fronts[mode] = cluster.start(f"router-{mode}", args, free_port()).url
    cluster.wait_healthy(timeout_s=120)
    link = (
        f"; P in netns over veth shaped to {opts.link_gbit:g} Gbit/s (UCX tcp)"
        if opts.netns
        else ""
    )
    pinned = (
        f"colocated and P on cpu {p_cpu[0]}, D on cpu {d_cpu[0]}, 1 torch thread each; "
        f"routers and client unpinned{link}"
    )
    return fronts, p.url, d.url, pinned


async def _run(
    opts: ServingBenchSettings, fronts: dict[str, str], computes: dict[str, str]
) -> list[Cell]:
    """`computes[mode]`: the instance that computes that mode's prompts (colocated, or P)."""
    rng = random.Random(opts.seed)
    cells: dict[tuple[str, int, str], Cell] = {}
    timeout = httpx.Timeout(1800.0, connect=10.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for mode, url in fronts.items():  # warm-up: handshakes, lazy init
            for r in await _burst(client, url, opts.model, [_prompt(rng, 64)], 4):
                if not r.ok:
                    raise RuntimeError(f"warm-up on {mode} failed: {r.error}")
        for load in opts.loads:
            n_per = 1 if load == "low" else opts.concurrency
            rounds = opts.rounds if load == "low" else opts.queue_rounds
            for prompt_len in opts.prompt_lens:
                for rnd in range(rounds):
                    order = list(fronts)
                    order = order[rnd % len(order) :] + order[: rnd % len(order)]
                    for mode in order:
                        prompts = [_prompt(rng, prompt_len) for _ in range(n_per)]
                        if load == "low":
                            sum0, n0 = await _engine_ttft(computes[mode])
                        got = await _burst(
                            client, fronts[mode], opts.model, prompts, opts.max_tokens
                        )
                        cell = cells.setdefault(
                            (mode, prompt_len, load), Cell(mode, prompt_len, load)
                        )
                        cell.results.extend(got)
                        if load == "low":
                            sum1, n1 = await _engine_ttft(computes[mode])
                            if n1 - n0 == 1 and got[0].ok:
                                cell.handoff_s.append(got[0].ttft_s - (sum1 - sum0))
                        print(
                            f"  {load:5} {prompt_len:5} {mode:9} round {rnd}: TTFT "
                            + " ".join(f"{r.ttft_s * 1e3:.0f}" if r.ok else "ERR" for r in got)
                            + " ms",
                            flush=True,
                        )
    return list(cells.values())


def summarize(cells: list[Cell]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-cell rows and per-(prompt length, load) ratios between modes."""
    rows = []
    by_key = {(c.mode, c.prompt_len, c.load): c for c in cells}
    for c in sorted(cells, key=lambda c: (c.load, c.prompt_len, MODES.index(c.mode))):
        colo = by_key.get(("colocated", c.prompt_len, c.load))
        rows.append({
            "mode": c.mode, "prompt_len": c.prompt_len, "load": c.load, "n": len(c.ok()),
            "errors": len(c.results) - len(c.ok()),
            "ttft_p50_ms": c.stat("ttft_s", 50) * 1e3, "ttft_p90_ms": c.stat("ttft_s", 90) * 1e3,
            "tpot_p50_ms": c.stat("tpot_s", 50) * 1e3, "tpot_p90_ms": c.stat("tpot_s", 90) * 1e3,
            "e2e_p50_ms": c.stat("e2e_s", 50) * 1e3, "e2e_p90_ms": c.stat("e2e_s", 90) * 1e3,
            "pd_overhead_ms": (c.stat("ttft_s", 50) - colo.stat("ttft_s", 50)) * 1e3
            if colo is not None else None,
            "handoff_p50_ms": _ms(c.handoff(50)),
            "pd_overhead_engine_ms": _ms(_sub(c.handoff(50), colo.handoff(50) if colo else None)),
        })  # fmt: skip
    ratios = []
    for load, plen in sorted({(c.load, c.prompt_len) for c in cells}):
        colo, pull, push = (by_key.get((m, plen, load)) for m in MODES)
        entry: dict[str, Any] = {"load": load, "prompt_len": plen}
        if push is not None and colo is not None:
            entry["push_ttft_over_colocated"] = _div(
                push.stat("ttft_s", 50), colo.stat("ttft_s", 50)
            )
        if push is not None and pull is not None:
            entry["push_p90_ttft_over_pull"] = _div(
                push.stat("ttft_s", 90), pull.stat("ttft_s", 90)
            )
        if push is not None and pull is not None and colo is not None:
            base = colo.stat("ttft_s", 50)
            entry["push_overhead_over_pull"] = _div(
                push.stat("ttft_s", 50) - base, pull.stat("ttft_s", 50) - base
            )
            colo_h = colo.handoff(50)
            push_h, pull_h = _sub(push.handoff(50), colo_h), _sub(pull.handoff(50), colo_h)
            if push_h is not None and pull_h is not None:
                entry["push_overhead_over_pull_engine"] = _div(push_h, pull_h)
        if load != "low":
            floor = _queue_floor(*(by_key.get((m, plen, "low")) for m in MODES))
            if floor is not None:
                entry["push_p90_over_pull_floor"] = floor
        ratios.append(entry)
    return rows, ratios


def _queue_floor(colo: Cell | None, pull: Cell | None, push: Cell | None) -> float | None:
    """The lowest push/pull TTFT ratio a queue on P allows, from low-load handoffs.

    A queue on P adds the same wait W to both modes, and the modes differ only
    in their handoffs h: (W + T + h_push) / (W + T + h_pull) is at least
    (T + h_push) / (T + h_pull), with T the prefill's engine-side TTFT
    (colocated's client TTFT minus its handoff).
    """
    if colo is None or pull is None or push is None:
        return None
    colo_h, pull_h, push_h = colo.handoff(50), pull.handoff(50), push.handoff(50)
    if colo_h is None or pull_h is None or push_h is None:
        return None
    prefill = colo.stat("ttft_s", 50) - colo_h
    return _div(prefill + push_h, prefill + pull_h)


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def format_tables(
    rows: list[dict[str, Any]], ratios: list[dict[str, Any]], kv: dict[str, Any]
) -> str:
    cols = ["mode", "prompt_len", "load", "n", "ttft_p50_ms", "ttft_p90_ms", "pd_overhead_ms",
            "handoff_p50_ms", "pd_overhead_engine_ms", "tpot_p50_ms", "tpot_p90_ms", "e2e_p50_ms",
            "e2e_p90_ms"]  # fmt: skip
    lines = markdown_table(cols, [[r[c] for c in cols] for r in rows])
    rcols = ["load", "prompt_len", "push_ttft_over_colocated", "push_overhead_over_pull",
             "push_overhead_over_pull_engine", "push_p90_ttft_over_pull",
             "push_p90_over_pull_floor"]  # fmt: skip
    lines += ["", *markdown_table(rcols, [[r.get(c) for c in rcols] for r in ratios])]
    lines += ["", "KV moved: " + ", ".join(f"{k} {cell(v)}" for k, v in kv.items())]
    return "\n".join(lines)


def _kv_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def delta(side: str, name: str, **labels: str) -> float:
        return metric_sum(after[side], name, **labels) - metric_sum(before[side], name, **labels)

    transfer = delta("p", "kvduplex_kv_push_transfer_seconds_total")
    exposed = delta("p", "kvduplex_kv_push_exposed_seconds_total")
    return {
        "push_written_MiB": delta("p", "kvduplex_kv_transfer_bytes_total", direction="write")
        / 2**20,
        "pull_read_MiB": delta("d", "kvduplex_kv_transfer_bytes_total", direction="read") / 2**20,
        "pushes_done": delta("p", "kvduplex_kv_pushes_total", outcome="done"),
        "push_transfer_s": transfer,
        "push_exposed_s": exposed,
        "push_hidden_share": 1 - exposed / transfer if transfer > 0 else None,
        "fallbacks": delta("d", "kvduplex_kv_fallbacks_total"),
    }


def run(opts: ServingBenchSettings) -> dict[str, Any]:
    log_dir = Path(opts.log_dir or tempfile.mkdtemp(prefix="kvduplex-bench-"))
    with ExitStack() as stack:
        cluster = stack.enter_context(LocalCluster(log_dir=log_dir, env={"OMP_NUM_THREADS": "1"}))
        fronts, p_url, d_url, pinned = _start(cluster, opts, stack)
        print(f"modes {list(fronts)}; {pinned}; logs in {log_dir}", flush=True)
        before = {"p": scrape(p_url), "d": scrape(d_url)}
        computes = {m: (fronts["colocated"] if m == "colocated" else p_url) for m in fronts}
        cells = asyncio.run(_run(opts, fronts, computes))
        after = {"p": scrape(p_url), "d": scrape(d_url)}
    rows, ratios = summarize(cells)
    kv = _kv_figures(before, after)
    table = format_tables(rows, ratios, kv)
    return {
        "options": opts.model_dump(mode="json"), "pinned": pinned, "rows": rows, "ratios": ratios, "kv": kv,
        "table": table,
        "raw": [
            {"mode": c.mode, "prompt_len": c.prompt_len, "load": c.load,
             "results": [{k: v for k, v in asdict(r).items() if k not in ("text", "token_ids")}
                         for r in c.results], "handoff_s": c.handoff_s}
            for c in cells
        ],
    }  # fmt: skip


def main(args: ServingBenchSettings) -> dict[str, Any]:
    """Run the benchmark the settings describe; print its tables, write JSON to ``--out``."""
    result = run(args.options())
    print(result["table"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result
