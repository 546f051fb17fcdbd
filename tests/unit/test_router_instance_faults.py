"""The router over instances that answer badly, on real sockets and through its real
client (`wire.WirePool`): a port that does not speak HTTP, a refusal whose body the
client must get, a whole answer cut mid-body; and what the router tells the instances
when one side fails (push: D told at once that P failed; pull: P's lease released when D
refuses), and when a client leaves a whole answer before it comes (under uvicorn).

Each server listens on 127.0.0.1 on a port the kernel picks, and is stopped by its test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from typing import Any
from typing import TypeVar

import httpx
import pytest
import uvicorn
from aiohttp import web

from kvduplex.common.config import TransferMode
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router import client as rc
from kvduplex.router import push_flow
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.state import RouterState
from kvduplex.router.wire import WirePool
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P
from tests.unit.test_router import _chunk

T = TypeVar("T")

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0.0,
        "return_token_ids": True}  # fmt: skip
BOUND_S = 10.0
"""A bound for a failing run only: what never comes would be waited for here."""
KV_WAIT_S = 5.0
"""D's own deadline for pushed KV (an instance's kv_wait_timeout_s): D computes the prompt
then even if the router never told it that P failed. Only a failing run waits it out."""
NOT_HTTP = b"SSH-2.0-OpenSSH_9.6\r\n"
"""What a port that another process took answers: not HTTP."""
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
D_ANSWER_IDS = [104, 105]


async def _bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, BOUND_S)


# ------------------------------------------------- servers and the router


@contextlib.asynccontextmanager
async def _socket_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """`handle` serves each connection on a raw socket; yields the server's URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def _web_server(app: web.Application) -> AsyncIterator[str]:
    """`app` served by aiohttp, each handler cancelled when its client's connection
    closes (as an instance's request is aborted when the router lets go); yields the URL."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def _not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A port that answers a request with something that is not HTTP."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(NOT_HTTP)
    await writer.drain()
    writer.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body as it came on the socket."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
              if line.lower().startswith(b"content-length:")]  # fmt: skip
    return head, await reader.readexactly(length[0]) if length else b""


def _answer_then_hold(
    answer: bytes, router_left: asyncio.Event
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A raw server's handler: reads one request, writes `answer`, then holds the
    connection until the router lets go of it (and sets `router_left`)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the router lets go of the connection
        router_left.set()
        writer.close()

    return serve


@contextlib.asynccontextmanager
async def _router(
    config: RouterConfig, transport: httpx.MockTransport | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, RouterState]]:
    """The router's app in process (no lifespan: no prober) over fake instances served by
    `transport`'s handler (None: the network, through the router's own client); its
    client closed at the end, once D's cancels sent from a callback have ended."""
    make_client = None if transport is None else mock_instances(transport.handler)
    state = RouterState.create(config, ByteTokenizer(), make_client=make_client)
    app = httpx.ASGITransport(app=create_router_app(state), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(
            transport=app, base_url="http://router", timeout=BOUND_S
        ) as client:
            yield client, state
    finally:
        await _bounded(asyncio.gather(*push_flow._CANCELS, return_exceptions=True))
        await state.aclose()
        state.prompts.shutdown(wait=False)


def _decode_only(url: str) -> RouterConfig:
    return RouterConfig(prefill=(), decode=(url,))


def _events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]


def _tokens(events: list[str]) -> list[int]:
    chunks = [json.loads(data) for data in events if data != "[DONE]"]
    return [t for c in chunks if "choices" in c for t in c["choices"][0]["token_ids"]]


def _all_idle(state: RouterState) -> bool:
    backends = (*state.policy.prefill.backends, *state.policy.decode.backends)
    return all(b.in_flight == 0 for b in backends)


# ------------------------------------------------- an answer that is not HTTP


