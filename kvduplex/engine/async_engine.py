"""Runs an `LLMEngine` in its own thread and streams outputs to asyncio.

Threads: the HTTP server's asyncio loop, the transport's threads and the
notification pump reach the engine only through typed commands in one inbox
(`commands`); the engine thread owns the engine. One iteration of its loop::

    gate (if any) → drain the inbox → step (while there is work) → outputs to their streams
    no work, or a step that did nothing → wait for the wake event (set with every
                                          command), at most IDLE_WAIT_S

A step does nothing when no request can be admitted (its blocks are held by
transfers, leases or quarantine): whatever frees them reaches the engine as a
command, so the thread waits for it rather than spinning on `step()`.
Outputs come only from `step` (what commands changed, e.g. an abort or a transfer
that ended, is in the next step's outputs) and travel back with
`loop.call_soon_threadsafe` (`output_streams`). A client that goes away
(its generator closed or cancelled) aborts its request, which frees its blocks.

Failures are seen. A `call` whose function raises is logged with the function's
name (`run_in_engine` hands the error to its awaiting caller instead). When the
loop ends (it crashed, or `shutdown`), every stream and every queued call fails
at once with EngineDeadError, and so does every later `call` or `generate`.

Health is progress, not a live thread: the instance is unhealthy (`problem`)
while the loop has spent more than the stall limit
(``SchedulerConfig.engine_stall_timeout_s``) in one iteration, e.g. a wedged
step; a loop waiting for work is healthy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any
from typing import TypeVar

from kvduplex.common.limits import RequestRejected
from kvduplex.engine.commands import AbortRequest
from kvduplex.engine.commands import AddRequest
from kvduplex.engine.commands import EngineCall
from kvduplex.engine.commands import EngineCommand
from kvduplex.engine.commands import EngineDeadError
from kvduplex.engine.commands import describe_call
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.output_streams import OutputStream
from kvduplex.engine.output_streams import deliver
from kvduplex.engine.output_streams import observe
from kvduplex.engine.outputs import RequestOutput
from kvduplex.engine.request import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 1.0
"""Longest wait for the wake event; a safety net, since every command sets it."""

LoopGate = Callable[[threading.Event], None]
"""``gate(stopping)``: called on the engine thread at the start of every loop iteration,
before the inbox is drained; the loop goes on when it returns. While it runs the engine
makes no progress: a gate that blocks holds the loop as a wedged step would (the stall
clock runs, `problem` reports it past the limit). `stopping` is set once `shutdown` began;
a gate that blocks returns soon after it is set. An exception it raises ends the loop as
any crash does."""


def _report_failure(label: str, future: Future[Any]) -> None:
    """Done-callback of a `call`'s future: log its error (a caller that also handles it
    reports it twice; better than never)."""
    if future.cancelled():
        return
    exc = future.exception()
    if exc is None:
        return
    if isinstance(exc, EngineDeadError):  # the loop's end was logged once, when it ended
        logger.debug("engine call %s not run: %s", label, exc)
    else:
        logger.error("engine call %s failed: %r", label, exc, exc_info=exc)


class AsyncEngine:
    """Thread-safe front of one engine."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        *,
        stall_timeout_s: float | None = None,
        gate: LoopGate | None = None,
    ) -> None:
        """`stall_timeout_s`: see ``SchedulerConfig.engine_stall_timeout_s`` (the default).
        `gate`: see `LoopGate` (default: none, each iteration starts at once)."""
        self.core = engine
        """The engine this front runs: touch its state only on the engine thread (`call`);
        its constant facts (model, limits) may be read from any thread."""
        self.metrics = metrics
        self.stall_timeout_s = (
            engine.config.scheduler.engine_stall_timeout_s
            if stall_timeout_s is None
            else stall_timeout_s
        )
        self._gate = gate
        self._inbox: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        """Guards `_streams` and `_dead`: nothing enters the inbox or the streams after the
        loop ended, so `_die` fails every one."""
        self._streams: dict[str, OutputStream] = {}
        self._dead: EngineDeadError | None = None
        self._death_listeners: list[Callable[[EngineDeadError], None]] = []
        self._thread = threading.Thread(target=self._run, name="kvduplex-engine", daemon=True)
        self._iteration_started_at = time.monotonic()
        self._is_waiting = False
        """The loop waits for work (not stalled, whatever the time)."""
        self.num_iterations = 0
        """Loop iterations so far (tests: an engine that cannot admit anything must not spin)."""
        if metrics is not None:
            metrics.bind_engine(engine)

    # --------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; pending and later calls and streams fail with EngineDeadError."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.ident is None:  # never started: no loop to fail them
            self._die(EngineDeadError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        """The loop runs: started, not stopping, not ended. It may still be stalled."""
        return self._dead is None and not self._stop.is_set() and self._thread.is_alive()

    def dead_reason(self) -> str | None:
        """Why the loop does not run (ended, stopping, not started), or None if it runs."""
        if self._dead is not None:
            return str(self._dead)
        if self._stop.is_set():
            return "the engine is shutting down"
        if not self._thread.is_alive():
            return "the engine is not running"
        return None

    def problem(self) -> str | None:
        """Why the engine is unhealthy, or None: the loop does not run (`dead_reason`), or
        it has spent more than ``stall_timeout_s`` in its current iteration."""
        reason = self.dead_reason()
        if reason is not None or self._is_waiting:
            return reason
        stalled_s = time.monotonic() - self._iteration_started_at
        if stalled_s > self.stall_timeout_s:
            return (
                f"the engine loop has made no progress for {stalled_s:.1f} s "
                f"(limit {self.stall_timeout_s:g} s)"
            )
        return None

    @property
    def is_healthy(self) -> bool:
        """Running and making progress (`problem` is None): what /health reports, and what
        KV heartbeats are sent on."""
        return self.problem() is None

    # ------------------------------------------------------------------ public

    async def generate(
        self, request: Request, *, on_admit: Callable[[], None] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes. The engine thread
        owns ``request`` from here on: read its outputs, not its fields.

        `on_admit` runs in the engine thread just before the request is added,
        with nothing else in between; a ValueError from it rejects the request. It
        runs too for a request whose caller left before the engine took it, which is
        then dropped as aborted (its connector undoes what `on_admit` registered).

        Raises RequestRejected for requests that can never be served (or whose id
        is in use), EngineDeadError if the engine loop does not run or ends meanwhile.
        Closing the iterator early aborts the request.
        """
        reason = self.dead_reason()
        if reason is not None:
            raise EngineDeadError(reason)
        request_id = request.request_id
        request.arrival_time = time.monotonic()  # TTFT counts from submission
        self.core.check_request(request.num_prompt_tokens, request.sampling_params.max_tokens)
        loop = asyncio.get_running_loop()
        stream = OutputStream(loop=loop, queue=asyncio.Queue(), arrival=request.arrival_time)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self._streams:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._send(AddRequest(request, on_admit))
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
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def wake(self) -> None:
        """Have the loop look for work now (any thread): e.g. a KV flow event queued for
        the connector, which reports it as pending work."""
        self._wake.set()

    def on_death(self, listener: Callable[[EngineDeadError], None]) -> None:
        """Call ``listener(error)`` once the loop ended (on the dying thread); at once if
        it ended already."""
        with self._lock:
            dead = self._dead
            if dead is None:
                self._death_listeners.append(listener)
        if dead is not None:
            listener(dead)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown ids are ignored."""
        self._send(AbortRequest(request_id))

    def call(self, fn: Callable[[LLMEngine], T], *, label: str | None = None) -> Future[T]:
        """Run `fn(engine)` in the engine thread between steps; returns a Future.

        An error `fn` raises is logged under `label` (default: `fn`'s name) as well as set
        on the Future, so that a caller who drops the Future still has it seen. With the
        loop ended, the Future has already failed with EngineDeadError.
        """
        name = label if label is not None else describe_call(fn)
        future = self._submit(fn, name)
        future.add_done_callback(functools.partial(_report_failure, name))
        return future

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """`call` and await the result: an error is raised here (EngineDeadError with the
        loop ended), not logged."""
        return await asyncio.wrap_future(self._submit(fn, describe_call(fn)))

    # ------------------------------------------------------------ engine thread

    def _submit(self, fn: Callable[[LLMEngine], T], label: str) -> Future[T]:
        future: Future[T] = Future()
        if not self._send(EngineCall(fn, future, label)):
            assert self._dead is not None
            future.set_exception(self._dead)
        return future

    def _send(self, item: EngineCommand) -> bool:
        """Queue a command; False (nothing queued) once the loop has ended."""
        with self._lock:
            if self._dead is not None:
                return False
            self._inbox.put(item)
        self._wake.set()
        return True

    def _run(self) -> None:
        error = EngineDeadError("the engine was shut down")
        try:
            while not self._stop.is_set():
                self._iteration_started_at = time.monotonic()
                self.num_iterations += 1
                if self._gate is not None:
                    self._gate(self._stop)
                self._drain_inbox()
                if not self.core.has_unfinished():
                    self._wait_for_work()
                    continue
                outputs = self.core.step()
                self._dispatch(outputs)
                if not outputs and not self.core.last_step_did_work:
                    self._wait_for_work()  # nothing could run: until a command changes that
        except BaseException as exc:  # the loop must report, not vanish
            logger.exception("engine loop crashed")
            error = EngineDeadError(f"the engine stopped: {exc!r}")
        finally:
            self._die(error)

    def _wait_for_work(self) -> None:
        self._is_waiting = True
        self._wake.wait(timeout=IDLE_WAIT_S)
        self._iteration_started_at = time.monotonic()
        self._is_waiting = False
        self._wake.clear()  # commands sent before this are drained next; later ones set it

    def _die(self, error: EngineDeadError) -> None:
        """The loop ended: fail every stream and every queued call; later ones fail at once."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
            streams = list(self._streams.values())
            listeners, self._death_listeners = self._death_listeners, []
        for stream in streams:
            deliver(stream, error)
        num_calls = 0
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, EngineCall) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)
                num_calls += 1
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                logger.exception("engine death listener %r failed", listener)
        level = logging.WARNING if streams or num_calls else logging.INFO
        logger.log(
            level, "%s: failed %d streams and %d queued calls", error, len(streams), num_calls
        )

    def _drain_inbox(self) -> bool:
        """Apply queued commands; True if there were any (they may have changed requests)."""
        applied = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            if isinstance(item, AddRequest):
                self._apply_add(item)
            elif isinstance(item, AbortRequest):
                self.core.abort_request(item.request_id)
            elif item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(item.fn(self.core))
                except BaseException as exc:
                    item.future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise

    def _apply_add(self, add: AddRequest) -> None:
        with self._lock:
            stream = self._streams.get(add.request.request_id)
        if stream is None:  # the client left before the request reached the engine
            if add.on_admit is not None:
                try:  # what it registers (a remote-KV spec) is undone with the request
                    add.on_admit()
                except ValueError:
                    return  # it registered nothing (another request's xid): nothing to undo
            self.core.drop_unadded(add.request)
            return
        try:
            if add.on_admit is not None:
                add.on_admit()
            self.core.add_request(add.request)
        except ValueError as exc:
            deliver(stream, exc)  # what it prepared is its caller's (or a duplicate's) to undo

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                observe(self.metrics, stream, out, now)
            deliver(stream, out)
