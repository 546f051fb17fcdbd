"""One thread per instance that takes the transport's notifications and dispatches them.

Flows (push, duplex) register a handler per `ControlMessage` type and a tick
(deadline checks, heartbeats). Handlers run on the pump thread: they must be
quick and hand real work to the engine thread (`AsyncEngine.call`). A
malformed notification is logged and dropped; a handler that raises is logged
and the pump goes on.

The pump sleeps in `poll_notifs`, so a notification wakes it at once. Ticks
run every ``tick_s`` while the transport is active (a post or a notification
in the last ``hot_s``: something may be pending), else every ``idle_tick_s``;
heartbeats (a third of a 10 s wait) and deadlines of long silences need no
more, and an idle instance wakes once a second instead of twenty times::

    activity ─┬─ tick_s ticks ... hot_s ... ─┬─ idle_tick_s ticks ...

If the pump thread ends on its own (its transport failed under it, or an error
nothing caught), the instance can no longer hear its peers: `problem` says so
and why, and the instance's /health and /ready answer 503 with it.

An optional `MessageFilter`, passed at construction, sees every decoded
message before its handler and may drop it (fault tests drop a message type
this way, as if the network had lost it); the default dispatches everything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec

from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec

logger = logging.getLogger(__name__)

Handler = Callable[[ControlMessage, str], None]
"""``handler(message, sender_engine_id)``."""
Tick = Callable[[float], None]
"""``tick(now)``: called with `time.monotonic()` every ``tick_s`` while the transport is
active, at least every ``idle_tick_s`` otherwise."""
MessageFilter = Callable[[ControlMessage, str], bool]
"""``accept(message, sender_engine_id)``: called on the pump thread with each message
that decoded, before its handler; True dispatches it, False drops it as if it never
arrived (counted in `NotificationPump.num_dropped`). It must be quick and must not raise."""


def message_type_of(cls: type[ControlMessage]) -> str:
    """A message class's type tag on the wire (``kv_register``, ...)."""
    return str(cls.__struct_config__.tag)


def message_type(msg: ControlMessage) -> str:
    return message_type_of(type(msg))


class NotificationPump:
    """Polls `transport.poll_notifs` and routes each message to its type's handler."""

    def __init__(
        self,
        transport: Transport,
        tick_s: float = 0.05,
        idle_tick_s: float | None = None,
        hot_s: float = 15.0,
        accept: MessageFilter | None = None,
    ) -> None:
        """`idle_tick_s` None: ``max(tick_s, 1.0)``. ValueError for non-positive periods.
        `accept`: see `MessageFilter` (default: none, every message is dispatched)."""
        idle = max(tick_s, 1.0) if idle_tick_s is None else idle_tick_s
        if tick_s <= 0 or idle < tick_s or hot_s < 0:
            raise ValueError("need 0 < tick_s <= idle_tick_s and hot_s >= 0")
        self.transport = transport
        self.tick_s = tick_s
        self.idle_tick_s = idle
        self.hot_s = hot_s
        self.num_wakeups = 0
        """Times the pump woke (for tests and idle measurements)."""
        self.accept = accept
        self.num_dropped = 0
        """Messages `accept` dropped."""
        self._handlers: dict[type[ControlMessage], Handler] = {}
        self._ticks: list[Tick] = []
        self._codec: MessageCodec | None = None
        self._stop = threading.Event()
        self._death: str | None = None
        """Why the thread ended on its own, or None."""
        self._thread = threading.Thread(target=self._run_guarded, name="kv-notify", daemon=True)

    def on(self, msg_type: type[ControlMessage], handler: Handler) -> None:
        """Route messages of `msg_type` to `handler`; register before `start`."""
        self._handlers[msg_type] = handler

    def every_tick(self, tick: Tick) -> None:
        self._ticks.append(tick)

    def start(self) -> None:
        """Start the pump thread; register handlers and ticks before."""
        self._codec = MessageCodec()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def problem(self) -> str | None:
        """Why the pump no longer delivers notifications although nobody closed it, or
        None (not started, running, or closed)."""
        if self._stop.is_set() or self._thread.ident is None or self._thread.is_alive():
            return None
        return f"KV notification pump stopped: {self._death or 'its thread ended'}"

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the pump thread ended (closed or dead) or ``timeout`` passed;
        whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run_guarded(self) -> None:
        """`_run`, recording why it ended if nobody asked it to."""
        try:
            self._run()
        except BaseException as exc:
            self._death = f"{type(exc).__name__}: {exc}"
            logger.exception("the KV notification pump died; this instance no longer hears "
                             "its peers' KV notifications")  # fmt: skip
            return
        if not self._stop.is_set() and self._death is None:
            self._death = "its thread ended"

    def _period(self, now: float) -> float:
        """Seconds between ticks now: short while the transport was recently active."""
        return self.tick_s if now - self.transport.last_activity < self.hot_s else self.idle_tick_s

    def _run(self) -> None:
        assert self._codec is not None
        next_tick = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            next_tick = min(next_tick, now + self._period(now))
            try:
                notifs = self.transport.poll_notifs(timeout=max(0.0, next_tick - now))
            except Exception as exc:  # transport closed under us
                logger.exception("polling notifications failed; the pump stops")
                self._death = f"polling notifications failed: {type(exc).__name__}: {exc}"
                return
            self.num_wakeups += 1
            for n in notifs:
                self._dispatch(n.payload, n.peer_engine_id)
            now = time.monotonic()
            if now < next_tick:
                continue
            next_tick = now + self._period(now)
            for tick in self._ticks:
                try:
                    tick(now)
                except Exception:
                    logger.exception("notification tick %r raised", tick)

    def _dispatch(self, payload: bytes, sender: str) -> None:
        assert self._codec is not None
        try:
            msg = self._codec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropping a malformed notification from %s: %s", sender, exc)
            return
        if self.accept is not None and not self.accept(msg, sender):
            self.num_dropped += 1
            logger.debug("filter dropped %s from %s (xid=%s)", message_type(msg), sender, msg.xid)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning(
                "no handler for %s from %s (xid=%s)", type(msg).__name__, sender, msg.xid
            )
            return
        try:
            handler(msg, sender)
        except Exception:
            logger.exception("handler of %s (xid=%s) raised", type(msg).__name__, msg.xid)
