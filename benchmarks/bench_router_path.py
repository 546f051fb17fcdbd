"""The router's own path for one request, warm and with the CPU's caches cold.

`bench_router_capacity.py` measures what the router adds to a client's TTFT under load,
a figure that moves by a quarter from run to run here: too much to tell a change of a
tenth from noise. This measures the path alone, in one process: the router's app
(`create_router_app`, its middlewares and flows, the built-in ``tiny`` preset) called as
an ASGI app, with no HTTP server or client in front of it, one streamed push request at
a time, against the capacity benchmark's stub (`router_stub.Stub`, a process of its own
pinned to the other core; this one is pinned to ``--cpu``). For each request: the time
from the app's call to P's call written, to D's call written, and to the first part
(P's token) sent; the p50 over ``--requests`` requests,

* warm: back to back;
* cold: after walking ``--evict-mb`` MB of Python objects, which leaves little of the
  path in the CPU's caches, as under load, when the other streams' events run between
  a request's steps;

and the router's CPU a request (this process's, user and system) over ``--paced``
requests whose D sends its events ``--pace-ms`` apart, each a part of its own, as under
the capacity benchmark's paced load: the request's path and its 16 events, each a wake
of the event loop.

Under load the path runs between those two: how much each change saves of it, cold and
warm, is what it saves of the router's share of a TTFT. ``--compare DIR ...`` runs
other checkouts' routers too, interleaved round by round (each in a process of its
own, its checkout first on the path).

    PYTHONPATH=. python benchmarks/bench_router_path.py                 # about a minute
    PYTHONPATH=. python benchmarks/bench_router_path.py --compare /tmp/kvd-base

Writes results/router_path.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.router_procs import REPO

SCRIPT = str(Path(__file__).resolve())
STAGES = ("p_sent", "d_sent", "first_part")
"""The times noted for each request, from the app's call."""
CPU = "cpu_per_request"
"""The paced phase's figure (us)."""
_BODY = json.dumps(
    {"model": "tiny", "prompt": "hello router", "max_tokens": 16, "stream": True,
     "temperature": 0}
).encode()  # fmt: skip
"""What the capacity benchmark's load client sends (`router_load.run_streams`)."""


async def _serve_stub(p_port: int, d_port: int, paced_port: int, pace_ms: float) -> None:
    from benchmarks.router_stub import Stub

    stub, paced = Stub(), Stub(interval_s=pace_ms / 1000)
    for serve, port in ((stub.serve_prefill, p_port), (stub.serve, d_port),
                        (paced.serve, paced_port)):  # fmt: skip
        await asyncio.start_server(serve, "127.0.0.1", port, backlog=256)
    print("ready", flush=True)
    await asyncio.Event().wait()


def _scope() -> dict[str, Any]:
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(_BODY)).encode())]  # fmt: skip
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2), "state": {},
    }  # fmt: skip


class _Sends:
    """When each call of the router's client to an instance was written
    (`wire_protocol.Connection.send`, wrapped)."""

    def __init__(self) -> None:
        from kvduplex.server.router import wire_protocol

        self.times: list[float] = []
        send = wire_protocol.Connection.send

        def noted(conn: Any, request: bytes) -> Any:
            self.times.append(time.perf_counter())
            return send(conn, request)

        wire_protocol.Connection.send = noted  # type: ignore[method-assign]


async def _one(app: Any, sends: _Sends) -> dict[str, float]:
    """One streamed request through `app`, read to its end: its stages' times (us)."""
    done = asyncio.Event()
    first: list[float] = []
    received = False

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": _BODY, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if message.get("body") and not first:
                first.append(time.perf_counter())
            if not message.get("more_body"):
                done.set()

    sends.times.clear()
    start = time.perf_counter()
    await app(_scope(), receive, send)
    p_sent, d_sent = sends.times[:2]
    times = (p_sent, d_sent, first[0])
    return {stage: (t - start) * 1e6 for stage, t in zip(STAGES, times, strict=True)}


