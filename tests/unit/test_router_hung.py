"""The router over instances that hang with their connections open (stopped, partitioned):
once `health_failures` probes in a row fail and the router marks such an instance
unhealthy, every call in flight to it is abandoned. A prefill ends as failed (decode
computes the prompt), a decode stream ends with an error event, a decode that has not
answered is a 502. Fakes over httpx MockTransport, and one decode instance over a real
socket, which shows that the router lets go of the connection.

The app runs without its lifespan (httpx ASGITransport), so no probe runs but the ones a
test makes itself (`probe_all`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import TypeVar

import httpx
import pytest

from kvduplex.common.config import TransferMode
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import probe_all
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P
from tests.unit.test_router import _chunk

T = TypeVar("T")

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0.0,
        "return_token_ids": True}  # fmt: skip
BOUND_S = 10.0
"""A bound for a failing run only: a call that is never abandoned would wait here."""


@dataclass
class HangingInstances(FakeInstances):
    """P and D as `FakeInstances`, which can hang. Push: D's stream begins once the router
    cancels the push if `waits_for_kv` (as D computes the prompt itself then)."""

    hung: set[str] = field(default_factory=set)
    """Instances whose probes time out and whose calls never answer."""
    silent_after: int | None = None
    """D's stream sends this many events, then nothing, its connection open."""
    waits_for_kv: bool = False
    called: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a hung instance gets a call."""
    silent: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when D's stream went silent."""
    push_cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        body = json.loads(request.content) if request.content else {}
        if base in self.hung:
            if request.url.path in ("/health", "/ready"):
                raise httpx.ReadTimeout("timed out", request=request)
            self.calls.append((str(request.url), body, request.headers))
            self.called.set()
            await asyncio.Event().wait()  # no answer: ends when the router cancels the call
        if str(request.url) == D + "/internal/push/cancel":
            self.push_cancelled.set()
        if base == D and request.url.path.startswith("/v1/") and body.get("stream"):
            self.calls.append((str(request.url), body, request.headers))
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, headers=headers, stream=_DecodeStream(self))
        return await super().handle(request)


class OpenStream(httpx.AsyncByteStream):
    """A body on an open connection. Closing the response ends a read that waits
    (`_until`) with `httpx.ReadError`, as closing a socket does (see
    `test_a_silent_decode_over_a_socket`)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def _until(self, event: asyncio.Event) -> None:
        waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.closed.wait())}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self.closed.is_set():
            raise httpx.ReadError("connection closed")

    async def aclose(self) -> None:
        self.closed.set()


class _DecodeStream(OpenStream):
    """D's answer on an open connection (`OpenStream`)."""

    def __init__(self, fake: HangingInstances) -> None:
        super().__init__()
        self.fake = fake

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.fake.waits_for_kv:
            await self._until(self.fake.push_cancelled)
        ids = self.fake.answer_ids
        for i, tok in enumerate(ids):
            if i == self.fake.silent_after:
                self.fake.silent.set()
                await self._until(asyncio.Event())
            finish = "length" if i == len(ids) - 1 else None
            choice = {"index": 0, "text": chr(tok), "token_ids": [tok], "finish_reason": finish}
            yield f"data: {_chunk(choice)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _state(
    transport: httpx.MockTransport | None,
    prefill: tuple[str, ...] = (P,),
    decode: tuple[str, ...] = (D,),
    **config: Any,
) -> RouterState:
    cfg = RouterConfig(prefill=prefill, decode=decode, **config)
    make_client = None if transport is None else mock_instances(transport.handler)
    return RouterState.create(cfg, ByteTokenizer(), make_client=make_client)


async def _serve(state: RouterState, body: dict[str, Any]) -> httpx.Response:
    """`body` through the router's app (no lifespan: no prober)."""
    app = httpx.ASGITransport(app=create_router_app(state))
    async with httpx.AsyncClient(transport=app, base_url="http://router") as client:
        return await client.post("/v1/completions", json=body, timeout=BOUND_S)


async def _probe(state: RouterState, timeout_s: float = 1.0) -> None:
    await probe_all(state.client, state.policy, timeout_s)


async def _bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, BOUND_S)


def _events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]


def _tokens(events: list[str]) -> list[int]:
    chunks = [json.loads(data) for data in events if data != "[DONE]"]
    return [t for c in chunks if "choices" in c for t in c["choices"][0]["token_ids"]]


def _stream_errors(state: RouterState) -> float | None:
    return state.registry.get_sample_value("kvduplex_router_stream_errors_total")


# ------------------------------------------------- prefill hangs


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_a_hung_prefill_call_fails_once_probes_mark_it_and_decode_computes(
    mode: TransferMode,
) -> None:
    """1. P gets the prefill call and never answers; 2. one failed probe: P stays healthy,
    the call goes on; 3. the second marks P unhealthy: the call is abandoned, D computes the
    prompt (push: the router cancels the push on D first) and the answer is whole."""
    fake = HangingInstances(
        hung={P}, answer_ids=[65, 66, 67], waits_for_kv=mode is TransferMode.PUSH
    )

    async def run() -> None:
        state = _state(httpx.MockTransport(fake.handle), mode=mode)
        p = state.policy.prefill.backends[0]
        answer = asyncio.create_task(_serve(state, {**BODY, "stream": True}))
        await _bounded(fake.called.wait())  # 1.
        await _probe(state)  # 2.
        assert p.is_healthy and p.in_flight == 1 and not answer.done()
        await _probe(state)  # 3.
        assert not p.is_healthy
        resp = await _bounded(answer)
        assert resp.status_code == 200, resp.text
        events = _events(resp)
        assert events[-1] == "[DONE]" and _tokens(events) == [65, 66, 67]
        assert p.in_flight == 0 and state.policy.decode.backends[0].in_flight == 0
        (d_body,) = fake.bodies(D + "/v1/completions")
        if mode is TransferMode.PUSH:
            cancels = fake.bodies(D + "/internal/push/cancel")
            assert [c["reason"] for c in cancels] == ["prefill failed"]
            assert d_body["kv_transfer_params"]["mode"] == "push"
        else:
            assert d_body["kv_transfer_params"]["mode"] == "local", "D computes the prompt"
        await state.aclose()

    asyncio.run(run())


