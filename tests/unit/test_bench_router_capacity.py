"""The router capacity benchmark's stub answers as a decode instance does, so that the
router's splice drops its copy of prefill's first token and relays the rest."""

from __future__ import annotations

import asyncio

from benchmarks.bench_router_capacity import FIRST_TOKEN
from benchmarks.bench_router_capacity import Stub
from benchmarks.bench_router_capacity import run_streams
from benchmarks.bench_router_capacity import start_relay
from benchmarks.bench_router_capacity import wait_listening
from kvduplex.server.router.relay import SentToken
from kvduplex.server.router.relay import Splice
from kvduplex.server.router.relay import first_events


def test_the_stub_streams_what_the_router_splices() -> None:
    stub = Stub()
    events = stub.events(4, mark=True)
    spliced = first_events(SentToken(FIRST_TOKEN, chr(FIRST_TOKEN)))
    next(spliced)
    out, splice = spliced.send(b"".join(e.split(b"\r\n", 1)[1][:-2] for e in events))
    assert splice is Splice.DROPPED  # the first chunk named prefill's token: dropped
    assert out.count(b"\n\n") == 3 + 2  # the other tokens, the ids report, [DONE]
    assert out.endswith(b"data: [DONE]\n\n")


def test_the_stub_and_client_run_a_stream_straight() -> None:
    async def run() -> tuple[int, int, int]:
        stub = Stub()
        server = await asyncio.start_server(stub.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        load = await run_streams(port, 2, 8, duration_s=0.2)
        server.close()
        await stub.close()
        return load.num_requests, load.num_events, len(load.ttfts_s)

    num_requests, num_events, num_ttfts = asyncio.run(run())
    assert num_requests >= 2 and num_ttfts == num_requests
    assert num_events == num_requests * (8 + 2)  # tokens, the ids report, [DONE]


def test_the_floors_relay_the_stubs_streams_whole() -> None:
    """Each floor relays the stub's answers to the client, every event of them: the floor
    relay (raw asyncio), the stack floor (uvicorn and aiohttp, nothing of the router) and
    the two rungs of the ladder above it (the router's client; that in the router's app)."""

    async def run(flag: str) -> tuple[int, int, int, int]:
        stub = Stub()
        servers = [await asyncio.start_server(stub.serve, "127.0.0.1", 0) for _ in range(2)]
        p_port, d_port = (s.sockets[0].getsockname()[1] for s in servers)
        port, proc = start_relay(flag, p_port, d_port, cpu=0)
        try:
            await wait_listening(port, proc)
            load = await run_streams(port, 2, 8, duration_s=0.3)
        finally:
            proc.kill()
            proc.wait()
            for server in servers:
                server.close()
            await stub.close()
        return load.num_requests, load.num_events, len(load.ttfts_s), stub.num_prefills

    for flag in ("--floor-relay", "--stack-floor", "--client-floor", "--app-floor"):
        num_requests, num_events, num_ttfts, num_prefills = asyncio.run(run(flag))
        assert num_requests >= 2 and num_ttfts == num_requests, flag
        assert num_events == num_requests * (8 + 2), flag  # tokens, the ids report, [DONE]
        assert num_prefills >= num_requests, flag  # P was called for each
