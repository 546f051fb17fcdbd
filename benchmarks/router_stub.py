"""The stub instances of `bench_router_capacity.py`: P and D on one asyncio HTTP/1.1
server (keep-alive, two ports), answering what the router asks in push mode as the
instances would (bodies built with `kvduplex.common.openai.render`), and what the reference
routers ask of a prefill instance; the raw HTTP/1.1 they and the floors read and write."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from benchmarks.timeline import Timeline
from kvduplex.common.openai import render
from kvduplex.common.openai.transcript import ANSWER_IDS_FIELD

FIRST_TOKEN = 65
"""The stub's every token ("A"): P's first token and D's copy of it match."""


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
                method, path, body = await read_request(reader)
                read_at = time.perf_counter()
                if is_prefill and method == "POST" and path == "/v1/completions":
                    self.num_prefills += 1
                    await write_json(writer, _PREFILL_ANSWER)
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
            return await write_json(writer, payload)
        req = json.loads(body) if body else {}
        if path == "/internal/push/prefill":
            self.num_prefills += 1
            await write_json(writer, {"xid": req["xid"], "first_token": FIRST_TOKEN,
                                       "num_cached_tokens": 0})  # fmt: skip
            if self.timeline is not None:
                self.timeline.note_prefill(req, read_at, time.perf_counter())
            return
        if path.startswith("/internal/"):
            return await write_json(writer, {"xid": req.get("xid", "")})
        if path != "/v1/completions" or not req.get("stream"):
            return await write_json(writer, {"error": {"message": "stub: not served"}}, 404)
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


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
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


async def write_json(writer: asyncio.StreamWriter, payload: Any, status: int = 200) -> None:
    body = json.dumps(payload).encode()
    writer.write(
        b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (status, len(body), body)
    )
    await writer.drain()
