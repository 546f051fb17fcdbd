"""The router alone: relayed SSE chunks per second per core, and the TTFT it adds.

A stub plays the instances (one asyncio HTTP/1.1 server, keep-alive, two ports: P and
D) and answers what the router asks in push mode, as the instances would (the bodies are
built with `kvduplex.common.openai.render`): ``/ready`` and ``/health`` with ``max_model_len``
and an engine id; ``POST /internal/push/prefill`` at once with the first token;
``POST /v1/completions`` on D as a stream of one SSE event per token, each its own HTTP
chunk, the first naming its token id (``mark_first_token``: the router drops it, P's copy
was sent), the last reporting the answer's ids (``report_answer``), then ``[DONE]``.
The router (``kvduplex router``, a process of its own, the built-in ``tiny`` preset's
byte tokenizer) is pinned to one core; the stub and the load client (raw asyncio, one
keep-alive connection per stream) share this process, pinned to the other.

Two phases, each at 1, 64 and 256 concurrent streams (closed loop: a stream sends its
next request when its answer ends):

* capacity: answers of ``--capacity-tokens`` events streamed as fast as the stub can
  (each stream yields to the others after each event, as a decode step would); SSE events
  the client received per second, and per second of the router's CPU time (utime +
  stime of its process, /proc), which is the figure per core;
* TTFT: answers of ``--ttft-tokens`` events paced at ``--tpot-ms``; the client's time to
  the first event through the router against straight to the stub's D (the same request,
  interleaved: direct, router, direct, router), each stream starting after a random pause
  of up to one answer so that requests do not come in bursts. Added TTFT = router p50 -
  direct p50. Two floors, pinned as the router, run the same streams after it, each
  calling P and D as the push router does and piping D's stream back unparsed: the
  stack floor (`StackFloor`: uvicorn and aiohttp, the router's server and its client
  until `wire.py`, with nothing of the router in them), what any relay on this stack
  adds here; and the
  floor relay (`FloorRelay`: raw asyncio), what any Python relay adds here. The CPU
  per request of each is reported beside its TTFT. ``--ladder`` adds the rungs between
  the stack floor and the router: uvicorn with the router's client to the instances
  (`ClientFloor`: `wire.WirePool`), and that inside the router's guards (`app_floor`:
  the body validated as the router's route does, the router's relayed response): what
  each layer
  adds, the router's own work being what is left above the app floor. ``--reference
  sglang vllm`` runs two compiled P/D routers (`REFERENCES`, Rust) beside the router, in
  a venv of their own (``--reference-python``): on P's port the stub answers their
  prefill as a prefill instance does (`Stub.serve_prefill`). ``--timeline`` notes where
  each request's first event spent its time (`timeline.py`): how long each side took to
  get the request to P and to D, and from their answers to the client, against the same
  stages straight to D.

    PYTHONPATH=. python benchmarks/bench_router_capacity.py   # about 3 minutes
    python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install sglang-router vllm-router
    PYTHONPATH=. python benchmarks/bench_router_capacity.py --reference sglang vllm \
        --reference-python /tmp/refvenv/bin/python

Writes results/router_capacity.json and .md. The pieces: `router_stub.py` (the stub),
`router_floors.py` (the floors), `router_load.py` (the load client), `router_procs.py`
(the router's, the floors' and the reference routers' processes), `timeline.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.router_load import Side
from benchmarks.router_load import cpu_seconds
from benchmarks.router_load import run_streams
from benchmarks.router_procs import REFERENCES
from benchmarks.router_procs import REPO
from benchmarks.router_procs import check_references
from benchmarks.router_procs import start_reference
from benchmarks.router_procs import start_relay
from benchmarks.router_procs import start_router
from benchmarks.router_procs import stop_processes
from benchmarks.router_procs import wait_listening
from benchmarks.router_procs import wait_ready
from benchmarks.router_stub import Stub
from benchmarks.timeline import STAGES
from benchmarks.timeline import Timeline
from kvduplex.cluster import free_port


def _p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    router_cpu, load_cpu = args.router_cpu, args.load_cpu
    os.sched_setaffinity(0, {load_cpu})
    stub = Stub()
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    servers = [
        await asyncio.start_server(serve, "127.0.0.1", port, backlog=4096)
        for serve, port in ((stub.serve_prefill, p_port), (stub.serve, d_port))
    ]
    log = Path(args.log)
    rungs = (
        [("app_floor", "--app-floor"), ("client_floor", "--client-floor")] if args.ladder else []
    )
    started: list[subprocess.Popen[bytes]] = []  # stopped at the end, however far it got
    results: dict[str, Any] = {"capacity": [], "ttft": []}
    try:
        proc = start_router(
            r_port, p_port, d_port, router_cpu, log, args.profile_router, Path(args.router_repo)
        )
        started.append(proc)
        relays: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}  # pinned as the router is
        for name, flag in [*rungs, ("stack_floor", "--stack-floor"), ("floor", "--floor-relay")]:
            relays[name] = start_relay(flag, p_port, d_port, router_cpu)
            started.append(relays[name][1])
        others = start_others(args, p_port, d_port, log, started)
        await wait_ready(r_port, proc)
        stub.interval_s = 0.0
        await run_streams(r_port, 8, 32, 2.0)  # warm-up
        for port, other, ready_path in others.values():
            await wait_ready(port, other, path=ready_path)
            await run_streams(port, 8, 32, 2.0)  # warm-up
        for port, relay in relays.values():
            await wait_listening(port, relay)
            await run_streams(port, 8, 32, 1.0)  # warm-up
        for n in args.streams:
            cpu0, t0, own0 = cpu_seconds(proc.pid), time.perf_counter(), time.process_time()
            load = await run_streams(r_port, n, args.capacity_tokens, args.duration_s)
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(proc.pid) - cpu0
            own = time.process_time() - own0
            row = {
                "streams": n, "events": load.num_events, "requests": load.num_requests,
                "errors": load.num_errors,
                "wall_s": wall, "router_cpu_s": cpu, "load_cpu_s": own,
                "events_per_s": load.num_events / wall,
                "events_per_router_cpu_s": load.num_events / cpu if cpu > 0 else float("nan"),
            }  # fmt: skip
            results["capacity"].append(row)
            print(json.dumps(row), flush=True)
        stub.interval_s = args.tpot_ms / 1e3
        timeline = stub.timeline = Timeline() if args.timeline else None
        for n in args.streams:
            direct: list[float] = []
            sides = (
                {"routed": Side(r_port, proc.pid)}
                | {name: Side(port, other.pid) for name, (port, other, _) in others.items()}
                | {name: Side(port, relay.pid) for name, (port, relay) in relays.items()}
            )
            stagger_s = args.ttft_tokens * args.tpot_ms / 1e3  # one answer's length
            for k in range(args.rounds):
                load = await run_streams(
                    d_port, n, args.ttft_tokens, args.ttft_s, stagger_s, timeline,
                    f"direct.{n}.{k}.",
                )  # fmt: skip
                direct += load.ttfts_s
                order = list(sides.items())  # the router, compared ones, the floors
                for name, side in order[::-1] if k % 2 else order:  # reversed every other
                    await side.run(
                        n, args.ttft_tokens, args.ttft_s, stagger_s, timeline, f"{name}.{n}.{k}."
                    )
            row = ttft_row(n, direct, sides, list(others), timeline)
            row["stub_connections"] = stub.num_connections
            results["ttft"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_processes(started)
        for server in servers:
            server.close()
        await stub.close()
    results["setup"] = {
        "router_cpu": router_cpu, "load_cpu": load_cpu, "capacity_tokens": args.capacity_tokens,
        "ttft_tokens": args.ttft_tokens, "tpot_ms": args.tpot_ms, "duration_s": args.duration_s,
        "ttft_s": args.ttft_s, "rounds": args.rounds, "loadavg_before": args.loadavg_before,
        "router_repo": args.router_repo, "loadavg_after": os.getloadavg(),
        "compare": {f"compare_{i}": repo for i, repo in enumerate(args.compare)},
        "reference": [REFERENCES[kind].name for kind in args.reference],
        "timeline": args.timeline,
    }  # fmt: skip
    return results


def ttft_row(
    n: int, direct: list[float], sides: dict[str, Side], others: list[str],
    timeline: Timeline | None,
) -> dict[str, Any]:  # fmt: skip
    """The TTFT phase's figures at `n` streams: each side's added p50 (the router's as
    ``added_p50_ms``) and CPU per request, the errors of the other routers, the stages."""
    routed = sides["routed"]
    row = {
        "streams": n, "num_direct": len(direct), "num_routed": len(routed.ttfts_s),
        "direct_p50_ms": _p50_ms(direct), "direct_p90_ms": _quantile_ms(direct, 0.9),
        "routed_p90_ms": _quantile_ms(routed.ttfts_s, 0.9),
        "router_cpu_share": routed.cpu_s / routed.wall_s,
    }  # fmt: skip
    for name, side in sides.items():
        row[f"{name}_p50_ms"] = _p50_ms(side.ttfts_s)
        row[f"{name}_added_p50_ms"] = _p50_ms(side.ttfts_s) - _p50_ms(direct)
        row[f"{name}_cpu_per_request_ms"] = side.cpu_per_request_ms
    row["added_p50_ms"] = row.pop("routed_added_p50_ms")
    row["routed_errors"] = routed.num_errors
    for name in others:
        row[f"{name}_errors"] = sides[name].num_errors
    if timeline is not None:
        for name in ("direct", *sides):
            for stage, ms in timeline.stages_ms(f"{name}.{n}.").items():
                row[f"{name}_{stage}_ms"] = ms
    return row


def start_others(
    args: argparse.Namespace,
    p_port: int,
    d_port: int,
    log: Path,
    started: list[subprocess.Popen[bytes]],
) -> dict[str, tuple[int, subprocess.Popen[bytes], str]]:
    """The routers that run beside this one in the TTFT phase, pinned as it is, by name:
    other checkouts' (``--compare``: compare_0, ...) and the reference routers
    (``--reference``: sglang_router, vllm_router); their ports, processes (each added to
    `started` as it starts) and the paths that say they are ready."""
    others = {}
    for i, repo in enumerate(args.compare):
        port, other_log = free_port(), log.with_suffix(f".compare{i}.log")
        other = start_router(port, p_port, d_port, args.router_cpu, other_log, "", Path(repo))
        started.append(other)
        others[f"compare_{i}"] = (port, other, "/ready")
    for kind in args.reference:
        ref = REFERENCES[kind]
        port, ref_log = free_port(), log.with_suffix(f".{kind}.log")
        python = args.reference_python
        proc = start_reference(ref, python, port, p_port, d_port, args.router_cpu, ref_log)
        started.append(proc)
        others[ref.name] = (port, proc, ref.ready_path)
    return others


def _quantile_ms(values: list[float], q: float) -> float:
    if len(values) < 2:
        return _p50_ms(values)
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] * 1e3


def table(results: dict[str, Any]) -> str:
    ttft = {r["streams"]: r for r in results["ttft"]}
    lines = [
        "| streams | events/s relayed | router CPU | events/s per router core "
        "| TTFT direct p50 | TTFT via router p50 | added p50: router | stack floor | floor relay "
        "| CPU per request: router | stack floor | floor relay |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["capacity"]:
        t = ttft.get(r["streams"], {})

        def ms(key: str, t: dict[str, Any] = t) -> str:
            return f"{t.get(key, float('nan')):.2f} ms"

        lines.append(
            f"| {r['streams']} | {r['events_per_s']:,.0f} | {r['router_cpu_s'] / r['wall_s']:.0%} "
            f"| {r['events_per_router_cpu_s']:,.0f} | {ms('direct_p50_ms')} | {ms('routed_p50_ms')} "
            f"| {ms('added_p50_ms')} | {ms('stack_floor_added_p50_ms')} "
            f"| {ms('floor_added_p50_ms')} | {ms('routed_cpu_per_request_ms')} "
            f"| {ms('stack_floor_cpu_per_request_ms')} | {ms('floor_cpu_per_request_ms')} |"
        )
    suffix = "_added_p50_ms"
    first = results["ttft"][0] if results["ttft"] else {}
    also = [key.removesuffix(suffix) for key in first if key.endswith(suffix)]
    also = [name for name in also if name not in ("stack_floor", "floor")]
    if also:  # the ladder's rungs, other checkouts' routers, the reference routers
        lines += ["", "| streams | also run | added p50 | CPU per request |", "|---|---|---|---|"]
        for t in results["ttft"]:
            lines += [
                f"| {t['streams']} | {name} | {t[name + suffix]:.2f} ms "
                f"| {t[name + '_cpu_per_request_ms']:.2f} ms |"
                for name in also
            ]
    if results["setup"].get("timeline"):
        lines += ["", timeline_table(results["ttft"])]
    return "\n".join(lines)


def timeline_table(rows: list[dict[str, Any]]) -> str:
    """``--timeline``'s stages (p50, ms) for each side, straight to D first."""
    lines = [
        "| streams | side | to P | P's answer to the client | to D "
        "| D's first event to the client |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        sides = [key.removesuffix("_to_d_ms") for key in row if key.endswith("_to_d_ms")]
        for side in sides:
            cells = " | ".join(f"{row[f'{side}_{stage}_ms']:.2f}" for stage in STAGES)
            lines.append(f"| {row['streams']} | {side} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--capacity-tokens", type=int, default=128)
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument("--ttft-tokens", type=int, default=16)
    parser.add_argument("--tpot-ms", type=float, default=20.0)
    parser.add_argument("--ttft-s", type=float, default=3.0, help="per round and side")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--ladder", action="store_true",
        help="also run the stack floor with the router's client (client floor), and that "
        "inside the router's guards, validating and relaying as it does (app floor): what each layer adds",
    )  # fmt: skip
    parser.add_argument("--router-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--log", default="/tmp/kvduplex-router-capacity.log")
    parser.add_argument("--name", default="router_capacity", help="results/NAME.json and .md")
    parser.add_argument(
        "--router-repo", default=str(REPO), metavar="DIR",
        help="the checkout whose router runs (default: this one), to compare versions",
    )  # fmt: skip
    parser.add_argument(
        "--compare", nargs="+", default=[], metavar="DIR",
        help="also run these checkouts' routers in the TTFT phase, interleaved with this one "
        "round by round (compare_0, compare_1, ... in the results)",
    )  # fmt: skip
    parser.add_argument(
        "--reference", nargs="+", default=[], choices=sorted(REFERENCES),
        help="also run these compiled P/D routers in the TTFT phase, interleaved with this "
        "one (SGLang's and vLLM's, from PyPI: see --reference-python)",
    )  # fmt: skip
    parser.add_argument(
        "--reference-python", default=sys.executable, metavar="PYTHON",
        help="the Python that has the --reference routers installed (a venv of their own)",
    )  # fmt: skip
    parser.add_argument(
        "--timeline", action="store_true",
        help="note where each request's first event spent its time (benchmarks/timeline.py): "
        "to P and D, and from their answers to the client, for each side and straight to D",
    )  # fmt: skip
    parser.add_argument(
        "--profile-router", default="", metavar="FILE",
        help="run the router under cProfile (its event loop's CPU time), the stats written "
        "to FILE (slower: for profiles only)",
    )  # fmt: skip
    args = parser.parse_args()
    args.reference = list(dict.fromkeys(args.reference))  # each once
    check_references(args.reference, args.reference_python)
    args.loadavg_before = os.getloadavg()
    results = asyncio.run(main_async(args))
    from benchmarks.common import write_results

    text = table(results)
    path = write_results(args.name, results, text)
    print(text)
    setup = results["setup"]
    labels = setup["compare"] | {name: name for name in setup["reference"]}
    for row in results["ttft"]:
        for name, label in labels.items():
            print(
                f"{row['streams']} streams: added p50 {row['added_p50_ms']:.2f} ms, CPU a "
                f"request {row['routed_cpu_per_request_ms']:.2f} ms; {label}: "
                f"{row[f'{name}_added_p50_ms']:.2f} ms, "
                f"{row[f'{name}_cpu_per_request_ms']:.2f} ms, {row[f'{name}_errors']} errors"
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
