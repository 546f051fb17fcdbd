"""What the sending and the receiving half of a KV flow share.

Both halves (`kvduplex.kvflow.sender.KVSender`,
`kvduplex.kvflow.receiver.KVReceiver`) hold the transport, the engine, one
codec, the instance's flow inbox (their messages, ticks and transfer ends come
through it, on the engine thread) and its flow I/O thread; both tell their
peer things that need no answer, where a peer that cannot be reached is only
logged (its own deadline covers the lost message). `ReadRunner` runs one READ
(pull, retained turn, one layer of a fetched prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar
from typing import assert_never

from kvduplex.engine.handle import EngineHandle
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import Notify
from kvduplex.kvflow.flow_io import TearDownEndpoint
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.inbox import Granularity
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
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

logger = logging.getLogger(__name__)


class FlowHalf:
    """Base of `KVSender` and `KVReceiver`: shared state, and `tell` through the flow
    I/O thread."""

    TELL_FAILURE_LEVEL: ClassVar[int] = logging.INFO
    """Log level of a message that could not be sent."""

    def __init__(
        self, transport: Transport, engine: EngineHandle, inbox: FlowInbox, io: FlowIO
    ) -> None:
        self.transport = transport
        self.engine = engine
        self.inbox = inbox
        self.io = io
        self.codec = MessageCodec()

    def tell(self, peer: PeerHandle, msg: ControlMessage) -> None:
        """Send `msg` to `peer` from the flow I/O thread; a peer we cannot reach is only
        logged (its own deadline covers the lost message)."""
        self.io.submit(Notify(peer, msg, failure_level=self.TELL_FAILURE_LEVEL))


class ReadRunner:
    """Runs one `ReadMachine`: READ ``remote`` blocks of ``peer`` into our ``targets``.

    Engine thread only: `start` posts; the READ's end, its settling and the check of a
    failed READ that stays unsettled come back through the flow inbox.
    ``on_outcome(outcome, handle)`` runs on the engine thread (at once if the READ
    could not be posted); our references on the targets go once the READ is settled,
    after the outcome, and ``on_settled()`` runs then: the peer may let its source
    blocks go (a pull's lease), since nothing of the READ reads them any more. A READ
    that failed at its deadline may still be reading them until then.
    """

    def __init__(
        self, transport: Transport, engine: EngineHandle, inbox: FlowInbox, io: FlowIO,
        peer: PeerHandle, xid: str, targets: list[int], remote: list[int], deadline_s: float,
        after_s: float, on_outcome: Callable[[Outcome, TransferHandle | None], None],
        on_settled: Callable[[], None] | None = None, *, layers: tuple[int, ...] | None = None,
        at: Granularity = Granularity.STEP,
    ) -> None:  # fmt: skip
        """``layers``: READ only those layers (None: all); ``at``: where the inbox applies
        the READ's end (LAYER: also between two layers of a forward that waits for it)."""
        self.transport = transport
        self.engine = engine
        self.inbox = inbox
        self.io = io
        self.peer = peer
        self.xid = xid
        self.remote = remote
        self.deadline_s = deadline_s
        self.on_outcome = on_outcome
        self.on_settled = on_settled
        self.layers = layers
        self.at = at
        self.machine = ReadMachine(tuple(targets), after_s)
        self.handle: TransferHandle | None = None

    def start(self, *, acquire: bool = True) -> TransferHandle | None:
        """Post the READ (``acquire``: take our references on the targets first; False
        when they were just allocated for it). The handle, or None if it failed to post."""
        self._feed(Begin(acquire))
        return self.handle

    def _feed(self, event: ReadEvent) -> None:
        for a in self.machine.handle(event):
            self._do(a)

    def _do(self, a: ReadAction) -> None:
        match a:
            case AcquireBlocks():
                self.engine.acquire_blocks(list(a.block_ids))
            case ReleaseBlocks():  # the machine's last: nothing of the READ can land any more
                self.engine.release_blocks(list(a.block_ids))
                if self.on_settled is not None:
                    self.on_settled()
            case PostRead():
                self._post()
            case Outcome():
                self.on_outcome(a, self.handle)
            case ArmCheck():
                self.inbox.after(a.after_s, self)
            case TearDown():
                self.io.submit(TearDownEndpoint(self.peer, a.why, self.xid))
            case _:
                assert_never(a)

    def _post(self) -> None:
        try:
            handle = self.transport.transfer(
                TransferOp.READ, self.peer, self.xid, list(self.machine.targets), self.remote,
                layers=self.layers, deadline_s=self.deadline_s,
            )  # fmt: skip
        except Exception as exc:  # validation or a dead peer
            self._feed(PostFailed(f"post failed: {exc}"))
            return
        self.handle = handle
        self.inbox.watch(handle, self, at=self.at)

    # ---- inbox events (engine thread) ----

    def on_transfer_ended(self, h: TransferHandle) -> None:
        self._feed(Ended(h.state is TransferState.DONE, h.may_still_land, h.reason))

    def on_transfer_settled(self, h: TransferHandle) -> None:
        self._feed(Settled())

    def on_timer(self, now: float) -> None:
        if self.handle is not None:
            self._feed(Overdue(self.handle.settled))


__all__ = ["FlowHalf", "ReadRunner"]
