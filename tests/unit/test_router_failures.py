"""The router in process over failing fake instances (`tests.support.fake_instances`): a decode
instance that cannot be reached (routed around, then 503, and taken back by a probe),
and one that dies mid-answer (the stream ends with an error event)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient
from httpx_sse import connect_sse

from kvduplex.common.config import TransferMode
from kvduplex.common.openai import render
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.client import StreamedAnswer
from kvduplex.router.config import RouterConfig
from kvduplex.router.relay import FirstToken
from kvduplex.router.relay import push_stream
from kvduplex.router.relay import relay
from kvduplex.router.state import RouterState
from kvduplex.router.wire import WirePool
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P
from tests.unit.test_router import _chunk
from tests.unit.test_router import _metric

D1 = "http://d1"
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0.0,
        "return_token_ids": True}  # fmt: skip


@dataclass
class FailingInstances(FakeInstances):
    """`unreachable`: URLs whose calls are refused (probes answer, as from a process whose
    port is closed to us only); `cut_after`: D's stream dies after this many events."""

    unreachable: set[str] = field(default_factory=set)
    cut_after: int | None = None
    num_errors: int = 0
    """D answers this many requests with a 500 (one request's failure), then serves."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if base in self.unreachable and request.url.path not in ("/health", "/ready"):
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path.startswith("/v1/") and self.num_errors > 0:
            self.num_errors -= 1
            self.calls.append((str(request.url), json.loads(request.content), request.headers))
            error = {"error": {"message": "boom", "type": "server_error", "param": None,
                               "code": "internal_error"}}  # fmt: skip
            return httpx.Response(500, json=error)
        return await super().handle(request)

    async def _stream(self, mark: bool = False) -> AsyncIterator[bytes]:
        for i, tok in enumerate(self.answer_ids):
            if self.cut_after is not None and i == self.cut_after:
                yield b'data: {"id": "cmpl-x", "cho'  # half an event, then the connection dies
                raise httpx.ReadError("peer closed the connection")
            choice = {"index": 0, "text": chr(tok), "token_ids": [tok], "finish_reason": None}
            yield f"data: {_chunk(choice)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _router(
    fake: FakeInstances, decode: tuple[str, ...] = (D,), **config: Any
) -> tuple[TestClient, RouterState]:
    cfg = RouterConfig(prefill=(P,), decode=decode, health_interval_s=60.0, **config)
    state = RouterState.create(cfg, ByteTokenizer(), make_client=mock_instances(fake.handle))
    return TestClient(create_router_app(state)), state


# ------------------------------------------------- decode unreachable


def test_a_push_routed_again_notes_prefills_answer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """P answers both prefills of a push whose first decode was unreachable: the answer's
    hit is noted by the flow that served it, not by the abandoned one too."""
    from kvduplex.router import push_flow

    noted: list[int] = []
    monkeypatch.setattr(push_flow, "note_answer_hit", lambda state, fwd, n: noted.append(n))
    fake = FailingInstances(unreachable={D})
    client, _ = _router(fake, decode=(D, D1), mode=TransferMode.PUSH)
    with client:
        r = client.post("/v1/completions", json=BODY, headers={"x-session-id": "s"})
        assert r.status_code == 200, r.text
        assert _metric(client, "kvduplex_router_rerouted_total") == 1
    assert len(fake.bodies(P + "/internal/push/prefill")) == 2
    assert len(noted) == 1


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_unreachable_decode_is_routed_around_then_503_when_none_is_left(
    mode: TransferMode,
) -> None:
    fake = FailingInstances(unreachable={D})
    client, state = _router(fake, decode=(D, D1), mode=mode)
    with client:
        r = client.post("/v1/completions", json=BODY, headers={"x-session-id": "s"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == fake.answer_ids
        assert _metric(client, "kvduplex_router_instance_healthy", url=D, role="decode") == 0
        assert _metric(client, "kvduplex_router_instance_healthy", url=D1, role="decode") == 1
        assert _metric(client, "kvduplex_router_rerouted_total") == 1
        session = state.policy.sessions.get("s", state.policy.clock())
        assert session is not None and session.decode_url == D1, "the session moved"
        if mode is TransferMode.PUSH:
            assert len(fake.bodies(P + "/internal/push/cancel")) == 1, "the first push undone"
        else:
            assert len(fake.bodies(P + "/internal/release")) == 1, "the first lease released"
        r = client.post("/v1/completions", json=BODY, headers={"x-session-id": "s"})
        assert r.status_code == 200 and _metric(client, "kvduplex_router_rerouted_total") == 1
        fake.unreachable.add(D1)
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_healthy_instance"
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and _metric(client, "kvduplex_router_unavailable_total") == 2
        assert client.get("/v1/models").status_code == 503
    assert all(b.in_flight == 0 for b in state.policy.decode.backends)
    assert all(b.in_flight == 0 for b in state.policy.prefill.backends)


def test_probes_take_an_instance_back() -> None:
    fake = FailingInstances()
    client, state = _router(fake, decode=(D, D1))
    d0 = state.policy.decode.backends[0]
    with client:
        state.policy.decode.mark_failed(d0, state.policy.clock())
        assert _metric(client, "kvduplex_router_instance_healthy", url=D, role="decode") == 0
        client.portal.call(_probe_all, state)  # type: ignore[union-attr]
        assert _metric(client, "kvduplex_router_instance_healthy", url=D, role="decode") == 1


async def _probe_all(state: RouterState) -> None:
    from kvduplex.router.health import probe_all

    await probe_all(state.client, state.policy, 1.0)


# ------------------------------------------------- one request's 5xx


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_a_5xx_answer_keeps_the_instance_in_rotation(mode: TransferMode) -> None:
    """The only decode instance answers one request with a 500: that client gets the 500,
    and the next request still goes to it (no 503 until the next probe)."""
    fake = FailingInstances(num_errors=1)
    client, state = _router(fake, mode=mode)
    with client:
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert _metric(client, "kvduplex_router_instance_healthy", url=D, role="decode") == 1
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == fake.answer_ids
    assert len(fake.bodies(D + "/v1/completions")) == 2, "both reached the decode instance"
    assert all(b.is_healthy and b.in_flight == 0 for b in state.policy.decode.backends)


# ------------------------------------------------- decode dies mid-answer


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(mode: TransferMode) -> None:
    fake = FailingInstances(answer_ids=[65, 66, 67, 68], cut_after=2)
    client, state = _router(fake, mode=mode)
    body = {**BODY, "max_tokens": 4, "stream": True}
    with client, connect_sse(client, "POST", "/v1/completions", json=body) as src:  # type: ignore[arg-type]
        events = [e.data for e in src.iter_sse()]
        assert _metric(client, "kvduplex_router_stream_errors_total") == 1
        # One stream's failure: D stays in rotation (its probe answers).
        assert _metric(client, "kvduplex_router_instance_healthy", url=D, role="decode") == 1
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "decode_failed"
    assert f"decode at {D} failed mid-answer" in error["message"]
    tokens = [t for data in events[:-2] for t in json.loads(data)["choices"][0]["token_ids"]]
    assert tokens == [65, 66], "what came before the cut, each token once"
    assert state.policy.decode.backends[0].in_flight == 0


@pytest.mark.parametrize("sends_before_leaving", [0, 1, 2, 3])
def test_a_relay_closes_ds_stream_once_however_its_client_leaves(sends_before_leaving: int) -> None:
    """The client's connection fails before the response began (0), after its head (1),
    after the first event (2: the next is sent from the task that sends the rest) or after
    the second (3): the response stops iterating the body, and still closes D's stream and
    reports the route done, once."""
    closed: list[bool] = []
    stream = _SlowToClose()

    async def parts() -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"
        yield b"data: {}\n\n"
        yield b"data: [DONE]\n\n"

    upstream = StreamedAnswer(200, SSE_HEAD, stream)
    response = relay(upstream, parts(), closed.append, "decode at http://d")
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if len(sent) == sends_before_leaving:
            raise OSError("the client left")
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}

    async def serve() -> None:
        with contextlib.suppress(Exception):
            await response(scope, receive, send)  # type: ignore[arg-type]

    anyio.run(serve)
    assert closed == [False]
    assert stream.closed
    assert len(sent) == sends_before_leaving


def test_a_second_cancel_during_a_relays_cleanup_still_reports_the_route_done() -> None:
    """The client leaves while the task that sends the rest waits in `send` (its
    `ClientWatch` cancels the request), and the server's graceful shutdown runs out while
    the cleanup closes the body's parts (uvicorn cancels the request again): the route is
    still reported done, once, and D's stream let go of."""
    closed: list[bool] = []
    stream = _SlowToClose()
    upstream = StreamedAnswer(200, SSE_HEAD, stream)
    parts_closing = asyncio.Event()

    async def parts() -> AsyncIterator[bytes]:
        try:
            yield b"data: {}\n\n"
            yield b"data: {}\n\n"
            await asyncio.Event().wait()  # D has more to send
            yield b""
        finally:  # its reader stops: an await
            parts_closing.set()
            await asyncio.sleep(0)

    async def run() -> None:
        response = relay(upstream, parts(), closed.append, "decode at http://d")
        second_part, left = asyncio.Event(), asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if len(sent) == 3:  # the second part: the client's socket is full
                second_part.set()
                await asyncio.Event().wait()

        async def receive() -> dict[str, Any]:
            if not left.is_set():
                await left.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        task = asyncio.create_task(response(scope, receive, send))  # type: ignore[arg-type]
        await second_part.wait()
        left.set()  # the watch cancels the request's task
        await parts_closing.wait()
        task.cancel()  # the shutdown's cancel, while the parts close
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert closed == [False]
    assert stream.released


