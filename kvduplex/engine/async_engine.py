"""Runs an `LLMEngine` in its own thread and streams outputs to asyncio.

Threads: the HTTP server's asyncio loop calls `generate()`/`abort()`; those
only enqueue commands. The engine thread owns the engine: it drains commands,
steps while there is work, and sleeps on an event otherwise (no busy loop).
Outputs travel back with `loop.call_soon_threadsafe`. A client that goes away
(its generator closed or cancelled) aborts its request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any
from typing import TypeVar

from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.engine import RequestRejected
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.request import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; the instance cannot serve."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrival: float
    first_token_time: float | None = None


@dataclass
class _Add:
    request: Request
    on_admit: Callable[[], None] | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


_Command = _Add | _Abort | _Call


class AsyncEngine:
    """Thread-safe front of one engine."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.core = engine
        """The engine this front runs: touch its state only on the engine thread (`call`);
        its constant facts (model, limits) may be read from any thread."""
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvduplex-engine", daemon=True)
        self._error: BaseException | None = None
        if metrics is not None:
            sched, pool = engine.scheduler, engine.block_pool
            metrics.bind_gauges(
                running=lambda: sched.num_running,
                waiting=lambda: sched.num_waiting,
                blocks_in_use=lambda: pool.stats().num_in_use,
                blocks_cached=lambda: pool.stats().num_cached,
                blocks_total=lambda: pool.stats().total,
            )

    # --------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stop.is_set()

    # ------------------------------------------------------------------ public

    async def generate(
        self, request: Request, *, on_admit: Callable[[], None] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes. The engine thread
        owns ``request`` from here on: read its outputs, not its fields.

        `on_admit` runs in the engine thread just before the request is added,
        with nothing else in between; a ValueError from it rejects the request.

        Raises RequestRejected for requests that can never be served (or whose id
        is in use), EngineDeadError if the engine stopped. Closing the iterator
        early aborts the request.
        """
        if not self.is_healthy:
            raise EngineDeadError("the engine is not running")
        request_id = request.request_id
        request.arrival_time = time.monotonic()  # TTFT counts from submission
        self.core.check_request(request.num_prompt_tokens, request.sampling_params.max_tokens)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop=loop, queue=asyncio.Queue(), arrival=request.arrival_time)
        with self._streams_lock:
            if request_id in self._streams:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._send(_Add(request, on_admit))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    # Rejected before it was added (or the engine died): nothing of this
                    # call's to abort; its id may well name another request (a held one).
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown ids are ignored."""
        self._send(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` in the engine thread between steps; returns a Future."""
        fut: Future[T] = Future()
        self._send(_Call(fn, fut))
        return fut

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    # ------------------------------------------------------------ engine thread

    def _send(self, item: _Command) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._drain_inbox():
                    self._dispatch(self.core.connector_outputs())
                if self.core.has_unfinished():
                    self._dispatch(self.core.step())
                    if self._only_waiting_for_remote_kv():
                        self._wake.wait(timeout=0.01)  # a transfer's completion wakes us
                        self._wake.clear()
                else:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as exc:  # the loop must report, not vanish
            logger.exception("engine loop crashed")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine stopped: {exc!r}"))

    def _only_waiting_for_remote_kv(self) -> bool:
        """Nothing to compute until remote KV arrives (no busy stepping meanwhile)."""
        sched = self.core.scheduler
        return sched.num_running == 0 and sched.num_waiting == 0

    def _drain_inbox(self) -> bool:
        """Apply queued commands; True if any `call` ran (it may have changed requests)."""
        ran_call = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return ran_call
            if isinstance(item, _Add):
                self._apply_add(item)
            elif isinstance(item, _Abort):
                self.core.abort_request(item.request_id)
            else:
                ran_call = True
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn(self.core))
                    except BaseException as exc:
                        item.future.set_exception(exc)

    def _apply_add(self, add: _Add) -> None:
        with self._streams_lock:
            stream = self._streams.get(add.request.request_id)
        if stream is None:  # the client left before the request reached the engine
            self.core.drop_unadded(add.request)
            return
        try:
            if add.on_admit is not None:
                add.on_admit()
            self.core.add_request(add.request)
        except ValueError as exc:
            self.core.drop_unadded(add.request)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            with self._streams_lock:
                stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._observe(stream, out, now)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _observe(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        m = self.metrics
        if m is None:
            return
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

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
