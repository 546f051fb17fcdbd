"""A request's outputs on their way from the engine thread to its asyncio caller.

`AsyncEngine.generate` opens one `OutputStream` per request; the engine thread hands
it each output (or the error that ends it) with `deliver`, which crosses to the
stream's event loop, and counts what the instance's metrics see of it (`observe`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.outputs import RequestOutput


@dataclass
class OutputStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrival: float
    first_token_time: float | None = None


def deliver(stream: OutputStream, item: RequestOutput | BaseException) -> None:
    """Hand `item` to a stream's asyncio loop (nothing if that loop has closed)."""
    with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads the stream
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def observe(metrics: EngineMetrics, stream: OutputStream, out: RequestOutput, now: float) -> None:
    """Count `out`, the stream's latest output at time `now`, in `metrics` (engine thread):
    TTFT at its first token; tokens, finish reason, end-to-end time and TPOT at its end."""
    m = metrics
    if stream.first_token_time is None and out.new_token_ids:
        stream.first_token_time = now
        m.ttft.observe(now - stream.arrival)
    m.generation_tokens.inc(len(out.new_token_ids))
    if out.finished:
        m.prompt_tokens.inc(out.num_prompt_tokens)
        m.prefix_cache_hit_tokens.inc(out.num_local_cached_tokens)
        m.prompt_computed_tokens.observe(out.num_prompt_computed_here)
        m.requests_finished.labels(reason=out.finish_reason or "unknown").inc()
        m.e2e.observe(now - stream.arrival)
        if stream.first_token_time is not None and out.num_output_tokens > 1:
            m.tpot.observe((now - stream.first_token_time) / (out.num_output_tokens - 1))
