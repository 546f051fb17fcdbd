"""The flow inbox: one per instance, drained by the engine thread.

Every KV flow's state (send jobs, receive waits, specs, READs) belongs to the
engine thread. Other threads never touch it: they put typed events here, and
the engine thread applies them when it drains the inbox::

    notification pump ── Heard(msg, sender) ───┐
    pump tick ────────── TickAt(now) ──────────┤
    transport callbacks ─ TransferEnded(h) ────┼──► queue ──► engine thread: drain()
                          TransferSettled(h) ──┤               ├─ handler of type(msg)
    flow I/O thread ──── SenderChecked(...) ───┤               ├─ every tick, due timers
    HTTP routes ──────── RegisterSpec(reply) ──┘               └─ the event's target

Each event has a `Granularity`. `drain` (the connector's `get_finished`,
before each step) applies every event. `drain_layer` (prefill's layer hook,
after each layer of a forward that streams a push) applies only the LAYER
ones: those a push must see between two layers, a registration (written at
once from the finished layers) and the end of a WRITE (a failed one stops the
next layer's); `wait_layer` (the layer hook of a forward that reads a loaded
prefix) applies them too, blocking until the READ of that layer has ended. The
STEP ones they meet wait, in their order, for the next
`drain`, ahead of what is queued after them. A handler's messages are LAYER
if it says so (`on(..., at=LAYER)`), a transfer's end if its watch says so
(`watch(..., at=LAYER)`); ticks, sender checks and specs are STEP.

The events, and the objects that hear them, are in `kvduplex.kvflow.flow_events`.

A put wakes the engine loop (the connector reports pending work while the
queue is not empty), so an idle engine drains it at once. Ticks coalesce: at
most one is pending at a time, carrying the latest time any pump tick gave
(a deadline due at any of them is due at that one). Timers (`after`) are kept
by the engine thread and fire at the first `drain` at or after their time;
ticks come at least every ``idle_tick_s`` of the pump.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol
from typing import assert_never

from kvduplex.kvflow.flow_events import FlowEvent
from kvduplex.kvflow.flow_events import Granularity
from kvduplex.kvflow.flow_events import Heard
from kvduplex.kvflow.flow_events import RegisterSpec
from kvduplex.kvflow.flow_events import SenderChecked
from kvduplex.kvflow.flow_events import SenderCheckTarget
from kvduplex.kvflow.flow_events import SpecT
from kvduplex.kvflow.flow_events import SpecTable
from kvduplex.kvflow.flow_events import TickAt
from kvduplex.kvflow.flow_events import TransferEnded
from kvduplex.kvflow.flow_events import TransferSettled
from kvduplex.kvflow.flow_events import TransferWatcher
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import TransferHandle

logger = logging.getLogger(__name__)


class EngineGoneError(RuntimeError):
    """The engine loop ended before it took a request."""


class XidInUseError(ValueError):
    """A spec names an xid another request waits on (the route answers 409)."""


Handler = Callable[[ControlMessage, str, float], None]
"""``handler(message, sender_engine_id, received_at)``, on the engine thread."""
Tick = Callable[[float], None]
"""``tick(now)`` on the engine thread."""


class TimerTarget(Protocol):
    def on_timer(self, now: float) -> None: ...


@dataclass(order=True)
class _Timer:
    at: float
    seq: int
    target: TimerTarget = field(compare=False)


class FlowInbox:
    """One instance's flow events; `put` from any thread, `drain` and `drain_layer` on
    the engine thread."""

    def __init__(
        self, wake: Callable[[], None] = lambda: None,
        clock: Callable[[], float] | None = None,
        is_alive: Callable[[], bool] = lambda: True,
    ) -> None:  # fmt: skip
        """``wake()`` wakes the engine loop; ``clock`` gives monotonic seconds (default:
        this module's ``time.monotonic``); ``is_alive()``: whether the engine thread
        still drains (a request to a dead engine fails at once)."""
        self.wake = wake
        self.clock = clock if clock is not None else time.monotonic
        self.is_alive = is_alive
        self._events: queue.SimpleQueue[FlowEvent] = queue.SimpleQueue()
        self._deferred: collections.deque[FlowEvent] = collections.deque()
        """STEP events `drain_layer` took off the queue, in order (engine thread)."""
        self._handlers: dict[type[ControlMessage], Handler] = {}
        self._at_layer: set[type[ControlMessage]] = set()
        self._ticks: list[Tick] = []
        # Ticks are coalesced without a lock: the pump's thread alone writes `_tick_latest`
        # and `_num_ticks_put`, the engine thread alone `_num_ticks_applied` (an int or
        # float attribute is read and written whole under the GIL).
        self._tick_latest = 0.0
        """The latest time the pump ticked."""
        self._num_ticks_put = 0
        self._num_ticks_applied = 0
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._pending: set[Future[Any]] = set()
        self.num_drained = 0

    # ---- wiring (before the pump starts) ----

    def on(
        self, msg_type: type[ControlMessage], handler: Handler, *,
        at: Granularity = Granularity.STEP,
    ) -> None:  # fmt: skip
        """Apply messages of ``msg_type`` with ``handler`` on the engine thread (``at``
        LAYER: also between two layers of a forward)."""
        assert msg_type not in self._handlers, f"two handlers for {msg_type.__name__}"
        self._handlers[msg_type] = handler
        if at is Granularity.LAYER:
            self._at_layer.add(msg_type)

    def every_tick(self, tick: Tick) -> None:
        self._ticks.append(tick)

    def attach(self, pump: NotificationPump) -> None:
        """Have ``pump`` put what it hears and its ticks here; call after every `on`."""
        for msg_type in self._handlers:
            pump.on(msg_type, self.heard)
        pump.every_tick(self.tick)

    # ---- any thread ----

    def put(self, event: FlowEvent) -> None:
        self._events.put(event)
        self.wake()

    def heard(self, msg: ControlMessage, sender: str) -> None:
        """The pump's handler of every message a flow takes."""
        self.put(Heard(msg, sender, self.clock()))

    def tick(self, now: float) -> None:
        """The clock moved to ``now``: queue a tick, unless one is pending already, which
        then carries the later of its time and ``now`` (a busy engine that drains late
        applies one tick, at the latest time, not one per pump tick)."""
        self._tick_latest = max(self._tick_latest, now)
        if self._num_ticks_applied >= self._num_ticks_put:
            # None pending. Had the engine thread just counted one applied, it reads the
            # time after counting, so it applies `now` or this tick does: none is lost.
            self._num_ticks_put += 1
            self.put(TickAt(now))

    def watch(
        self, handle: TransferHandle, to: TransferWatcher, *,
        at: Granularity = Granularity.STEP,
    ) -> None:  # fmt: skip
        """Have ``to`` hear, on the engine thread, when ``handle`` ends and settles (``at``
        LAYER: also between two layers of a forward)."""
        handle.add_done_callback(lambda h: self.put(TransferEnded(h, to, at)))
        handle.add_settled_callback(lambda h: self.put(TransferSettled(h, to, at)))

    def register(self, spec: SpecT, to: SpecTable[SpecT]) -> Future[None]:
        """Have ``to.register(spec)`` run on the engine thread at its next drain; the
        future has None or its error (EngineGoneError once the engine no longer drains)."""
        reply: Future[None] = Future()
        if self.track(reply):
            self.put(RegisterSpec(spec, to, reply))
        return reply

    def track(self, reply: Future[Any]) -> bool:
        """Fail ``reply`` with EngineGoneError if the engine no longer drains, now or once
        it ends (any thread); False if it failed at once. Checked again after it is kept:
        an engine that died in between ran `fail_pending` before ``reply`` was there."""
        if not self.is_alive():
            _fail(reply, "the engine loop has ended")
            return False
        self._pending.add(reply)
        reply.add_done_callback(self._pending.discard)
        if not self.is_alive():
            _fail(reply, "the engine loop has ended")
            return False
        return True

    def fail_pending(self, error: BaseException) -> None:
        """The engine loop ended: fail every request still queued (any thread)."""
        for reply in list(self._pending):
            _fail(reply, str(error))

    @property
    def has_events(self) -> bool:
        """Events queued or deferred, or a timer due (the engine loop steps to drain them;
        engine thread)."""
        return (
            bool(self._deferred) or not self._events.empty()
            or (bool(self._timers) and self._timers[0].at <= self.clock())
        )  # fmt: skip

    @property
    def num_timers(self) -> int:
        """Timers not fired yet (engine thread; introspection)."""
        return len(self._timers)

    # ---- engine thread ----

    def after(self, delay_s: float, target: TimerTarget) -> None:
        """Call ``target.on_timer(now)`` at the first drain ``delay_s`` from now or later."""
        heapq.heappush(self._timers, _Timer(self.clock() + delay_s, next(self._seq), target))

    def granularity(self, event: FlowEvent) -> Granularity:
        """Where ``event`` is applied: also between two layers (LAYER), or only between
        steps (STEP)."""
        match event:
            case Heard(msg):
                return Granularity.LAYER if type(msg) in self._at_layer else Granularity.STEP
            case TransferEnded() | TransferSettled():
                return event.at
            case TickAt() | SenderChecked() | RegisterSpec():
                return Granularity.STEP
            case _:
                assert_never(event)

    def drain(self) -> int:
        """Apply every event, in order (those `drain_layer` deferred first), then fire due
        timers; how many events."""
        count = 0
        while self._deferred:
            self._apply_logged(self._deferred.popleft())
            count += 1
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            count += 1
            self._apply_logged(event)
        if self._timers:
            now = self.clock()
            while self._timers and self._timers[0].at <= now:
                timer = heapq.heappop(self._timers)
                try:
                    timer.target.on_timer(now)
                except Exception:
                    logger.exception("flow timer %r failed", timer.target)
        self.num_drained += count
        return count

    def wait_layer(self, is_ready: Callable[[], bool], until: float) -> bool:
        """Between two layers of a forward that reads loaded KV: apply the LAYER events as
        they come (STEP ones are deferred, as by `drain_layer`), blocking for each, until
        ``is_ready()`` or the clock reaches ``until``; whether ``is_ready()``.

        The one place the engine thread blocks on the inbox: a load's READ ends through
        it (its transport callback puts the event), so no other wake-up is needed."""
        while not is_ready():
            left = until - self.clock()
            if left <= 0:
                return False
            event = self._next_event(left)
            if event is None:
                continue
            if self.granularity(event) is Granularity.LAYER:
                self.num_drained += 1
                self._apply_logged(event)
            else:
                self._deferred.append(event)
        return True

    def _next_event(self, timeout_s: float) -> FlowEvent | None:
        """The next event put, waiting at most ``timeout_s``; None if none came."""
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def drain_layer(self) -> int:
        """Between two layers of a forward: apply the LAYER events queued, in order, and
        defer the others to the next `drain`; how many events were applied."""
        count = 0
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if self.granularity(event) is Granularity.LAYER:
                count += 1
                self._apply_logged(event)
            else:
                self._deferred.append(event)
        self.num_drained += count
        return count

    def _apply_logged(self, event: FlowEvent) -> None:
        try:
            self._apply(event)
        except Exception:
            logger.exception("flow event %s failed", type(event).__name__)

    def _apply(self, event: FlowEvent) -> None:
        match event:
            case Heard():
                self._heard(event)
            case TickAt(now):
                self._num_ticks_applied += 1  # before the time is read: see `tick`
                self._tick(max(now, self._tick_latest))
            case TransferEnded(handle, to):
                to.on_transfer_ended(handle)
            case TransferSettled(handle, to):
                to.on_transfer_settled(handle)
            case SenderChecked(xid, gone, to):
                to.on_sender_checked(xid, gone, self.clock())
            case RegisterSpec():
                event.apply()
            case _:
                assert_never(event)

    def _heard(self, event: Heard) -> None:
        msg = event.msg
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning("xid=%s: no flow takes %s from %s",
                           msg.xid, type(msg).__name__, event.sender)  # fmt: skip
            return
        handler(msg, event.sender, event.received_at)

    def _tick(self, now: float) -> None:
        for tick in self._ticks:
            try:
                tick(now)
            except Exception:
                logger.exception("flow tick %r failed", tick)


def _fail(reply: Future[Any], why: str) -> None:
    try:
        if reply.set_running_or_notify_cancel():
            reply.set_exception(EngineGoneError(why))
    except RuntimeError:
        pass  # answered meanwhile


__all__ = [
    "EngineGoneError", "FlowEvent", "FlowInbox", "Granularity", "Handler", "Heard", "RegisterSpec",
    "SenderCheckTarget", "SenderChecked", "SpecTable", "TickAt", "TimerTarget", "TransferEnded",
    "TransferSettled", "TransferWatcher", "XidInUseError",
]  # fmt: skip
