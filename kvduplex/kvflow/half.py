"""What the sending and the receiving half of a KV flow share.

Both halves (`kvduplex.kvflow.sender.KVSender`,
`kvduplex.kvflow.receiver.KVReceiver`) hold the transport, the engine, one
codec and one lock; both declare which control messages they handle and tick
with the notification pump; both tell their peer things that need no answer,
where a peer that cannot be reached is only logged (its own deadline covers
the lost message).
"""

from __future__ import annotations

import logging
import threading
from typing import ClassVar

from kvduplex.engine.connector import EngineHandle
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.notify import Handler
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle

logger = logging.getLogger(__name__)


class FlowHalf:
    """Base of `KVSender` and `KVReceiver`: shared state, pump wiring, `_tell`."""

    TELL_FAILURE_LEVEL: ClassVar[int] = logging.INFO
    """Log level of a message `_tell` could not send."""

    def __init__(self, transport: Transport, engine: EngineHandle) -> None:
        self.transport = transport
        self.engine = engine
        self.codec = MessageCodec()
        self._lock = threading.Lock()

    def _notif_handlers(self) -> dict[type[ControlMessage], Handler]:
        """The handler of each message type this half receives (run on the pump thread)."""
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        """Deadlines and heartbeats; the pump calls it with `time.monotonic()`."""
        raise NotImplementedError

    def attach(self, pump: NotificationPump) -> None:
        """Route this half's messages and ticks from `pump`; call once, before it starts."""
        for msg_type, handler in self._notif_handlers().items():
            pump.on(msg_type, handler)
        pump.every_tick(self._tick)

    def tell(self, peer: PeerHandle, msg: ControlMessage) -> None:
        """Send `msg` to `peer` (any thread); a peer we cannot reach is only logged."""
        self._tell(peer, msg)

    def _tell(self, peer: PeerHandle, msg: ControlMessage) -> None:
        """Send `msg` to `peer`; a peer we cannot reach is only logged."""
        try:
            self.transport.send_notif(peer, self.codec.encode(msg), msg.xid)
        except Exception as exc:
            logger.log(
                self.TELL_FAILURE_LEVEL, "xid=%s: cannot tell %s: %s", msg.xid, peer.engine_id, exc
            )


def tear_down_if_unsettled(
    transport: Transport, handle: TransferHandle, peer: PeerHandle, after_s: float
) -> None:
    """A transfer that failed but may still land and is still unsettled ``after_s``
    later has its peer's endpoint torn down, which settles it (nothing is held forever)."""
    if not handle.may_still_land:
        return

    def check() -> None:
        if not handle.settled:
            logger.warning(
                "xid=%s: a failed %s is still unsettled after %g s; tearing down the "
                "endpoint with %s", handle.xid, handle.op.value, after_s, peer.engine_id,
            )  # fmt: skip
            transport.disconnect(peer)

    timer = threading.Timer(after_s, check)
    timer.daemon = True
    timer.start()


def release_when_settled(
    engine: EngineHandle, handle: TransferHandle, block_ids: list[int]
) -> None:
    """Drop our references on ``block_ids`` (a transfer's source or target) on the engine
    thread once nothing of ``handle`` can land any more, not merely once it failed."""

    def release(_: TransferHandle) -> None:
        engine.call(lambda: engine.release_blocks(block_ids))

    handle.add_settled_callback(release)


__all__ = ["FlowHalf", "release_when_settled", "tear_down_if_unsettled"]
