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

the same stages' p50 with ``--streams`` requests at a time (D's events 20 ms apart, as
the capacity benchmark paces them), in-process, with no HTTP server or client around
them; and the router's CPU a request (this process's, user and system) over ``--paced``
requests whose D sends its events ``--pace-ms`` apart, each a part of its own: the
request's path and its 16 events, each a wake of the event loop.

Times move with the machine: a change of a few percent hides in them. ``--instructions``
also counts the instructions the router's process runs for a paced request (user space,
valgrind's cachegrind: the difference between runs of ``INSTRUCTION_RUNS`` requests, its
own startup cancelled out), which moves by under 0.1% from run to run: it tells a change
of 1% apart (about 2 minutes a checkout; needs ``valgrind``).

Under load the path runs between those two: how much each change saves of it, cold and
warm, is what it saves of the router's share of a TTFT. ``--compare DIR ...`` runs
other checkouts' routers too, interleaved round by round (each in a process of its
own, its checkout first on the path).

    PYTHONPATH=. python benchmarks/bench_router_path.py                 # about a minute
    PYTHONPATH=. python benchmarks/bench_router_path.py --compare /tmp/kvd-base
    PYTHONPATH=. python benchmarks/bench_router_path.py --instructions --rounds 1 \
        --compare /tmp/kvd-base

Writes results/router_path.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import random
import re
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
LOADED = "loaded"
"""The loaded phase's stages (us)."""
LOAD_PACE_MS = 20.0
"""Between D's events in the loaded phase (and the counted one)."""
INSTRUCTION_RUNS = (10, 30)
"""Paced requests in the two counted runs (after `INSTRUCTION_WARMUP`)."""
INSTRUCTION_WARMUP = 20
_BODY = json.dumps(
    {"model": "tiny", "prompt": "hello router", "max_tokens": 16, "stream": True,
     "temperature": 0}
).encode()  # fmt: skip
"""What the capacity benchmark's load client sends (`router_load.run_streams`)."""


async def _serve_stub(
    p_port: int, d_port: int, paced_port: int, load_port: int, pace_ms: float
) -> None:
    from benchmarks.router_stub import Stub

    stub, paced = Stub(), Stub(interval_s=pace_ms / 1000)
    load = Stub(interval_s=LOAD_PACE_MS / 1000)
    for serve, port in ((stub.serve_prefill, p_port), (stub.serve, d_port),
                        (paced.serve, paced_port), (load.serve, load_port)):  # fmt: skip
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


_SENT: contextvars.ContextVar[list[float]] = contextvars.ContextVar("sent")
"""When each call of the router's client to an instance was written, for the request
whose context this is (the flows' tasks for it copy it)."""


def _note_sends() -> None:
    """`wire_protocol.Connection.send`, wrapped: each call's time noted in `_SENT`."""
    from kvduplex.router import wire_protocol

    send = wire_protocol.Connection.send

    def noted(conn: Any, request: bytes) -> Any:
        sent = _SENT.get(None)
        if sent is not None:
            sent.append(time.perf_counter())
        return send(conn, request)

    wire_protocol.Connection.send = noted  # type: ignore[method-assign]


async def _one(app: Any) -> dict[str, float]:
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

    sent: list[float] = []
    _SENT.set(sent)
    start = time.perf_counter()
    await app(_scope(), receive, send)
    p_sent, d_sent = sent[:2]
    times = (p_sent, d_sent, first[0])
    return {stage: (t - start) * 1e6 for stage, t in zip(STAGES, times, strict=True)}


async def _measure(args: argparse.Namespace, ports: list[int]) -> dict[str, Any]:
    from kvduplex.common.model_source import load_tokenizer

    p_port, d_port, paced_port, load_port = ports
    tokenizer = load_tokenizer("tiny")
    _note_sends()
    objects = list(range(args.evict_mb * (1 << 20) // 36))  # an int and its list slot
    out: dict[str, Any] = {}
    async with _router(p_port, d_port, tokenizer) as app:
        for _ in range(args.warmup):
            await _one(app)
        for mode in ("warm", "cold"):
            runs = []
            for _ in range(args.requests):
                if mode == "cold":
                    sum(objects)  # walks every object: the path's lines leave the caches
                runs.append(await _one(app))
            out[mode] = {s: statistics.median(r[s] for r in runs) for s in STAGES}
    async with _router(p_port, paced_port, tokenizer) as app:
        for _ in range(min(args.warmup, args.paced)):
            await _one(app)
        start = time.process_time()
        for _ in range(args.paced):
            await _one(app)
        out[CPU] = (time.process_time() - start) / args.paced * 1e6
    if args.loaded_s > 0:
        async with _router(p_port, load_port, tokenizer) as app:
            out[LOADED] = await _loaded(app, args)
    return out


async def _loaded(app: Any, args: argparse.Namespace) -> dict[str, float]:
    """``--streams`` requests at a time, each stream's next sent when its answer ended
    (D's events `LOAD_PACE_MS` apart, as `bench_router_capacity.py`'s TTFT phase paces
    them), each stream started after a random pause of up to one answer: each stage's p50
    over the requests sent after the first second."""
    rng = random.Random(0)
    start = time.perf_counter()
    warm_until, stop = start + 1.0, start + 1.0 + args.loaded_s
    runs: list[dict[str, float]] = []

    async def stream(pause_s: float) -> None:
        await asyncio.sleep(pause_s)
        while (sent_at := time.perf_counter()) < stop or not runs:  # at least one counted
            run = await _one(app)
            if sent_at >= warm_until:
                runs.append(run)

    answer_s = LOAD_PACE_MS / 1000 * 16
    await asyncio.gather(*(stream(rng.uniform(0, answer_s)) for _ in range(args.streams)))
    return {s: statistics.median(r[s] for r in runs) for s in STAGES}


@contextlib.asynccontextmanager
async def _router(p_port: int, d_port: int, tokenizer: Any) -> AsyncIterator[Any]:
    """A router's app over P and D, its first probe round done, the heap settled."""
    from kvduplex.router.app import create_router_app
    from kvduplex.router.app import settle_heap
    from kvduplex.router.config import RouterConfig
    from kvduplex.router.state import RouterState

    config = RouterConfig(
        prefill=(f"http://127.0.0.1:{p_port}",), decode=(f"http://127.0.0.1:{d_port}",),
        model="tiny", health_interval_s=1.0,
    )  # fmt: skip
    state = RouterState.create(config, tokenizer)
    app = create_router_app(state)
    async with _lifespan(app):
        while state.unready_reason() is not None:  # the first probe round
            await asyncio.sleep(0.05)
        settle_heap()
        yield app


@contextlib.asynccontextmanager
async def _lifespan(app: Any) -> AsyncIterator[None]:
    """`app`'s ASGI lifespan: started on entry, shut down on exit."""
    to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, to_app.get, from_app.put))
    await to_app.put({"type": "lifespan.startup"})
    await from_app.get()
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        await from_app.get()
        await task