# ------------------------------------------------- decode hangs


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_a_decode_stream_gone_silent_ends_with_an_error_once_probes_mark_it(
    mode: TransferMode,
) -> None:
    """1. D's stream sends two tokens, then nothing; 2. one failed probe: the stream goes
    on; 3. the second marks D unhealthy: the client's stream ends with the error event and
    [DONE], each token sent once."""
    fake = HangingInstances(answer_ids=[65, 66, 67, 68], silent_after=2)

    async def run() -> None:
        state = _state(httpx.MockTransport(fake.handle), mode=mode)
        d = state.policy.decode.backends[0]
        answer = asyncio.create_task(_serve(state, {**BODY, "max_tokens": 4, "stream": True}))
        await _bounded(fake.silent.wait())  # 1.
        fake.hung.add(D)
        await _probe(state)  # 2.
        assert d.is_healthy and d.in_flight == 1 and not answer.done()
        await _probe(state)  # 3.
        resp = await _bounded(answer)
        events = _events(resp)
        assert resp.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "decode_failed")
        assert f"decode at {D} failed mid-answer" in error["message"]
        assert "marked unhealthy" in error["message"]
        assert _tokens(events[:-2]) == [65, 66]
        assert _stream_errors(state) == 1
        assert d.in_flight == 0 and not d.is_healthy
        assert all(p.in_flight == 0 for p in state.policy.prefill.backends)
        await state.aclose()

    asyncio.run(run())


def test_a_decode_that_never_answers_is_a_502_once_probes_mark_it() -> None:
    """Push, not streamed: P answers, D never does; once D is marked the client gets a 502
    and the router cancels P's push."""
    fake = HangingInstances(hung={D})

    async def run() -> None:
        state = _state(httpx.MockTransport(fake.handle))
        answer = asyncio.create_task(_serve(state, BODY))
        await _bounded(fake.called.wait())
        await _probe(state)
        assert not answer.done()
        await _probe(state)
        resp = await _bounded(answer)
        assert resp.status_code == 502, resp.text
        error = resp.json()["error"]
        assert error["code"] == "decode_failed" and "marked unhealthy" in error["message"]
        cancels = fake.bodies(P + "/internal/push/cancel")
        assert [c["reason"] for c in cancels] == ["decode refused the request"]
        backends = (*state.policy.prefill.backends, *state.policy.decode.backends)
        assert all(b.in_flight == 0 for b in backends)
        await state.aclose()

    asyncio.run(run())


# ------------------------------------------------- a real socket


@dataclass
class _SocketInstance:
    """P and D on one real socket. D's stream sends one token, then nothing: its /health
    then never answers either. `router_closed` is set when the router closes the stream's
    connection."""

    went_silent: asyncio.Event = field(default_factory=asyncio.Event)
    router_closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        path = head.split(" ", 2)[1]
        length = [int(line.split(":")[1]) for line in head.split("\r\n")
                  if line.lower().startswith("content-length:")]  # fmt: skip
        body = json.loads(await reader.readexactly(length[0])) if length else {}
        if path in ("/health", "/ready"):
            if self.went_silent.is_set():
                await reader.read()  # no answer until the prober lets go
            else:
                self._answer(writer, {"status": "ok"})
        elif path == "/internal/push/prefill":
            self._answer(writer, {"xid": body["xid"], "first_token": 65})
        elif path == "/internal/push/cancel":
            self._answer(writer, {"xid": body["xid"], "cancelled": True})
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
            choice = {"index": 0, "text": "A", "token_ids": [65], "finish_reason": None}
            event = f"data: {_chunk(choice)}\n\n".encode()
            for _ in range(2):  # push: D's copy of P's token, then one token of its own
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            self.went_silent.set()
            if not await reader.read():  # EOF: the router let go of the connection
                self.router_closed.set()
        await writer.drain()
        writer.close()

    @staticmethod
    def _answer(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip


@pytest.mark.parametrize("mode", ["decode", "push"])
def test_a_silent_decode_over_a_socket_ends_the_stream_and_is_let_go(mode: str) -> None:
    """D (and, in push mode, P) over a real socket: D's stream goes silent mid-answer and
    its /health stops answering. Two probes time out, and the client's stream ends with
    the error event; the router closes D's connection (no CLOSE-WAIT left behind)."""
    instance = _SocketInstance()

    async def run() -> None:
        server = await asyncio.start_server(instance.serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            prefill = (url,) if mode == "push" else ()
            state = _state(None, prefill=prefill, decode=(url,))
            answer = asyncio.create_task(_serve(state, {**BODY, "stream": True}))
            await _bounded(instance.went_silent.wait())
            for _ in range(2):
                await _probe(state, timeout_s=0.2)
            resp = await _bounded(answer)
            events = _events(resp)
            assert events[-1] == "[DONE]", events
            assert json.loads(events[-2])["error"]["code"] == "decode_failed"
            assert _tokens(events[:-2]) == [65, 65]
            await _bounded(instance.router_closed.wait())
            assert state.policy.decode.backends[0].in_flight == 0
            await state.aclose()

    asyncio.run(run())