def test_a_port_that_does_not_speak_http_is_a_protocol_error_for_every_call() -> None:
    """A probe (`WirePool.get`) and the flows' POSTs (whole or streamed) to a port that
    answers something other than HTTP fail with `client.RemoteProtocolError`."""

    async def run() -> None:
        pool = WirePool({}, BOUND_S, BOUND_S)
        try:
            async with _socket_server(_not_http) as url:
                with pytest.raises(rc.RemoteProtocolError):  # as the prober calls
                    await pool.get(url + "/ready", BOUND_S)
                with pytest.raises(rc.RemoteProtocolError):
                    await pool.post_whole(url + "/internal/push/prefill", b"{}")
                with pytest.raises(rc.RemoteProtocolError):
                    await pool.post_stream(url + "/internal/push/prefill", b"{}")
        finally:
            pool.close()

    asyncio.run(run())


@pytest.mark.parametrize("how", ["parts", "read"])
def test_a_stream_whose_chunk_is_not_http_fails_its_read(how: str) -> None:
    """D's stream sends one event, then a chunk header that is not HTTP: the flows' stream
    (`WirePool.post_stream`), read part by part as the relay reads it, gives the event,
    then fails with `client.RemoteProtocolError` (it does not wait for more); read whole,
    it fails alike; either way its connection is closed."""
    router_left = asyncio.Event()
    event_then_garbage = _answer_then_hold(
        CHUNKED_HEAD + b"7\r\ndata: 1\r\nzz-not-a-size\r\n", router_left
    )

    async def run() -> None:
        pool = WirePool({}, BOUND_S, BOUND_S)
        try:
            async with _socket_server(event_then_garbage) as url:
                resp = await pool.post_stream(url + "/v1/completions", b"{}")
                assert resp.status_code == 200
                got = b""
                with pytest.raises(rc.RemoteProtocolError):
                    if how == "read":
                        await resp.read()
                    async for part in resp:
                        got += part
                assert got == (b"" if how == "read" else b"data: 1")
                await _bounded(router_left.wait())
                await resp.aclose()
        finally:
            pool.close()

    asyncio.run(run())


