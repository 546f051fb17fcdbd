"""The router alone: relayed SSE chunks per second per core, and the TTFT it adds.

A stub plays the instances (one asyncio HTTP/1.1 server, keep-alive, two ports: P and
D) and answers what the router asks in push mode, as the instances would (the bodies are
built with `kvduplex.openai.render`): ``/ready`` and ``/health`` with ``max_model_len``
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
  stack floor (`StackFloor`: the router's own server and client, uvicorn and aiohttp,
  with nothing of the router in them), what any relay on this stack adds here; and the
  floor relay (`FloorRelay`: raw asyncio), what any Python relay adds here. The CPU
  per request of each is reported beside its TTFT. ``--ladder`` adds the rungs between
  the stack floor and the router: the router's client to the instances (`ClientFloor`:
  httpx's models over aiohttp), and that inside the router's app (`app_floor`: FastAPI,
  its middlewares and error handlers, the router's relayed response): what each layer
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

Writes results/router_capacity.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvicorn
from fastapi import FastAPI
from fastapi import Request
from fastapi import Response

from benchmarks.timeline import STAGES
from benchmarks.timeline import Timeline
from kvduplex.config import ROUTER_POOL_IDLE_S
from kvduplex.openai import render
from kvduplex.openai.errors import install_error_handlers
from kvduplex.openai.protocol import CompletionRequest
from kvduplex.openai.transcript import ANSWER_IDS_FIELD
from kvduplex.server.auth import APIKeyGuard
from kvduplex.server.cluster import free_port
from kvduplex.server.drain import DrainGuard
from kvduplex.server.drain import DrainState
from kvduplex.server.guard import BodyCap
from kvduplex.server.router.relay import OuterSend
from kvduplex.server.router.relay import body_parts
from kvduplex.server.router.relay import relay
from kvduplex.server.router.state import InstanceCalls
from kvduplex.server.router.state import InstanceTransport
from kvduplex.server.router.state import instance_session

REPO = Path(__file__).resolve().parent.parent
FIRST_TOKEN = 65
"""The stub's every token ("A"): P's first token and D's copy of it match."""


# ------------------------------------------------------------------ the stub instances


@dataclass
class Stub:
    """P and D: counts what they served; D paces its events `interval_s` apart."""

    interval_s: float = 0.0
    timeline: Timeline | None = None
    """Where each request's first event spent its time, if noted (``--timeline``)."""
    num_prefills: int = 0
    num_streams: int = 0
    num_connections: int = 0
    _events: dict[tuple[int, bool], list[bytes]] = field(default_factory=dict)
    _open: dict[asyncio.StreamWriter, asyncio.Task[Any]] = field(default_factory=dict)

    def events(self, num_tokens: int, mark: bool) -> list[bytes]:
        """D's answer as HTTP chunks, one SSE event each (built once per shape)."""
        key = (num_tokens, mark)
        if key not in self._events:
            head = render.ResponseHead(request_id="cmpl-stub", model="tiny", is_chat=False)
            out = []
            for i in range(num_tokens):
                reason = "length" if i == num_tokens - 1 else None
                choice = render.stream_choice(head, "A", [FIRST_TOKEN], reason, is_first=i == 0)
                chunk = render.stream_chunk(head, choice)
                if mark and i == 0:
                    chunk[render.FIRST_TOKEN_IDS_FIELD] = [FIRST_TOKEN]
                out.append(render.sse_data(chunk))
            out.append(render.sse_data({ANSWER_IDS_FIELD: [FIRST_TOKEN] * num_tokens}))
            out.append(render.SSE_DONE)
            self._events[key] = [_http_chunk(e.encode()) for e in out]
        return self._events[key]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: P's and D's routes (see `_answer`)."""
        await self._serve(reader, writer, is_prefill=False)

    async def serve_prefill(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One connection to P's port: `serve`, and ``POST /v1/completions`` answered as
        a prefill instance answers the reference routers' prefill (`_PREFILL_ANSWER`)."""
        await self._serve(reader, writer, is_prefill=True)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, is_prefill: bool
    ) -> None:
        self.num_connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._open[writer] = task
        try:
            while True:
                method, path, body = await _read_request(reader)
                read_at = time.perf_counter()
                if is_prefill and method == "POST" and path == "/v1/completions":
                    self.num_prefills += 1
                    await _write_json(writer, _PREFILL_ANSWER)
                    if self.timeline is not None:
                        self.timeline.note_prefill(json.loads(body), read_at, time.perf_counter())
                else:
                    await self._answer(method, path, body, writer, read_at)
        except (asyncio.IncompleteReadError, ConnectionError, NotARequest):
            pass  # the connection closed: by the client, or here
        finally:
            del self._open[writer]
            writer.close()

    async def close(self) -> None:
        """Close the connections still open and wait for their handlers to end."""
        tasks = list(self._open.values())
        for writer in list(self._open):
            writer.close()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _answer(
        self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter, read_at: float
    ) -> None:
        if method == "GET" and path in ("/ready", "/health"):
            payload = {"status": "ok", "max_model_len": 1 << 20, "engine_id": "stub",
                       "block_size": 16}  # fmt: skip
            return await _write_json(writer, payload)
        req = json.loads(body) if body else {}
        if path == "/internal/push/prefill":
            self.num_prefills += 1
            await _write_json(writer, {"xid": req["xid"], "first_token": FIRST_TOKEN,
                                       "num_cached_tokens": 0})  # fmt: skip
            if self.timeline is not None:
                self.timeline.note_prefill(req, read_at, time.perf_counter())
            return
        if path.startswith("/internal/"):
            return await _write_json(writer, {"xid": req.get("xid", "")})
        if path != "/v1/completions" or not req.get("stream"):
            return await _write_json(writer, {"error": {"message": "stub: not served"}}, 404)
        self.num_streams += 1
        params = req.get("kv_transfer_params") or {}
        events = self.events(int(req["max_tokens"]), bool(params.get("mark_first_token")))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"x-request-id: cmpl-stub\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for i, event in enumerate(events):
            writer.write(event)
            if i == 0 and self.timeline is not None:
                self.timeline.note_decode(req, read_at, time.perf_counter())
            await writer.drain()
            if self.interval_s > 0:
                await asyncio.sleep(self.interval_s)
            else:
                await asyncio.sleep(0)  # the other streams' turn, as a decode step
        writer.write(b"0\r\n\r\n")
        await writer.drain()


