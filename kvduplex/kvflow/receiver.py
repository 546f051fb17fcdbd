"""The receiving half of every KV flow: register destination blocks, wait for them.

`KVReceiver.expect` takes a reference on the destination blocks, sends the
sender a `KVRegister`, and waits; the flow that asked learns the outcome
through its callbacks, on the engine thread::

    expect(xid, blocks, on_done, on_failed) ── KVRegister ──► sender
         ◄── KVRegistered (or a KVAlive): the registration arrived; until then it
             is re-sent every third of the wait, with what is left of the wait
         ◄── KVAlive (restarts the wait; answered by KVAliveAck)
         ◄── KVDone  ──► release our references, on_done(msg)
         ◄── KVFailed ─► release our references, on_failed(reason, discard=False)
             (also the sender's refusal of the registration: nothing was written)
    no word for wait_s ──► KVCancel to the sender, on_failed(reason, discard=True),
                           our references kept (quarantine) until the sender
                           confirms (KVDone/KVFailed: it sends them only once
                           none of its WRITEs can land); every quarantine_s
                           without word it is asked again (KVCancel), until it
                           answers or its process is known to be gone

Push uses it on decode (the blocks belong to a request waiting for its
prompt's KV); the duplex return uses it on prefill (fresh blocks that enter
the prefix cache once filled). A late WRITE therefore never lands in a block
that holds someone else's KV: whoever gives blocks up after a fallback does
so while the receiver still references them.

Each wait is a pure state machine,
`kvduplex.kvflow.machines.receive.ReceiveMachine`; this class is its adapter.
Threads: everything runs on the engine thread (messages and ticks come through
the flow inbox); messages go out from the flow I/O thread, which also asks a
quarantined wait's sender again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from kvduplex.engine.handle import EngineHandle
from kvduplex.kvflow.flow_io import CheckSender
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import TearDownEndpoint
from kvduplex.kvflow.half import FlowHalf
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import Log
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.receive import Acknowledged
from kvduplex.kvflow.machines.receive import Alive
from kvduplex.kvflow.machines.receive import Asked
from kvduplex.kvflow.machines.receive import AskSender
from kvduplex.kvflow.machines.receive import Begin
from kvduplex.kvflow.machines.receive import Cancel
from kvduplex.kvflow.machines.receive import Count
from kvduplex.kvflow.machines.receive import FlowDone
from kvduplex.kvflow.machines.receive import FlowFailed
from kvduplex.kvflow.machines.receive import FlowFirstToken
from kvduplex.kvflow.machines.receive import Forget
from kvduplex.kvflow.machines.receive import NotSent
from kvduplex.kvflow.machines.receive import ReceiveAction
from kvduplex.kvflow.machines.receive import ReceiveCounter
from kvduplex.kvflow.machines.receive import ReceiveEvent
from kvduplex.kvflow.machines.receive import ReceiveMachine
from kvduplex.kvflow.machines.receive import SenderEnded
from kvduplex.kvflow.machines.receive import SenderGone
from kvduplex.kvflow.machines.receive import Tick
from kvduplex.kvflow.machines.receive import WaitFailure
from kvduplex.kvflow.messages import KVAlive
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.kvflow.messages import ids_digest
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)

OnDone = Callable[[KVDone], None]
OnFailed = Callable[[WaitFailure, str], None]
OnFirstToken = Callable[[int], None]


@dataclass
class _Wait:
    """A wait's machine and the flow's callbacks (called on the engine thread)."""

    machine: ReceiveMachine
    on_done: OnDone
    on_failed: OnFailed
    on_first_token: OnFirstToken | None = None


@dataclass
class KVReceiverStats:
    """This instance's waits since it started (decode serves some on push stats)."""

    num_received: int = 0
    """Waits the sender ended with KVDone in time."""
    num_received_blocks: int = 0
    num_failed: int = 0
    """Waits that fell back: the sender gave up, the deadline passed, or a cancel."""
    num_late: int = 0
    """KVDone/KVFailed that arrived after the deadline had passed."""
    num_alive_received: int = 0
    num_teardowns: int = 0
    """Quarantines given up without the sender's word (its process gone, or, without a
    way to tell, after one quarantine), tearing its endpoint down."""
    num_quarantine_asks: int = 0
    """Senders asked again (KVCancel) to confirm that nothing can land."""
    num_registrations_resent: int = 0
    """Registrations sent again because the sender had not acknowledged them."""

    def count(self, counter: ReceiveCounter, n: int = 1) -> None:
        """Add ``n`` to the statistic a machine's `Count` names."""
        match counter:
            case ReceiveCounter.RECEIVED:
                self.num_received += n
            case ReceiveCounter.RECEIVED_BLOCKS:
                self.num_received_blocks += n
            case ReceiveCounter.FAILED:
                self.num_failed += n
            case ReceiveCounter.LATE:
                self.num_late += n
            case ReceiveCounter.ALIVE_RECEIVED:
                self.num_alive_received += n
            case ReceiveCounter.TEARDOWNS:
                self.num_teardowns += n
            case ReceiveCounter.QUARANTINE_ASKS:
                self.num_quarantine_asks += n
            case ReceiveCounter.REGISTRATIONS_RESENT:
                self.num_registrations_resent += n
            case _:
                assert_never(counter)


