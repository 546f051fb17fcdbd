"""One failed call fails its own request only: sixteen streams in flight to one decode
instance, one of whose connections is reset mid-answer. That stream ends with the error
event; the other fifteen complete, and the instance stays in rotation unless its health
check says otherwise: the failed call has it probed at once, and only a failed probe
(here `health_failures` 1) presumes it down and abandons its other calls.

Over fake instances (`tests.support.fake_instances`), with the prober running, and over
a real socket (the router's own client; a decode instance that resets one connection),
without it. The app runs without its lifespan (httpx ASGITransport)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import pytest

from kvduplex.common.config import TransferMode
from kvduplex.common.openai.render import FIRST_TOKEN_IDS_FIELD
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.router.app import create_router_app
from kvduplex.router.backends import Backend
from kvduplex.router.backends import BackendPool
from kvduplex.router.backends import Outcome
from kvduplex.router.config import RouterConfig
from kvduplex.router.health import run_prober
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P
from tests.unit.test_router import _chunk

NUM_STREAMS = 16
CUT = 5
"""The stream (by arrival at D) whose connection is reset."""
IDS = [65, 66, 67]
BOUND_S = 10.0
"""A bound for a failing run only: what never comes would be waited for here."""


def _event(tok: int, i: int, mark: bool = False) -> bytes:
    finish = "length" if i == len(IDS) - 1 else None
    chunk = json.loads(_chunk({"index": 0, "text": chr(tok), "token_ids": [tok],
                               "finish_reason": finish}))  # fmt: skip
    if mark:
        chunk[FIRST_TOKEN_IDS_FIELD] = [tok]
    return f"data: {json.dumps(chunk)}\n\n".encode()


HALF_EVENT = b'data: {"id": "cmpl-x", "cho'


@dataclass
class Streams:
    """What the decode instance's streams wait on: all of them begun, and `go` (set once the
    router has dealt with the reset one)."""

    num_begun: int = 0
    all_begun: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)

    def note_begun(self) -> int:
        """This stream's index, by arrival."""
        self.num_begun += 1
        if self.num_begun == NUM_STREAMS:
            self.all_begun.set()
        return self.num_begun - 1


@dataclass
class ResettingDecode(FakeInstances):
    """P and D as `FakeInstances`; D's streams send their first event, then wait: the
    `CUT`th sends half an event and its connection is reset, the others finish on `go`.
    `probe_fails`: D's probes answer 503."""

    streams: Streams = field(default_factory=Streams)
    probe_fails: bool = False
    num_probes: int = 0
    """D's probes."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        is_d = str(request.url).startswith(D)
        if is_d and request.url.path in ("/health", "/ready"):
            self.num_probes += 1
            if self.probe_fails:
                return httpx.Response(503, json={"status": "unhealthy"})
        body = json.loads(request.content) if request.content else {}
        if is_d and request.url.path.startswith("/v1/") and body.get("stream"):
            mark = bool(body["kv_transfer_params"].get("mark_first_token"))
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, headers=headers, content=self._one(mark))
        return await super().handle(request)

    async def _one(self, mark: bool) -> AsyncIterator[bytes]:
        yield _event(IDS[0], 0, mark)
        index = self.streams.note_begun()
        if index == CUT:
            await self.streams.all_begun.wait()
            yield HALF_EVENT
            raise httpx.RemoteProtocolError("connection reset by peer")
        await self.streams.go.wait()
        for i, tok in enumerate(IDS[1:], 1):
            yield _event(tok, i)
        yield b"data: [DONE]\n\n"


def _state(make_client: Any, prefill: tuple[str, ...], decode: str, **config: Any) -> RouterState:
    cfg = RouterConfig(prefill=prefill, decode=(decode,), health_interval_s=60.0, **config)
    return RouterState.create(cfg, ByteTokenizer(), make_client=make_client)


def _note_failed_calls(pool: BackendPool, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """An event set once a call to an instance of `pool` is reported failed (its
    `Outcome.FAILED` noted)."""
    failed = asyncio.Event()
    done = pool.done

    def noting(b: Backend, outcome: Outcome, now: float) -> None:
        done(b, outcome, now)
        if outcome is Outcome.FAILED:
            failed.set()

    monkeypatch.setattr(pool, "done", noting)
    return failed


async def _streams(state: RouterState) -> list[list[str]]:
    """`NUM_STREAMS` streamed requests at once through the router's app; each one's events."""
    app = httpx.ASGITransport(app=create_router_app(state))
    async with httpx.AsyncClient(transport=app, base_url="http://router") as client:

        async def one(i: int) -> list[str]:
            body = {"model": "tiny", "prompt": f"hi {i}", "max_tokens": len(IDS),
                    "temperature": 0.0, "stream": True, "return_token_ids": True}  # fmt: skip
            resp = await client.post("/v1/completions", json=body, timeout=BOUND_S)
            assert resp.status_code == 200, resp.text
            return [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ")]

        return await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))


def _tokens(events: list[str]) -> list[int]:
    chunks = [json.loads(data) for data in events if data != "[DONE]"]
    return [t for c in chunks if "choices" in c for t in c["choices"][0]["token_ids"]]


def _error(events: list[str]) -> dict[str, Any] | None:
    """The stream's error event (then [DONE]), or None if it completed."""
    assert events[-1] == "[DONE]", events
    last = json.loads(events[-2])
    return last.get("error") if isinstance(last, dict) else None