def child(args: argparse.Namespace) -> None:
    """Measure this checkout's router (the stub in a process of its own); print JSON."""
    from kvduplex.cluster import free_port

    cpus = sorted(os.sched_getaffinity(0))
    ports = [free_port() for _ in range(4)]
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


async def _count(n: int, p_port: int, d_port: int) -> None:
    """`n` paced requests after the warm-up (the process counted by cachegrind)."""
    from kvduplex.common.model_source import load_tokenizer

    _note_sends()
    async with _router(p_port, d_port, load_tokenizer("tiny")) as app:
        for _ in range(INSTRUCTION_WARMUP + n):
            await _one(app)


def instructions_per_request(repo: Path) -> float:
    """The instructions checkout `repo`'s router process runs for one paced request: the
    difference between two counted runs (`INSTRUCTION_RUNS`), over the requests between."""
    from kvduplex.cluster import free_port

    ports = [free_port() for _ in range(4)]
    stub = subprocess.Popen([sys.executable, SCRIPT, "--stub", *map(str, ports)],
                            stdout=subprocess.PIPE)  # fmt: skip
    path = os.pathsep.join([str(repo), str(REPO)])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": "0"}
    counts = []
    try:
        assert stub.stdout is not None and stub.stdout.readline().strip() == b"ready"
        for n in INSTRUCTION_RUNS:
            cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                   "--cachegrind-out-file=/dev/null", sys.executable, SCRIPT, "--count",
                   str(n), str(ports[0]), str(ports[3])]  # fmt: skip
            out = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True,
                                 check=True, timeout=900)  # fmt: skip
            found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
            assert found is not None, out.stderr[-2000:]
            counts.append(int(found.group(1).replace(",", "")))
    finally:
        stub.kill()
        stub.wait()
    return (counts[1] - counts[0]) / (INSTRUCTION_RUNS[1] - INSTRUCTION_RUNS[0])


def run_checkout(repo: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round of checkout `repo`'s router, in a process of its own."""
    cmd = [sys.executable, SCRIPT, "--child", "--requests", str(args.requests),
           "--warmup", str(args.warmup), "--evict-mb", str(args.evict_mb),
           "--cpu", str(args.cpu), "--paced", str(args.paced),
           "--pace-ms", str(args.pace_ms), "--loaded-s", str(args.loaded_s),
           "--streams", str(args.streams)]  # fmt: skip
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
        modes = ["warm", "cold"] + ([LOADED] if LOADED in rounds[0] else [])
        for mode in modes:
            cells = [statistics.median(r[mode][s] for r in rounds) for s in STAGES]
            label = f"{results['setup']['streams']} streams" if mode == LOADED else mode
            rows.append([name, label, *(f"{c:.0f} us" for c in cells),
                         f"{cpu:.0f} us" if mode == "warm" else ""])  # fmt: skip
    text = md_table(["router", "caches / load", "P's call written", "D's call written",
                     "first part sent", "CPU a paced request"], rows)  # fmt: skip
    counted = results.get("instructions")
    if counted:
        lines = [f"| {name} | {n:,.0f} |" for name, n in counted.items()]
        text += "\n\n| router | instructions a paced request |\n|---|---|\n" + "\n".join(lines)
    return text


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
    parser.add_argument("--loaded-s", type=float, default=4.0,
                        help="seconds of the loaded phase (0: none)")  # fmt: skip
    parser.add_argument("--streams", type=int, default=64, help="in the loaded phase")
    parser.add_argument("--instructions", action="store_true",
                        help="also count each router's instructions a paced request")  # fmt: skip
    parser.add_argument("--stub", nargs=4, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stub:
        import uvloop

        uvloop.run(_serve_stub(*args.stub, args.pace_ms))
        return
    if args.count:
        import uvloop

        uvloop.run(_count(*args.count))
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
    if args.instructions:
        results["instructions"] = {}
        for name, repo in checkouts.items():
            results["instructions"][name] = instructions_per_request(repo.resolve())
            print(name, f"{results['instructions'][name]:,.0f} instructions", flush=True)
    from benchmarks.common import write_results

    text = table(results)
    print(text)
    print(f"wrote {write_results(args.name, results, text)}")


if __name__ == "__main__":
    main()