class KVReceiver(FlowHalf):
    """Waits for senders to fill registered blocks, with deadlines and quarantine."""

    def __init__(
        self, transport: Transport, engine: EngineHandle, inbox: FlowInbox, io: FlowIO,
        wait_s: float, quarantine_s: float, peer_gone: Callable[[str], bool] | None = None,
        reconnect: Callable[[str], PeerHandle | None] | None = None,
    ) -> None:  # fmt: skip
        """``peer_gone(engine_id)``: whether a sender's process is known to be gone (its
        address refuses connections or another engine answers there; blocking, asked
        on the flow I/O thread, which also connects afresh to ask a sender whose
        endpoint is gone). With it, quarantined blocks whose sender never confirmed
        are held, and the sender asked again every ``quarantine_s``, until it confirms
        or is gone: our own teardown does not stop a peer's one-sided WRITEs. Without
        it, they go back after one ``quarantine_s`` and a teardown (in-process tests)."""
        super().__init__(transport, engine, inbox, io)
        self.wait_s = wait_s
        self.quarantine_s = quarantine_s
        self.peer_gone = peer_gone
        self.reconnect = reconnect
        self.stats = KVReceiverStats()
        self._waits: dict[str, _Wait] = {}
        self.on_unexpected_end: Callable[[KVDone | KVFailed, str], bool] | None = None
        """Offered an end for a transfer this receiver has not registered (a flow that
        keeps specs before admission takes it); returns whether it was taken."""
        inbox.on(KVDone, self._on_end_notif)
        inbox.on(KVFailed, self._on_end_notif)
        inbox.on(KVAlive, self._on_alive_notif)
        inbox.on(KVRegistered, self._on_registered_notif)
        inbox.every_tick(self._tick)

    # ---- engine thread ----

    def expect(
        self,
        xid: str,
        peer: PeerHandle,
        blocks: list[int],
        first_block: int,
        token_ids: Sequence[int],
        on_done: OnDone,
        on_failed: OnFailed,
        on_first_token: OnFirstToken | None = None,
    ) -> bool:
        """Register `blocks` (for the transfer's blocks ``first_block ..``) with the sender,
        for the KV of `token_ids` (their count and `ids_digest`: the sender refuses a
        registration for other ids).

        Takes our own reference on them until the sender is done. False (nothing
        kept, nothing called) if the registration could not be sent, or if another
        wait (or its quarantine) holds `xid`. Until the sender acknowledges it, the
        registration is sent again every third of the wait (`_tick`).
        """
        msg = KVRegister(
            xid, blocks, first_block, len(token_ids), self.wait_s, self.wait_s,
            ids_digest(token_ids),
        )  # fmt: skip
        now = time.monotonic()
        machine = ReceiveMachine(
            xid, peer, tuple(blocks), msg, self.wait_s, self.quarantine_s, deadline=now + self.wait_s,
            reg_sent_at=now, wants_first_token=on_first_token is not None,
            can_ask=self.peer_gone is not None,
        )  # fmt: skip
        wait = _Wait(machine, on_done, on_failed, on_first_token)
        if xid in self._waits:
            logger.warning("xid=%s: already waited on; not registering again", xid)
            return False
        self._waits[xid] = wait
        self._feed(wait, Begin())
        try:
            self.transport.send_notif(peer, self.codec.encode(msg), xid)
        except Exception as exc:
            logger.warning("xid=%s: cannot register with %s: %s", xid, peer.engine_id, exc)
            self._feed(wait, NotSent())
            return False
        return True

    def cancel(self, xid: str, reason: str) -> bool:
        """Stop waiting for `xid` now (its flow falls back); False if unknown or over."""
        wait = self._waits.get(xid)
        if wait is None or wait.machine.fell_back:
            return False
        self._feed(wait, Cancel(reason, time.monotonic()))
        return True

    # ---- running machines ----

    def _feed(self, wait: _Wait, event: ReceiveEvent) -> None:
        """Apply ``event``, then carry the actions out, in order."""
        for a in wait.machine.handle(event):
            self._do(wait, a)

    def _do(self, wait: _Wait, a: ReceiveAction) -> None:
        m = wait.machine
        match a:
            case AcquireBlocks():
                self.engine.acquire_blocks(list(a.block_ids))
            case ReleaseBlocks():
                self.engine.release_blocks(list(a.block_ids))
            case Tell():
                self.tell(m.peer, a.msg)
            case FlowFirstToken() | FlowDone() | FlowFailed():
                self._call_flow(wait, a)
            case AskSender():
                assert self.peer_gone is not None, "asked only when it can ask"
                self.io.submit(CheckSender(m.xid, m.peer, self, self.peer_gone, self.reconnect))
            case TearDown():  # NIXL's disconnect takes its locks: not on the engine thread
                self.io.submit(TearDownEndpoint(m.peer, a.why, m.xid))
            case Count():
                self.stats.count(a.counter, a.n)
            case Log():
                logger.log(a.level, "xid=%s: %s", m.xid, a.text)
            case Forget():
                if self._waits.get(m.xid) is wait:
                    del self._waits[m.xid]
            case _:
                assert_never(a)

    def _call_flow(self, wait: _Wait, a: FlowFirstToken | FlowDone | FlowFailed) -> None:
        """Engine thread: the flow hears how its wait went."""
        if isinstance(a, FlowDone):
            wait.on_done(a.msg)
        elif isinstance(a, FlowFailed):
            wait.on_failed(a.cause, a.reason)
        elif wait.on_first_token is not None:
            wait.on_first_token(a.token)

    def _on_end(self, msg: KVDone | KVFailed, sender: str) -> None:
        """The sender is done with ``msg.xid``: no WRITE can land any more."""
        wait = self._waits.get(msg.xid)
        if wait is None:
            taken = self.on_unexpected_end is not None and self.on_unexpected_end(msg, sender)
            if not taken:
                logger.info("xid=%s: message from %s for no pending transfer", msg.xid, sender)
            return
        self._feed(wait, SenderEnded(msg, sender))

    def on_sender_checked(self, xid: str, gone: bool, now: float) -> None:
        """The flow I/O thread's answer to `AskSender`: the sender is gone, or was asked
        again to confirm."""
        wait = self._waits.get(xid)
        if wait is None:
            return
        self._feed(wait, SenderGone("the sender is gone") if gone else Asked(now))

    # ---- inbox (engine thread) ----

    def _on_end_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        assert isinstance(msg, KVDone | KVFailed)
        self._on_end(msg, sender)

    def _on_alive_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        """The sender still holds ``xid``: restart the wait."""
        assert isinstance(msg, KVAlive)
        wait = self._waits.get(msg.xid)
        if wait is not None:
            self._feed(wait, Alive(sender, msg.sent_at, received_at))

    def _on_registered_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        """The sender holds our registration of ``xid``: stop re-sending it."""
        wait = self._waits.get(msg.xid)
        if wait is not None:
            self._feed(wait, Acknowledged(sender))

    def _tick(self, now: float) -> None:
        for wait in list(self._waits.values()):
            self._feed(wait, Tick(now))

    def is_waiting(self, xid: str) -> bool:
        """Whether a wait (or its quarantine) holds `xid`."""
        return xid in self._waits

    def num_waiting(self) -> int:
        return len(self._waits)


__all__ = ["KVReceiver", "KVReceiverStats", "OnDone", "OnFailed", "WaitFailure"]