SSE_HEAD = [(b"content-type", b"text/event-stream")]


class _SlowToClose:
    """D's stream as the router holds it (`client.Body`): closing it lets go of the
    connection, then awaits (`closing` set meanwhile)."""

    def __init__(self) -> None:
        self.closed = False
        self.released = False
        self.closing = asyncio.Event()

    async def next_part(self) -> bytes | None:
        return None

    async def aclose(self) -> None:
        self.released = True
        self.closing.set()
        await anyio.sleep(0)
        self.closed = True


def test_a_client_leaving_mid_stream_still_closes_ds_stream() -> None:
    """The client closes its connection while the router waits for D's next event (as a
    client does right after [DONE]): the body's task is cancelled, once, natively (as
    `ClientWatch` cancels it), and the cleanup must still release D's connection (which
    awaits) and report the route done."""
    closed: list[bool] = []
    stream = _SlowToClose()
    more = asyncio.Event()

    async def parts() -> AsyncIterator[bytes]:
        yield b"data: [DONE]\n\n"
        await more.wait()  # D has not ended its stream yet
        yield b""

    upstream = StreamedAnswer(200, SSE_HEAD, stream)

    async def client_leaves() -> None:
        response = relay(upstream, parts(), closed.append, "decode at http://d")
        got_done = asyncio.Event()

        async def consume() -> None:
            async for _ in response.body_iterator:
                got_done.set()

        task = asyncio.create_task(consume())
        await got_done.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(client_leaves())
    assert closed == [False]
    assert stream.closed