_PREFILL_ANSWER = {
    "id": "cmpl-stub", "object": "text_completion", "model": "tiny",
    "choices": [{"index": 0, "text": chr(FIRST_TOKEN), "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                           "remote_engine_id": "stub", "remote_block_ids": [0],
                           "remote_host": "127.0.0.1", "remote_port": 1},
}  # fmt: skip
"""P's answer to a reference router's prefill (``max_tokens`` 1): a completion of one
token, with the ``kv_transfer_params`` a vLLM prefill instance returns for D."""


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class NotARequest(Exception):
    """What came is no HTTP/1.x request (an HTTP/2 client's preface, ``PRI * HTTP/2.0``,
    which the reference routers try first): the stub closes the connection."""


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    request_line = head[0].split(" ")
    if len(request_line) != 3 or not request_line[2].startswith("HTTP/1."):
        raise NotARequest(head[0])
    method, path, _ = request_line
    length = 0
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return method, path, await reader.readexactly(length) if length else b""


async def _write_json(writer: asyncio.StreamWriter, payload: Any, status: int = 200) -> None:
    body = json.dumps(payload).encode()
    writer.write(
        b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (status, len(body), body)
    )
    await writer.drain()


# -------------------------------------------------------------------- the floor relay


class FloorRelay:
    """The least a push relay does, in raw asyncio streams: per client connection one
    kept-alive connection to P and one to D; each request goes to both at once (P's
    prefill, D's stream, as the router sends them), and D's HTTP chunks are piped back as
    they come, unparsed. No routing, JSON, tokenizing, validation or framework: what it
    adds to TTFT is the floor under a Python relay's on this machine (its process, pinned
    as the router is, and the hops between cores)."""

    def __init__(self, p_port: int, d_port: int) -> None:
        self.p_port, self.d_port = p_port, d_port

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        p_reader, p_writer = await asyncio.open_connection("127.0.0.1", self.p_port)
        d_reader, d_writer = await asyncio.open_connection("127.0.0.1", self.d_port)
        prefill = b'{"xid": "floor"}'
        p_request = (
            b"POST /internal/push/prefill HTTP/1.1\r\nhost: p\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(prefill), prefill)
        )
        try:
            while True:
                _, path, body = await _read_request(reader)
                p_writer.write(p_request)
                d_writer.write(
                    b"POST %s HTTP/1.1\r\nhost: d\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
                )
                p_head = await p_reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", p_head, re.IGNORECASE)
                await p_reader.readexactly(int(length.group(1)) if length else 0)
                writer.write(await d_reader.readuntil(b"\r\n\r\n"))
                while True:
                    line = await d_reader.readuntil(b"\r\n")
                    size = int(line[:-2], 16)
                    writer.write(line + await d_reader.readexactly(size + 2))
                    if size == 0:
                        break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for w in (writer, p_writer, d_writer):
                w.close()


class StackFloor:
    """The router's own server and client stack with nothing of the router in it: one
    ASGI callable under uvicorn (uvloop, httptools, as `kvduplex router` runs), calling P
    and D with aiohttp's client (one pooled session, as `state.InstanceTransport`'s) in the
    push router's order (P's call started first, in a task; D's stream opened; P's answer
    awaited) and sending D's parts on as aiohttp reads them, unparsed. No routing, JSON,
    tokenizing, middleware or FastAPI. What it adds is the floor under any relay built on
    this stack on this machine, as `FloorRelay`'s is under any Python relay."""

    def __init__(self, p_port: int, d_port: int) -> None:
        self.p_url = f"http://127.0.0.1:{p_port}/internal/push/prefill"
        self.d_url = f"http://127.0.0.1:{d_port}"
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # `wait_ready`
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        if self.session is None:  # made in the server's event loop
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=ROUTER_POOL_IDLE_S)
            self.session = aiohttp.ClientSession(connector=connector)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        prefill = asyncio.ensure_future(self._prefill(self.session))
        await asyncio.sleep(0)  # P's call goes out first
        url = self.d_url + scope["path"]
        async with self.session.post(url, data=body, headers=_JSON_HEADERS) as d:
            await prefill
            head = [(b"content-type", d.headers["content-type"].encode())]
            await send({"type": "http.response.start", "status": d.status, "headers": head})
            async for part in d.content.iter_any():
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _prefill(self, session: aiohttp.ClientSession) -> None:
        async with session.post(self.p_url, data=b'{"xid": "floor"}', headers=_JSON_HEADERS) as p:
            await p.read()


