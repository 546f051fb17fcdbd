"""What one call to an instance costs the router's HTTP client, against the alternatives.

The stub instance of `bench_router_capacity.py` (`router_stub.py`) (its P answering ``POST
/internal/push/prefill`` with a small JSON body) runs in a child process pinned to one
core; this process, pinned to the other, POSTs to it one call at a time and times each
call to its parsed answer, and the CPU time of this process a call: over raw asyncio
streams (one kept-alive connection, the floor), the router's client (`wire.WirePool`),
aiohttp, and httpx over httpcore. ``--gap-ms`` idles between calls, as paced traffic does (caches go
cold between calls); 0 calls back to back.

    PYTHONPATH=. python benchmarks/bench_http_clients.py [--gap-ms 10] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable
from collections.abc import Callable

import aiohttp
import httpx

from benchmarks.router_stub import Stub
from kvduplex.cluster import free_port
from kvduplex.router.state import json_body
from kvduplex.router.wire import WirePool

BODY = {"xid": "x", "prompt_token_ids": list(range(64))}
JSON = {"content-type": "application/json"}


def serve_stub(port: int, cpu: int) -> int:
    """The stub in a child process pinned to `cpu`; its pid."""
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {cpu})

        async def serve() -> None:
            server = await asyncio.start_server(Stub().serve, "127.0.0.1", port)
            async with server:
                await server.serve_forever()

        asyncio.run(serve())
        os._exit(0)
    return pid


async def main(args: argparse.Namespace) -> None:
    port = free_port()
    pid = serve_stub(port, args.stub_cpu)
    os.sched_setaffinity(0, {args.client_cpu})
    try:
        await asyncio.sleep(1.0)
        url = f"http://127.0.0.1:{port}/internal/push/prefill"
        payload = json.dumps(BODY).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = (
            b"POST /internal/push/prefill HTTP/1.1\r\nhost: p\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        timeout = httpx.Timeout(600.0, connect=5.0)
        plain = httpx.AsyncClient(timeout=timeout)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def via_raw() -> None:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            json.loads(await reader.readexactly(length))

        async def via_aiohttp() -> None:
            headers = {"content-type": "application/json"}
            async with session.post(url, data=payload, headers=headers) as resp:
                await resp.json()

        pool = WirePool({}, 5.0, 600.0)

        async def via_wire() -> None:
            (await pool.post_whole(url, json_body(BODY))).json()

        async def via(client: httpx.AsyncClient) -> None:
            (await client.post(url, content=payload, headers=JSON)).json()

        clients: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("raw asyncio streams (floor)", via_raw),
            ("the router's client (wire)", via_wire), ("aiohttp", via_aiohttp),
            ("httpx over httpcore", lambda: via(plain)),
        ]  # fmt: skip
        print(f"| client | call p50 ms | call p90 ms | CPU a call us |  (gap {args.gap_ms} ms, "
              f"{args.calls} calls)")  # fmt: skip
        print("|---|---|---|---|")
        for name, call in clients:
            for _ in range(20):  # warm-up
                await call()
            times = []
            cpu = 0.0
            for _ in range(args.calls):
                c0, t0 = time.process_time(), time.perf_counter()
                await call()
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
                await asyncio.sleep(args.gap_ms / 1e3)
            p90 = statistics.quantiles(times, n=10)[-1]
            cpu_us = cpu / args.calls * 1e6
            print(f"| {name} | {statistics.median(times) * 1e3:.3f} | {p90 * 1e3:.3f} "
                  f"| {cpu_us:.0f} |", flush=True)  # fmt: skip
        writer.close()
        await session.close()
        pool.close()
        await plain.aclose()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--stub-cpu", type=int, default=1)
    parser.add_argument("--client-cpu", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
