"""The router capacity benchmark's stub answers as a decode instance does, so that the
router's splice drops its copy of prefill's first token and relays the rest."""

from __future__ import annotations

import asyncio

from benchmarks.bench_router_capacity import FIRST_TOKEN
from benchmarks.bench_router_capacity import Stub
from benchmarks.bench_router_capacity import run_streams
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