_JSON_HEADERS = {"content-type": "application/json"}


class ClientFloor(StackFloor):
    """`StackFloor` with the router's own client to the instances (`state.InstanceCalls`
    over `state.InstanceTransport`: httpx's requests and responses over aiohttp; D's
    stream read by `relay.body_parts`). The first rung of ``--ladder``."""

    calls: InstanceCalls | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "GET":
            return await super().__call__(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        d = await self.open(json.loads(body), scope["path"])
        head = [(b"content-type", d.headers["content-type"].encode())]
        await send({"type": "http.response.start", "status": d.status_code, "headers": head})
        try:
            async for part in body_parts(d):
                await send({"type": "http.response.body", "body": part, "more_body": True})
        finally:
            await d.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def open(self, request: dict[str, Any], path: str) -> httpx.Response:
        """P called and D's stream opened as `StackFloor` does, through the router's client;
        D's response once P answered."""
        if self.calls is None:  # its aiohttp session is made in the server's event loop
            transport = InstanceTransport(client=instance_session)
            self.calls = InstanceCalls(transport, {}, httpx.Timeout(600.0, connect=5.0))
        prefill = asyncio.ensure_future(self.calls.post(self.p_url, {"xid": "floor"}))
        await asyncio.sleep(0)  # P's call goes out first
        d = await self.calls.post(self.d_url + path, request, stream=True)
        (await prefill).json()
        return d


def app_floor(p_port: int, d_port: int) -> FastAPI:
    """`ClientFloor`'s relay inside the router's app: FastAPI with the router's error
    handlers and middlewares (as `router.app.create_router_app` adds them), the body
    validated as the router's route validates it, the answer sent by the router's
    `relay.relay`. The second rung of ``--ladder``: what is left between it and the
    router is the router's own work (prompt, routing, sessions, splice, answer tap)."""
    client = ClientFloor(p_port, d_port)
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(DrainGuard, drain=DrainState())
    app.add_middleware(BodyCap, max_body_bytes=1 << 20)
    app.add_middleware(APIKeyGuard, api_key=None)
    app.add_middleware(OuterSend)

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        d = await client.open(dict(await raw.json()), "/v1/completions")
        return relay(d, body_parts(d), lambda failed: None, "decode")

    return app


def serve_stack_floor(port: int, p_port: int, d_port: int, rung: str = "stack") -> None:
    """Run a `StackFloor` (`rung`: or a `ClientFloor`, or an `app_floor`) on
    127.0.0.1:`port` until killed."""
    rungs: dict[str, Callable[[int, int], Any]] = {
        "stack": StackFloor, "client": ClientFloor, "app": app_floor,
    }  # fmt: skip
    app = rungs[rung](p_port, d_port)
    uvicorn.run(
        app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="off",
        log_level="warning", backlog=4096,
    )  # fmt: skip


def serve_floor_relay(port: int, p_port: int, d_port: int) -> None:
    """Run a `FloorRelay` on 127.0.0.1:`port` until killed."""

    async def main() -> None:
        relay = FloorRelay(p_port, d_port)
        server = await asyncio.start_server(relay.serve, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ------------------------------------------------------------------------ the client


@dataclass
class Load:
    """What one run of streams saw."""

    num_events: int = 0
    num_requests: int = 0
    num_errors: int = 0
    """Answers other than 200 (the router's 503 when its probes time out, overloaded), and
    streams with an error event (a relay that failed after its head)."""
    ttfts_s: list[float] = field(default_factory=list)


_ERROR_EVENT = re.compile(rb'data: *\{ *"error"')
"""An SSE event that is an error object (a relay's ``decode_failed``, say)."""


async def _stream_once(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, load: Load
) -> tuple[float, float | None]:
    """One streamed completion on a kept-alive connection: its events counted, its TTFT;
    when it was sent, and the TTFT counted for it (None: none was)."""
    start = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):  # an error answer: counted, its body read
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(length.group(1)) if length else 0)
        load.num_errors += 1
        return start, None
    first, failed, ttft = True, False, None
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            break
        failed = failed or _ERROR_EVENT.search(data) is not None
        if first and b"data: " in data and not failed:
            ttft = time.perf_counter() - start
            load.ttfts_s.append(ttft)
        first = first and b"data: " not in data
        load.num_events += data.count(b"\n\n")
    if failed:  # an error event in a 200 stream: an error, its first event no TTFT
        load.num_errors += 1
    else:
        load.num_requests += 1
    return start, ttft


