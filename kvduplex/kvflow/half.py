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
from collections.abc import Callable
from functools import partial
from typing import ClassVar

from kvduplex.engine.handle import EngineHandle
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.read import ArmCheck
from kvduplex.kvflow.machines.read import Begin
from kvduplex.kvflow.machines.read import Ended
from kvduplex.kvflow.machines.read import Outcome
from kvduplex.kvflow.machines.read import Overdue
from kvduplex.kvflow.machines.read import PostFailed
from kvduplex.kvflow.machines.read import PostRead
from kvduplex.kvflow.machines.read import ReadAction
from kvduplex.kvflow.machines.read import ReadEvent
from kvduplex.kvflow.machines.read import ReadMachine
from kvduplex.kvflow.machines.read import Settled
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.notify import Handler
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

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


class ReadRunner:
    """Runs one `ReadMachine`: READ ``remote`` blocks of ``peer`` into our ``targets``.

    `start` on the engine thread. ``on_outcome(outcome, handle)`` runs on the engine
    thread (at once if the READ could not be posted, else through an engine call);
    our references on the targets go once the READ is settled, after the outcome.
    """

    def __init__(
        self, transport: Transport, engine: EngineHandle, peer: PeerHandle, xid: str,
        targets: list[int], remote: list[int], deadline_s: float, after_s: float,
        on_outcome: Callable[[Outcome, TransferHandle | None], None],
    ) -> None:  # fmt: skip
        self.transport = transport
        self.engine = engine
        self.peer = peer
        self.xid = xid
        self.remote = remote
        self.deadline_s = deadline_s
        self.on_outcome = on_outcome
        self.machine = ReadMachine(tuple(targets), after_s)
        self.handle: TransferHandle | None = None
        self._lock = threading.Lock()

    def start(self, *, acquire: bool = True) -> TransferHandle | None:
        """Post the READ (``acquire``: take our references on the targets first; False
        when they were just allocated for it). The handle, or None if it failed to post."""
        self._feed(Begin(acquire), on_engine_thread=True)
        return self.handle

    def _feed(self, event: ReadEvent, *, on_engine_thread: bool = False) -> None:
        with self._lock:
            actions = self.machine.handle(event)
        for a in actions:
            self._do(a, on_engine_thread)

    def _do(self, a: ReadAction, on_engine_thread: bool) -> None:
        if isinstance(a, AcquireBlocks):
            self.engine.acquire_blocks(list(a.block_ids))
        elif isinstance(a, ReleaseBlocks):
            if on_engine_thread:
                self.engine.release_blocks(list(a.block_ids))
            else:
                self.engine.call(partial(self.engine.release_blocks, list(a.block_ids)))
        elif isinstance(a, PostRead):
            self._post()
        elif isinstance(a, Outcome):
            if on_engine_thread:
                self.on_outcome(a, self.handle)
            else:
                self.engine.call(partial(self.on_outcome, a, self.handle))
        elif isinstance(a, ArmCheck):
            timer = threading.Timer(a.after_s, self._overdue)
            timer.daemon = True
            timer.start()
        elif isinstance(a, TearDown):
            logger.warning("xid=%s: %s; tearing down the endpoint with %s",
                           self.xid, a.why, self.peer.engine_id)  # fmt: skip
            self.transport.disconnect(self.peer)

    def _post(self) -> None:
        try:
            handle = self.transport.transfer(
                TransferOp.READ, self.peer, self.xid, list(self.machine.targets), self.remote,
                deadline_s=self.deadline_s,
            )  # fmt: skip
        except Exception as exc:  # validation or a dead peer
            self._feed(PostFailed(f"post failed: {exc}"), on_engine_thread=True)
            return
        self.handle = handle
        handle.add_done_callback(
            lambda h: self._feed(Ended(h.state is TransferState.DONE, h.may_still_land, h.reason))
        )
        handle.add_settled_callback(lambda h: self._feed(Settled()))

    def _overdue(self) -> None:
        if self.handle is not None:
            self._feed(Overdue(self.handle.settled))


__all__ = ["FlowHalf", "ReadRunner"]
