"""The load client of `bench_router_capacity.py`: closed-loop streams of completions on
kept-alive connections (raw asyncio), their events and TTFTs counted; and one relay's
side of the TTFT phase (its TTFTs and its process's CPU)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from benchmarks.timeline import Timeline


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


async def stream_once(
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
                    await stream_once(reader, writer, request, load)
                    continue
                user, k = f"{name}{index}.{k}", k + 1
                named = completion_request({**fields, "user": user})
                sent, ttft = await stream_once(reader, writer, named, load)
                if ttft is not None:
                    timeline.sent[user], timeline.first[user] = sent, sent + ttft
        finally:
            writer.close()

    await asyncio.gather(*(stream(i, pause) for i, pause in enumerate(pauses)))
    return load


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