def completion_request(fields: dict[str, Any]) -> bytes:
    """POST /v1/completions of `fields` as JSON, as the load client sends it."""
    body = json.dumps(fields).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def run_streams(
    port: int,
    num_streams: int,
    num_tokens: int,
    duration_s: float,
    stagger_s: float = 0.0,
    timeline: Timeline | None = None,
    name: str = "",
) -> Load:
    """`num_streams` closed-loop streams for `duration_s` against 127.0.0.1:`port`, each
    starting after a random (seeded) pause in ``[0, stagger_s)``: streams of one length
    started at once would stay in step and send their requests in bursts. With a
    `timeline`, each request is named `name` and a number, and noted in it."""
    rng = random.Random(0)
    pauses = [rng.uniform(0.0, stagger_s) for _ in range(num_streams)]
    fields = {"model": "tiny", "prompt": "hello router", "max_tokens": num_tokens,
              "stream": True, "temperature": 0}  # fmt: skip
    request = completion_request(fields)
    load = Load()
    deadline = time.perf_counter() + duration_s

    async def stream(index: int, pause_s: float) -> None:
        await asyncio.sleep(pause_s)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            k = 0
            while time.perf_counter() < deadline:
                if timeline is None:
                    await _stream_once(reader, writer, request, load)
                    continue
                user, k = f"{name}{index}.{k}", k + 1
                named = completion_request({**fields, "user": user})
                sent, ttft = await _stream_once(reader, writer, named, load)
                if ttft is not None:
                    timeline.sent[user], timeline.first[user] = sent, sent + ttft
        finally:
            writer.close()

    await asyncio.gather(*(stream(i, pause) for i, pause in enumerate(pauses)))
    return load


# ------------------------------------------------------------------------ the router


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_PROFILED = """
import cProfile, runpy, sys, time
sys.argv = sys.argv[1:]
profile = cProfile.Profile(time.thread_time)  # the event loop's CPU time, not waits
profile.enable()
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats({path!r})
"""
"""`python -c` this, then the module and its arguments: the module under cProfile."""