async def _decode_that_holds_its_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, router_closed: asyncio.Event
) -> None:
    """A decode instance over a real socket: one chunk, then [DONE], and the stream's end
    held back; it notes when the router closes the connection."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    choice = {"index": 0, "text": "A", "token_ids": [65], "finish_reason": None}
    for event in (f"data: {_chunk(choice)}\n\n", "data: [DONE]\n\n"):
        writer.write(b"%x\r\n%s\r\n" % (len(event), event.encode()))
    await writer.drain()
    if not await reader.read():  # EOF: the router let go of the connection
        router_closed.set()
    writer.close()


@pytest.mark.parametrize("p_answers_first", [True, False])
def test_a_client_leaving_after_done_lets_go_of_ds_connection(p_answers_first: bool) -> None:
    """The client closes its connection right after [DONE] (as clients do) while the
    router waits for the end of D's stream: the response's listener cancels the body's
    task, and the cleanup must still close D's connection (else it stays ACTIVE in the
    pool and in CLOSE-WAIT on the socket forever)."""
    router_closed = asyncio.Event()
    sent: list[dict[str, Any]] = []
    done_sent = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if b"[DONE]" in message.get("body", b""):
            done_sent.set()

    async def receive() -> dict[str, Any]:
        await done_sent.wait()
        return {"type": "http.disconnect"}

    async def serve() -> None:
        server = await asyncio.start_server(
            lambda r, w: _decode_that_holds_its_stream(r, w, router_closed), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        client = WirePool({}, 5.0, 600.0)
        async with server:
            upstream = await client.post_stream(f"http://127.0.0.1:{port}/v1/completions", b"")
            prefill: asyncio.Future[dict[str, Any] | None] = asyncio.Future()
            prefill.set_result({"first_token": 65} if p_answers_first else None)
            head = render.ResponseHead(request_id="cmpl-x", model="tiny", is_chat=False)
            parts = push_stream(upstream, prefill, FirstToken(head, ByteTokenizer()))  # type: ignore[arg-type]
            response = relay(upstream, parts, lambda failed: None, "decode at test")
            scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
            await response(scope, receive, send)  # type: ignore[arg-type]
            # A bound for a failing run only: a leak would wait here forever.
            await asyncio.wait_for(router_closed.wait(), timeout=10)

    asyncio.run(serve())
    assert any(b"[DONE]" in m.get("body", b"") for m in sent)


def test_a_relayed_streams_head_and_parts_go_to_the_servers_send_in_order() -> None:
    """The head, the first part and the parts after it (sent from a task of their own)
    all go to the one `send` the server gave, in order. The listener never ends the
    stream of a client that stays."""
    upstream = StreamedAnswer(200, SSE_HEAD, _SlowToClose())

    async def parts() -> AsyncIterator[bytes]:
        for event in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            yield event

    closed: list[bool] = []
    response = relay(upstream, parts(), closed.append, "decode at http://d")
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(response(scope, receive, send))  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start"
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"data: [DONE]\n\n", True),
        (b"", False),
    ]  # fmt: skip
    assert closed == [False]
