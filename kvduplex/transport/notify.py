"""One thread per instance that takes the transport's notifications and dispatches them.

Flows (push, duplex) register a handler per `ControlMessage` type and a tick
(deadline checks). Handlers run on the pump thread: they must be quick and
hand real work to the engine thread (`AsyncEngine.call`). A malformed
notification is logged and dropped; a handler that raises is logged and the
pump goes on.

Test-only hook: ``drop_types`` (set from ``KVDUPLEX_TEST_DROP_MESSAGES``,
see `kvduplex.config.Environment`) names message types (``kv_register``,
``kv_offer``, ``kv_done``, ...) the pump drops on arrival, as if the network
had lost them, so that fault tests can make a registration, an offer or a
notification go unanswered. Never set it in production.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec

from kvduplex.transport.messages import ControlMessage, MessageCodec
from kvduplex.transport.protocol import Transport

logger = logging.getLogger(__name__)

Handler = Callable[[ControlMessage, str], None]
"""``handler(message, sender_engine_id)``."""
Tick = Callable[[float], None]
"""``tick(now)``: called at least every ``tick_s`` with `time.monotonic()`."""


def message_type_of(cls: type[ControlMessage]) -> str:
    """A message class's type tag on the wire (``kv_register``, ...)."""
    return str(cls.__struct_config__.tag)


def message_type(msg: ControlMessage) -> str:
    return message_type_of(type(msg))


class NotificationPump:
    """Polls `transport.poll_notifs` and routes each message to its type's handler."""

    def __init__(
        self, transport: Transport, tick_s: float = 0.05, drop_types: frozenset[str] = frozenset()
    ) -> None:
        self.transport = transport
        self.tick_s = tick_s
        self.drop_types = drop_types
        """Message type tags dropped on arrival (fault tests only)."""
        self.num_dropped = 0
        self._handlers: dict[type[ControlMessage], Handler] = {}
        self._ticks: list[Tick] = []
        self._codec: MessageCodec | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-notify", daemon=True)

    def on(self, msg_type: type[ControlMessage], handler: Handler) -> None:
        """Route messages of `msg_type` to `handler`; register before `start`."""
        self._handlers[msg_type] = handler

    def every_tick(self, tick: Tick) -> None:
        self._ticks.append(tick)

    def start(self) -> None:
        """Start the pump thread. Raises ValueError for a ``drop_types`` tag no message has."""
        self._codec = MessageCodec()
        unknown = self.drop_types - {message_type_of(t) for t in self._codec.types}
        if unknown:
            known = sorted(message_type_of(t) for t in self._codec.types)
            raise ValueError(f"KVDUPLEX_TEST_DROP_MESSAGES names {sorted(unknown)}; known: {known}")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        assert self._codec is not None
        while not self._stop.is_set():
            try:
                notifs = self.transport.poll_notifs(timeout=self.tick_s)
            except Exception:  # transport closed under us
                logger.exception("polling notifications failed; the pump stops")
                return
            for n in notifs:
                self._dispatch(n.payload, n.peer_engine_id)
            now = time.monotonic()
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
        if self.drop_types and message_type(msg) in self.drop_types:
            self.num_dropped += 1
            logger.warning("test hook: dropping %s from %s (xid=%s)", message_type(msg), sender, msg.xid)
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