def start_router(
    port: int,
    p_port: int,
    d_port: int,
    cpu: int,
    log: Path,
    profile: str = "",
    repo: Path = REPO,
) -> subprocess.Popen[bytes]:
    """``kvduplex router`` of checkout `repo`, pinned to `cpu`; under cProfile (written to
    `profile`) if given."""
    python = (
        [sys.executable, "-c", _PROFILED.format(path=profile)]
        if profile
        else [sys.executable, "-m"]
    )
    cmd = [*python, "kvduplex", "router", "--model", "tiny", "--port", str(port),
           "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
           "--health-interval-s", "1"]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen(
        cmd, env=env, cwd=repo, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip


def start_relay(
    flag: str, p_port: int, d_port: int, cpu: int
) -> tuple[int, subprocess.Popen[bytes]]:
    """A floor (`flag`: ``--floor-relay``, ``--stack-floor``) over the stub, pinned to
    `cpu`: its port and process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, flag, str(port), str(p_port), str(d_port)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip
    return port, proc


@dataclass(frozen=True)
class Reference:
    """A reference P/D router (``--reference``): ``python -m MODULE.launch_router`` in P/D
    mode."""

    name: str
    """Its side in the results (``NAME_added_p50_ms``, ...)."""
    package: str
    """On PyPI."""
    module: str
    mode_flags: tuple[str, ...]
    """P/D mode, and no log line per request."""
    ready_path: str
    """200 once it has an instance of each role to send to."""


REFERENCES = {
    "sglang": Reference("sglang_router", "sglang-router", "sglang_router",
                        ("--pd-disaggregation", "--log-level", "warn"), "/readiness"),
    "vllm": Reference("vllm_router", "vllm-router", "vllm_router",
                      ("--vllm-pd-disaggregation", "--log-level", "warning"), "/health"),
}  # fmt: skip
"""SGLang's router sends a request to P and D at once, as the push router does; vLLM's
sends it to P (``max_tokens`` 1), then to D with P's ``kv_transfer_params``. Both are
compiled (Rust, tokio, hyper). vLLM's opens its port once its instances answer their
probes, so its ``/health`` says it is ready; SGLang's ``/health`` says only that it
runs (``/readiness`` is 503 until it has instances)."""


def start_reference(
    ref: Reference, python: str, port: int, p_port: int, d_port: int, cpu: int, log: Path
) -> subprocess.Popen[bytes]:
    """Reference router `ref` run by `python` over the stub, pinned to `cpu` (one core:
    tokio starts one worker thread), probing the stub every second as the router does,
    its metrics on a port of its own."""
    cmd = [python, "-m", f"{ref.module}.launch_router", *ref.mode_flags,
           "--host", "127.0.0.1", "--port", str(port),
           "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
           "--policy", "round_robin", "--health-check-interval-secs", "1",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip


def check_references(kinds: list[str], python: str) -> None:
    """Exit with how to install them if `python` (missing, or not a Python) lacks a
    reference router of `kinds`."""
    for kind in kinds:
        ref = REFERENCES[kind]
        try:
            found = subprocess.run([python, "-c", f"import {ref.module}"], capture_output=True)
            imported = found.returncode == 0
        except OSError:
            imported = False
        if not imported:
            raise SystemExit(
                f"--reference {kind}: {python} cannot import {ref.module}; install it in a "
                f"venv of its own (python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip "
                f"install {ref.package}) and pass --reference-python /tmp/refvenv/bin/python"
            )


async def wait_ready(
    port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60.0, path: str = "/ready"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the router exited")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % path.encode())
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the router was not ready in time")


@dataclass
class Side:
    """One relay of the TTFT phase (the router, a floor): its TTFTs and its process's CPU."""

    port: int
    pid: int
    ttfts_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    num_requests: int = 0
    num_errors: int = 0

    async def run(
        self, num_streams: int, num_tokens: int, duration_s: float, stagger_s: float,
        timeline: Timeline | None = None, name: str = "",
    ) -> None:  # fmt: skip
        cpu0, t0 = cpu_seconds(self.pid), time.perf_counter()
        load = await run_streams(
            self.port, num_streams, num_tokens, duration_s, stagger_s, timeline, name
        )
        self.cpu_s += cpu_seconds(self.pid) - cpu0
        self.wall_s += time.perf_counter() - t0
        self.ttfts_s += load.ttfts_s
        self.num_requests += load.num_requests
        self.num_errors += load.num_errors

    @property
    def cpu_per_request_ms(self) -> float:
        return self.cpu_s / self.num_requests * 1e3 if self.num_requests else float("nan")


async def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port}")


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


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each (the routers drain), killed if one takes longer than 15 s."""
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
    if sys.argv[1:2] == ["--floor-relay"]:
        return serve_floor_relay(*(int(a) for a in sys.argv[2:5]))
    for rung in ("stack", "client", "app"):
        if sys.argv[1:2] == [f"--{rung}-floor"]:
            port, p_port, d_port = (int(a) for a in sys.argv[2:5])
            return serve_stack_floor(port, p_port, d_port, rung)
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
        "inside the router's FastAPI app and middlewares (app floor): what each layer adds",
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