async def _measure(args: argparse.Namespace, ports: list[int]) -> dict[str, Any]:
    from kvduplex.model.source import load_tokenizer

    p_port, d_port, paced_port = ports
    tokenizer = load_tokenizer("tiny")
    sends = _Sends()
    objects = list(range(args.evict_mb * (1 << 20) // 36))  # an int and its list slot
    out: dict[str, Any] = {}
    async with _router(p_port, d_port, tokenizer) as app:
        for _ in range(args.warmup):
            await _one(app, sends)
        for mode in ("warm", "cold"):
            runs = []
            for _ in range(args.requests):
                if mode == "cold":
                    sum(objects)  # walks every object: the path's lines leave the caches
                runs.append(await _one(app, sends))
            out[mode] = {s: statistics.median(r[s] for r in runs) for s in STAGES}
    async with _router(p_port, paced_port, tokenizer) as app:
        for _ in range(min(args.warmup, args.paced)):
            await _one(app, sends)
        start = time.process_time()
        for _ in range(args.paced):
            await _one(app, sends)
        out[CPU] = (time.process_time() - start) / args.paced * 1e6
    return out


@contextlib.asynccontextmanager
async def _router(p_port: int, d_port: int, tokenizer: Any) -> AsyncIterator[Any]:
    """A router's app over P and D, its first probe round done, the heap settled."""
    from kvduplex.config import RouterConfig
    from kvduplex.server.router.app import create_router_app
    from kvduplex.server.router.app import settle_heap
    from kvduplex.server.router.state import RouterState

    config = RouterConfig(
        prefill=(f"http://127.0.0.1:{p_port}",), decode=(f"http://127.0.0.1:{d_port}",),
        model="tiny", health_interval_s=1.0,
    )  # fmt: skip
    state = RouterState.create(config, tokenizer)
    app = create_router_app(state)
    async with app.router.lifespan_context(app):
        while state.unready_reason() is not None:  # the first probe round
            await asyncio.sleep(0.05)
        settle_heap()
        yield app


def child(args: argparse.Namespace) -> None:
    """Measure this checkout's router (the stub in a process of its own); print JSON."""
    from kvduplex.server.cluster import free_port

    cpus = sorted(os.sched_getaffinity(0))
    ports = [free_port() for _ in range(3)]
    stub_cpus = {cpus[-1]} if len(cpus) > 1 else set(cpus)
    stub = subprocess.Popen(
        [sys.executable, SCRIPT, "--stub", *map(str, ports), "--pace-ms", str(args.pace_ms)],
        stdout=subprocess.PIPE, preexec_fn=lambda: os.sched_setaffinity(0, stub_cpus),
    )  # fmt: skip
    try:
        assert stub.stdout is not None and stub.stdout.readline().strip() == b"ready"
        os.sched_setaffinity(0, {args.cpu if args.cpu in cpus else cpus[0]})
        import uvloop

        print(json.dumps(uvloop.run(_measure(args, ports))), flush=True)
    finally:
        stub.kill()
        stub.wait()


def run_checkout(repo: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round of checkout `repo`'s router, in a process of its own."""
    cmd = [sys.executable, SCRIPT, "--child", "--requests", str(args.requests),
           "--warmup", str(args.warmup), "--evict-mb", str(args.evict_mb),
           "--cpu", str(args.cpu), "--paced", str(args.paced),
           "--pace-ms", str(args.pace_ms)]  # fmt: skip
    path = os.pathsep.join([str(repo), str(REPO)])  # the checkout's kvduplex, these benchmarks
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


def table(results: dict[str, Any]) -> str:
    from benchmarks.common import md_table

    rows = []
    for name, rounds in results["checkouts"].items():
        cpu = statistics.median(r[CPU] for r in rounds)
        for mode in ("warm", "cold"):
            cells = [statistics.median(r[mode][s] for r in rounds) for s in STAGES]
            rows.append([name, mode, *(f"{c:.0f} us" for c in cells),
                         f"{cpu:.0f} us" if mode == "warm" else ""])  # fmt: skip
    return md_table(["router", "caches", "P's call written", "D's call written",
                     "first part sent", "CPU a paced request"], rows)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="per round, warm and cold")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--evict-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--paced", type=int, default=300, help="paced requests per round")
    parser.add_argument("--pace-ms", type=float, default=1.0, help="between D's events")
    parser.add_argument("--compare", nargs="+", default=[], metavar="DIR")
    parser.add_argument("--name", default="router_path", help="results/NAME.json and .md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stub", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stub:
        import uvloop

        uvloop.run(_serve_stub(*args.stub, args.pace_ms))
        return
    if args.child:
        child(args)
        return
    checkouts = {"router": REPO, **{str(Path(d)): Path(d) for d in args.compare}}
    results: dict[str, Any] = {
        "setup": {k: v for k, v in vars(args).items() if k not in ("child", "stub")},
        "checkouts": {name: [] for name in checkouts},
    }
    for _ in range(args.rounds):
        for name, repo in checkouts.items():
            results["checkouts"][name].append(run_checkout(repo.resolve(), args))
            print(name, json.dumps(results["checkouts"][name][-1]), flush=True)
    from benchmarks.common import write_results

    text = table(results)
    print(text)
    print(f"wrote {write_results(args.name, results, text)}")


if __name__ == "__main__":
    main()