@pytest.mark.parametrize("mode", [TransferMode.PUSH, "decode_only"])
@pytest.mark.parametrize("probe_fails", [False, True], ids=["probe_answers", "probe_fails"])
def test_a_reset_stream_fails_alone_and_has_its_decode_probed(
    mode: TransferMode | str, probe_fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 streams to one D, one reset mid-answer. Probe answers: that stream ends with the
    error event, the 15 others complete, D is probed once more and stays in rotation.
    Probe fails (`health_failures` 1): the health check presumes D down, so the 15 others
    are abandoned, each with the error event that says so."""
    fake = ResettingDecode(answer_ids=IDS)

    async def run() -> None:
        prefill = (P,) if mode is TransferMode.PUSH else ()
        kw: dict[str, Any] = {"mode": mode} if mode is TransferMode.PUSH else {}
        state = _state(mock_instances(fake.handle), prefill, D, health_failures=1, **kw)
        d = state.policy.decode.backends[0]
        failed = _note_failed_calls(state.policy.decode, monkeypatch)
        probed = asyncio.Event()
        note_probe = state.policy.decode.note_probe

        def noting_probe(b: Backend, is_ok: bool, started_at: float, now: float) -> None:
            note_probe(b, is_ok, started_at, now)
            probed.set()

        monkeypatch.setattr(state.policy.decode, "note_probe", noting_probe)
        first_round = asyncio.Event()
        prober = asyncio.create_task(
            run_prober(state.client, state.policy, 60.0, 1.0, on_round=first_round.set)
        )
        await asyncio.wait_for(first_round.wait(), BOUND_S)  # the next one in 60 s
        probed.clear()
        fake.probe_fails = probe_fails
        answers = asyncio.create_task(_streams(state))
        await asyncio.wait_for(failed.wait(), BOUND_S)
        await asyncio.wait_for(probed.wait(), BOUND_S)  # the probe the failure asked for
        fake.streams.go.set()
        results = await asyncio.wait_for(answers, BOUND_S)
        prober.cancel()
        await asyncio.gather(prober, return_exceptions=True)
        await state.aclose()

        errors = [_error(events) for events in results]
        reset = [e for e in errors if e is not None and "RemoteProtocolError" in e["message"]]
        assert len(reset) == 1 and reset[0]["code"] == "decode_failed"
        assert f"decode at {D} failed mid-answer" in reset[0]["message"]
        assert fake.num_probes == 2, "the first round's, and one the failed call asked for"
        others = [(events, e) for events, e in zip(results, errors, strict=True)
                  if e not in reset]  # fmt: skip
        assert len(others) == NUM_STREAMS - 1
        if probe_fails:
            assert all(e is not None and "marked unhealthy" in e["message"] for _, e in others)
            assert not d.is_healthy and d.is_down
        else:
            assert all(e is None and _tokens(events) == IDS for events, e in others)
            assert d.is_healthy and not d.is_down
        assert state.registry.get_sample_value("kvduplex_router_stream_errors_total") == (
            NUM_STREAMS if probe_fails else 1
        )
        assert d.in_flight == 0 and all(p.in_flight == 0 for p in state.policy.prefill.backends)

    asyncio.run(run())


class _SocketDecode:
    """A decode instance on a real socket: each stream sends its first event, then waits;
    the `CUT`th connection is then reset (RST), the others finish on `go`."""

    def __init__(self) -> None:
        self.streams = Streams()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        _write_chunk(writer, _event(IDS[0], 0))
        await writer.drain()
        if self.streams.note_begun() == CUT:
            await self.streams.all_begun.wait()
            _write_chunk(writer, HALF_EVENT)
            await writer.drain()
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # closed with linger 0: a reset
            return
        await self.streams.go.wait()
        for i, tok in enumerate(IDS[1:], 1):
            _write_chunk(writer, _event(tok, i))
        _write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()


def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def test_a_connection_reset_mid_stream_over_a_socket_fails_that_stream_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router's own client to a decode instance over a real socket, 16 streams in
    flight, one connection reset mid-answer: that stream ends with the error event, the
    15 others complete token for token, and D stays in rotation."""
    decode = _SocketDecode()

    async def run() -> None:
        server = await asyncio.start_server(decode.serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            state = _state(None, (), url)
            d = state.policy.decode.backends[0]
            failed = _note_failed_calls(state.policy.decode, monkeypatch)
            answers = asyncio.create_task(_streams(state))
            await asyncio.wait_for(failed.wait(), BOUND_S)
            decode.streams.go.set()
            results = await asyncio.wait_for(answers, BOUND_S)
            await state.aclose()
        errors = [_error(events) for events in results]
        failures = [e for e in errors if e is not None]
        assert len(failures) == 1 and failures[0]["code"] == "decode_failed", failures
        assert f"decode at {url} failed mid-answer" in failures[0]["message"]
        (cut,) = [events for events, e in zip(results, errors, strict=True) if e is not None]
        assert _tokens(cut) == IDS[:1], "what came before the reset, the half event dropped"
        done = [events for events, e in zip(results, errors, strict=True) if e is None]
        assert len(done) == NUM_STREAMS - 1 and all(_tokens(events) == IDS for events in done)
        assert d.is_healthy and not d.is_down and d.in_flight == 0
        assert state.registry.get_sample_value("kvduplex_router_stream_errors_total") == 1

    asyncio.run(run())
