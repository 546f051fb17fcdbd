"""The router capacity benchmark's stub answers as a decode instance does, so that the
router's splice drops its copy of prefill's first token and relays the rest; on P's
port, as a prefill instance answers the reference routers; the floors relay whole."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.router_load import Load
from benchmarks.router_load import run_streams
from benchmarks.router_load import stream_once
from benchmarks.router_procs import check_references
from benchmarks.router_procs import start_relay
from benchmarks.router_procs import wait_listening
from benchmarks.router_stub import FIRST_TOKEN
from benchmarks.router_stub import Stub
from benchmarks.timeline import Timeline
from kvduplex.router.relay import SentToken
from kvduplex.router.relay import Splice
from kvduplex.router.relay import first_events


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


def test_the_stubs_prefill_port_answers_a_reference_routers_prefill() -> None:
    """On P's port a completion is answered as a vLLM prefill instance answers one: a
    token and the ``kv_transfer_params`` for D; the push router's own prefill route
    answers as before; a client speaking HTTP/2 first is disconnected, nothing raised."""

    async def run() -> tuple[dict[str, Any], dict[str, Any], bytes, list[dict[str, Any]]]:
        unhandled: list[dict[str, Any]] = []  # what a connection's handler let escape
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        stub = Stub()
        server = await asyncio.start_server(stub.serve_prefill, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                           ("/internal/push/prefill", {"xid": "x"})]:  # fmt: skip
            data = json.dumps(body).encode()
            writer.write(
                b"POST %s HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            answers.append(json.loads(await reader.readexactly(length)))
        writer.close()
        h2_reader, h2_writer = await asyncio.open_connection("127.0.0.1", port)
        h2_writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        rest = await asyncio.wait_for(h2_reader.read(), 10)  # to the end: closed
        h2_writer.close()
        server.close()
        await stub.close()
        assert stub.num_prefills == 2
        return answers[0], answers[1], rest, unhandled

    completion, push, rest, unhandled = asyncio.run(run())
    assert completion["choices"][0]["text"] == chr(FIRST_TOKEN)
    assert completion["kv_transfer_params"]["do_remote_prefill"] is True
    assert push == {"xid": "x", "first_token": FIRST_TOKEN, "num_cached_tokens": 0}
    assert rest == b"" and unhandled == []  # closed unanswered, nothing raised


def test_a_missing_reference_router_says_how_to_install_it(tmp_path: Path) -> None:
    for python in ("/bin/false", str(tmp_path / "no-python")):  # imports nothing; no file
        with pytest.raises(SystemExit, match="pip install vllm-router"):
            check_references(["vllm"], python)


def test_an_error_event_after_a_200_is_an_error_not_a_ttft() -> None:
    """A relay that fails after its head streams an error event: the client counts the
    stream as an error, and its first event (the error) as no time to a first token."""
    failed = b'data: {"error": {"message": "decode at D failed mid-answer"}}\n\n'
    served = b'data: {"choices": [{"text": "A"}]}\n\ndata: [DONE]\n\n'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for event in (failed, served):
            await reader.readuntil(b"\r\n\r\n")  # a request with no body
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
        writer.close()

    async def run() -> Load:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        load = Load()
        for _ in range(2):
            await stream_once(reader, writer, b"POST / HTTP/1.1\r\n\r\n", load)
        writer.close()
        server.close()
        return load

    load = asyncio.run(run())
    assert (load.num_errors, load.num_requests, len(load.ttfts_s)) == (1, 1, 1)


def test_the_timeline_links_the_push_routers_prefill_to_its_request_by_xid() -> None:
    """P's body from the push router names only the transfer; D's names it and the
    request: the stages are differences of the readings, whichever side came first."""
    timeline = Timeline()
    timeline.sent["r.0"], timeline.first["r.0"] = 1.0, 1.010
    timeline.note_decode({"user": "r.0", "kv_transfer_params": {"xid": "x"}}, 1.004, 1.005)
    timeline.note_prefill({"xid": "x"}, 1.002, 1.003)  # after D: linked all the same
    timeline.sent["s.0"], timeline.first["s.0"] = 2.0, 2.010
    timeline.note_prefill({"xid": "y"}, 2.001, 2.002)  # before D
    timeline.note_decode({"user": "s.0", "kv_transfer_params": {"xid": "y"}}, 2.003, 2.004)
    timeline.sent["t.0"], timeline.first["t.0"] = 3.0, 3.010
    timeline.note_prefill({"user": "t.0"}, 3.001, 3.002)  # a reference router's: by name
    for name, to_p in (("r.", 2.0), ("s.", 1.0), ("t.", 1.0)):
        stages = timeline.stages_ms(name)
        assert stages["to_p"] == pytest.approx(to_p), name
        assert stages["p_answer_to_client"] == pytest.approx(10.0 - to_p - 1.0), name
    assert timeline.stages_ms("r.")["to_d"] == pytest.approx(4.0)
    assert timeline.stages_ms("r.")["d_first_to_client"] == pytest.approx(5.0)
    assert math.isnan(timeline.stages_ms("t.")["to_d"])  # D never saw it


def test_the_timeline_notes_every_request_of_a_run() -> None:
    async def run() -> tuple[Timeline, Load]:
        stub = Stub(timeline=Timeline())
        server = await asyncio.start_server(stub.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        assert stub.timeline is not None
        load = await run_streams(port, 2, 4, 0.2, timeline=stub.timeline, name="direct.2.0.")
        server.close()
        await stub.close()
        return stub.timeline, load

    timeline, load = asyncio.run(run())
    named = [user for user in timeline.first if user.startswith("direct.2.0.")]
    assert len(named) == load.num_requests >= 2
    assert all(user in timeline.d_read and user in timeline.d_first for user in named)
    for user in named:
        sent, first = timeline.sent[user], timeline.first[user]
        assert sent <= timeline.d_read[user] <= timeline.d_first[user] <= first
    stages = timeline.stages_ms("direct.")
    assert stages["to_d"] >= 0 and stages["d_first_to_client"] >= 0
    assert math.isnan(stages["to_p"])  # straight to D: no P


def test_the_path_benchmark_times_a_routed_requests_stages_and_a_paced_ones_cpu() -> None:
    """`bench_router_path.py` runs this checkout's router against the stub, in a process
    of its own: each stage's p50, warm and cold, in order (P's call before D's, both
    before the first part), under load too, and the CPU of a request whose D paces its
    events."""
    from benchmarks.bench_router_path import CPU
    from benchmarks.bench_router_path import LOADED
    from benchmarks.bench_router_path import STAGES
    from benchmarks.bench_router_path import run_checkout
    from benchmarks.router_procs import REPO

    args = argparse.Namespace(
        requests=5, warmup=5, evict_mb=1, cpu=0, paced=3, pace_ms=1.0, loaded_s=0.5, streams=4
    )
    result = run_checkout(REPO, args)
    for mode in ("warm", "cold", LOADED):
        times = [result[mode][stage] for stage in STAGES]
        assert 0 < times[0] < times[1] < times[2], (mode, times)
    assert result[CPU] > 0  # the paced requests' CPU, each