def test_a_prefill_port_that_does_not_speak_http_is_a_failed_prefill() -> None:
    """Push, streamed: P's port answers something that is not HTTP. P's prefill failed:
    the router tells D at once (D computes the prompt itself, here only once told), and
    the client gets D's whole stream, not one that breaks off."""
    told = asyncio.Event()
    cancels: list[dict[str, Any]] = []
    decode_bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        decode_bodies.append(await request.json())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)  # the head at once; the first token once computed
        with contextlib.suppress(TimeoutError):  # D's own deadline: a failing run only
            await asyncio.wait_for(told.wait(), KV_WAIT_S)
        for i, tok in enumerate(D_ANSWER_IDS):
            finish = "length" if i == len(D_ANSWER_IDS) - 1 else None
            choice = {"index": 0, "text": chr(tok), "token_ids": [tok], "finish_reason": finish}
            await resp.write(f"data: {_chunk(choice)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def cancel(request: web.Request) -> web.Response:
        cancels.append(await request.json())
        told.set()
        return web.json_response({"xid": cancels[-1]["xid"], "cancelled": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/internal/push/cancel", cancel)

    async def run() -> None:
        async with _socket_server(_not_http) as p_url, _web_server(app) as d_url:
            config = RouterConfig(prefill=(p_url,), decode=(d_url,), mode=TransferMode.PUSH)
            async with _router(config) as (client, state):
                resp = await client.post("/v1/completions", json={**BODY, "stream": True})
                assert resp.status_code == 200, resp.text
                events = _events(resp)
                assert events[-1:] == ["[DONE]"], f"a stream that broke off: {resp.text!r}"
                assert not any('"error"' in e for e in events), resp.text
                assert _tokens(events) == D_ANSWER_IDS
                assert _all_idle(state)
        (d_body,) = decode_bodies
        (told_d,) = cancels
        assert told_d == {"xid": d_body["kv_transfer_params"]["xid"], "reason": "prefill failed"}

    asyncio.run(run())


# ------------------------------------------------- D's refusals, relayed whole


D_ERROR = {"error": {"message": "the engine loop ended: boom", "type": "server_error",
                     "param": None, "code": "engine_dead"}}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("status", [500, 503])
def test_a_decode_refusal_reaches_the_client_with_its_body(status: int, stream: bool) -> None:
    """D answers a 500, or a 503 that is not a drain (its engine died): over the router's
    own client the client gets the same status and D's OpenAI error JSON (a 503's body,
    read to tell it from a drain, is relayed as it was read)."""
    refused: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        refused.append(await request.json())
        return web.json_response(D_ERROR, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)

    async def run() -> None:
        async with _web_server(app) as d_url, _router(_decode_only(d_url)) as (client, state):
            resp = await client.post("/v1/completions", json={**BODY, "stream": stream})
            assert resp.status_code == status
            assert resp.headers["content-type"].startswith("application/json")
            assert resp.content, "D's body was lost"
            assert resp.json() == D_ERROR
            assert state.policy.decode.backends[0].is_healthy, "a refusal, not a failure"
            assert _all_idle(state)
        assert len(refused) == 1, "D was asked once: a refusal is not routed again"

    asyncio.run(run())


# ------------------------------------------------- a whole answer cut short


def test_a_whole_answer_cut_mid_body_is_a_502() -> None:
    """D sends a whole answer's head and part of its body, then its connection closes (D
    died while sending it): the client gets a 502 with the OpenAI error (code
    ``decode_failed``), not a 200 with part of a body; the body cut short is a read
    error."""

    async def head_then_cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b'content-length: 400\r\n\r\n{"id": "cmpl-x", "choi')  # fmt: skip
        await writer.drain()
        writer.close()

    async def run() -> None:
        async with (
            _socket_server(head_then_cut) as d_url,
            _router(_decode_only(d_url)) as (client, state),
        ):
            resp = await client.post(
                "/v1/completions", json=BODY, headers={"x-request-id": "client-7"}
            )
            assert resp.status_code == 502, resp.text
            assert resp.headers["content-type"] == "application/json"
            assert resp.headers["x-request-id"] == "client-7"  # echoed on the 502 too
            error = resp.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "decode_failed")
            message = f"decode at {d_url} failed mid-answer: RemoteProtocolError"
            assert message in error["message"]
            errors = state.registry.get_sample_value("kvduplex_router_stream_errors_total")
            assert errors == 1
            assert _all_idle(state)

    asyncio.run(run())


# ------------------------------------------------- push: D told at once that P failed


def _draining_refusal() -> httpx.Response:
    error = {"error": {"message": "draining", "type": "server_error", "param": None,
                       "code": "draining"}}  # fmt: skip
    return httpx.Response(503, json=error)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prefill_refused_at_once_is_told_to_decode_before_it_answers(stream: bool) -> None:
    """Push: P refuses the prefill at once (it drains). D waits for pushed KV until the
    router tells it that P failed, and only then computes the prompt and answers; the
    router tells it while D's answer is still to come: a stream's first event, and a
    whole answer's head (which D sends only once it generated all of it)."""
    told = asyncio.Event()
    order: list[str] = []
    fake = FakeInstances(answer_ids=D_ANSWER_IDS)

    async def computed() -> None:
        with contextlib.suppress(TimeoutError):  # D's own deadline: a failing run only
            await asyncio.wait_for(told.wait(), KV_WAIT_S)
        order.append("answered")

    async def after_computed(parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        await computed()
        async for part in parts:
            yield part

    async def handle(request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if url == P + "/internal/push/prefill":
            return _draining_refusal()
        if url == D + "/internal/push/cancel":
            order.append("told: " + json.loads(request.content)["reason"])
            told.set()
        elif url == D + "/v1/completions" and stream:  # the head at once, as D sends it
            answer = await fake.handle(request)
            return httpx.Response(
                200, headers=answer.headers, content=after_computed(answer.aiter_raw())
            )
        elif url == D + "/v1/completions":
            await computed()
        return await fake.handle(request)

    async def run() -> None:
        config = RouterConfig(prefill=(P,), decode=(D,), mode=TransferMode.PUSH)
        async with _router(config, httpx.MockTransport(handle)) as (client, state):
            resp = await client.post("/v1/completions", json={**BODY, "stream": stream})
            assert resp.status_code == 200, resp.text
            if stream:
                assert _tokens(_events(resp)) == D_ANSWER_IDS
            else:
                assert resp.json()["choices"][0]["token_ids"] == D_ANSWER_IDS
            assert _all_idle(state)
        assert order == ["told: prefill failed", "answered"]
        (cancel,) = fake.bodies(D + "/internal/push/cancel")
        (d_body,) = fake.bodies(D + "/v1/completions")
        assert cancel["xid"] == d_body["kv_transfer_params"]["xid"]
        assert not fake.bodies(P + "/internal/push/cancel"), "D took the request"

    asyncio.run(run())


# ------------------------------------------------- pull: P's lease when D refuses


LEASE = {"block_ids": [0, 1, 2], "num_tokens": 40, "lease_s": 30.0}
NO_MODEL = {"error": {"message": "the model 'gpt-4o' does not exist", "param": "model",
                      "type": "invalid_request_error", "code": "model_not_found"}}  # fmt: skip


def _pull_fake(
    decode_answer: Callable[[], httpx.Response] | None,
) -> tuple[FakeInstances, Callable[[httpx.Request], Coroutine[Any, Any, httpx.Response]]]:
    """P leases its blocks for D's READ; D answers `decode_answer()` (None: its whole
    answer)."""
    fake = FakeInstances(answer_ids=D_ANSWER_IDS)

    async def handle(request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if url == P + "/internal/prefill":
            fake.calls.append((url, json.loads(request.content), request.headers))
            return httpx.Response(200, json={"xid": fake.calls[-1][1]["xid"], **LEASE})
        if url == P + "/internal/release":
            fake.calls.append((url, json.loads(request.content), request.headers))
            return httpx.Response(200, json={})
        if url == D + "/v1/completions" and decode_answer is not None:
            fake.calls.append((url, json.loads(request.content), request.headers))
            return decode_answer()
        return await fake.handle(request)

    return fake, handle


@pytest.mark.parametrize("status,error", [(404, NO_MODEL), (400, D_ERROR)], ids=["404", "400"])
def test_pull_releases_ps_lease_when_decode_refuses(status: int, error: dict[str, Any]) -> None:
    """Pull: P prefilled and leased its blocks; D refuses the request (an unknown model,
    say) before it reads anything. The router releases P's lease at once (the xid D was
    given), and the client gets D's refusal."""
    fake, handle = _pull_fake(lambda: httpx.Response(status, json=error))

    async def run() -> None:
        config = RouterConfig(prefill=(P,), decode=(D,), mode=TransferMode.PULL)
        async with _router(config, httpx.MockTransport(handle)) as (client, state):
            resp = await client.post("/v1/completions", json=BODY)
            assert resp.status_code == status and resp.json() == error
            assert _all_idle(state)
        (prefill,) = fake.bodies(P + "/internal/prefill")
        (d_body,) = fake.bodies(D + "/v1/completions")
        assert d_body["kv_transfer_params"]["xid"] == prefill["xid"]
        assert fake.bodies(P + "/internal/release") == [{"xid": prefill["xid"]}]

    asyncio.run(run())


def _read_error() -> httpx.Response:
    raise httpx.ReadError("the connection closed before the answer's head")


@pytest.mark.parametrize(
    "answer,status", [(None, 200), (_read_error, 502)], ids=["answered", "failed_before_its_head"]
)
def test_pull_keeps_ps_lease_when_decode_may_read(
    answer: Callable[[], httpx.Response] | None, status: int
) -> None:
    """Pull: D answers 200 (it read P's blocks), or fails before its head (the router's
    own 502: D may have read, or be reading): no release; the lease runs out on P."""
    fake, handle = _pull_fake(answer)

    async def run() -> None:
        config = RouterConfig(prefill=(P,), decode=(D,), mode=TransferMode.PULL)
        async with _router(config, httpx.MockTransport(handle)) as (client, state):
            resp = await client.post("/v1/completions", json=BODY)
            assert resp.status_code == status, resp.text
            if status == 200:
                assert resp.json()["choices"][0]["token_ids"] == D_ANSWER_IDS
            else:
                assert resp.json()["error"]["code"] == "decode_failed"
            assert _all_idle(state)
        assert len(fake.bodies(D + "/v1/completions")) == 1
        assert fake.bodies(P + "/internal/release") == []

    asyncio.run(run())


# ------------------------------------------------- a client that leaves a whole answer


@contextlib.asynccontextmanager
async def _uvicorn(state: RouterState) -> AsyncIterator[int]:
    """The router's app under uvicorn with httptools, as `serve_router` serves it, on a
    socket bound (and listening) before it starts; yields its port. Stopped at the end."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    config = uvicorn.Config(
        create_router_app(state), http="httptools", lifespan="on", log_level="warning"
    )
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await _bounded(serving)
        sock.close()


async def _post_raw(port: int, body: dict[str, Any]) -> asyncio.StreamWriter:
    """A client's POST of `body` to /v1/completions, on a connection of its own."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(data), data))  # fmt: skip
    await writer.drain()
    return writer


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_a_client_leaving_a_whole_answer_closes_the_routers_call_to_decode(
    mode: TransferMode, caplog: pytest.LogCaptureFixture
) -> None:
    """Under uvicorn (httptools): 1. a client that stays gets D's whole answer; 2. a client
    that leaves before D's whole answer came: the router closes its call to D (D's
    handler is cancelled, as an instance then aborts the request) instead of waiting for
    an answer nobody will read; no error is logged."""
    d_started = asyncio.Event()
    d_cancelled = asyncio.Event()
    release = asyncio.Event()  # D's answer, for a failing run's end only

    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prefill(request: web.Request) -> web.Response:
        xid = (await request.json())["xid"]
        if request.path == "/internal/push/prefill":
            return web.json_response({"xid": xid, "first_token": D_ANSWER_IDS[0]})
        return web.json_response({"xid": xid, "block_ids": [0], "num_tokens": 2})

    async def other(_: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        if body["prompt"] == "leave":
            d_started.set()
            try:
                await release.wait()
            except asyncio.CancelledError:
                d_cancelled.set()
                raise
        choice = {"index": 0, "text": "hi", "token_ids": D_ANSWER_IDS, "finish_reason": "length"}
        return web.json_response({"id": "cmpl-x", "choices": [choice]})

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_post("/internal/push/prefill", prefill)
    app.router.add_post("/internal/prefill", prefill)
    app.router.add_post("/internal/push/cancel", other)
    app.router.add_post("/internal/release", other)
    app.router.add_post("/v1/completions", completions)

    async def run() -> None:
        async with _web_server(app) as url:
            config = RouterConfig(prefill=(url,), decode=(url,), mode=mode, health_interval_s=60)
            state = RouterState.create(config, ByteTokenizer())
            async with _uvicorn(state) as port:
                try:
                    async with httpx.AsyncClient(timeout=BOUND_S) as client:  # 1.
                        resp = await client.post(f"http://127.0.0.1:{port}/v1/completions",
                                                 json={**BODY, "prompt": "stay"})  # fmt: skip
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["choices"][0]["token_ids"] == D_ANSWER_IDS
                    writer = await _post_raw(port, {**BODY, "prompt": "leave"})  # 2.
                    await _bounded(d_started.wait())
                    writer.close()
                    await writer.wait_closed()
                    await _bounded(d_cancelled.wait())  # else: D's call was never closed
                finally:
                    release.set()  # else the server's stop would wait for D's answer
            assert _all_idle(state)  # the server stopped: the request's task has ended

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
