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

Threads: waits are created and ended on the engine thread; the pump only
takes ``_lock`` (which guards ``_waits``) and queues engine calls.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import msgspec

from kvduplex.engine.connector import EngineHandle
from kvduplex.kvflow.half import FlowHalf
from kvduplex.kvflow.messages import KVAlive
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.kvflow.sender import HEARTBEATS_PER_WAIT
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.notify import Handler
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)


class WaitFailure(enum.Enum):
    """Why a wait ended without the KV (a metrics label too)."""

    SENDER_FAILED = "sender_failed"
    """KVFailed: nothing is in flight any more; the blocks may be reused."""
    DEADLINE = "deadline"
    CANCELLED = "cancelled"

    @property
    def may_still_be_written(self) -> bool:
        """A late WRITE may still land in the registered blocks: compute elsewhere."""
        return self is not WaitFailure.SENDER_FAILED


OnDone = Callable[[KVDone], None]
OnFailed = Callable[[WaitFailure, str], None]
OnFirstToken = Callable[[int], None]


@dataclass
class _Wait:
    xid: str
    peer: PeerHandle
    blocks: list[int]
    """Our own references on the registered blocks (released when the sender is done)."""
    deadline: float
    on_done: OnDone
    on_failed: OnFailed
    reg: KVRegister
    """What we registered (re-sent, with what is left of the wait, until acknowledged)."""
    reg_sent_at: float
    on_first_token: OnFirstToken | None = None
    """The sender's first token, when it ends without the KV (KVFailed, or any end
    after we fell back): the fallback continues from it."""
    is_registered: bool = False
    """The sender acknowledged the registration (KVRegistered or a KVAlive)."""
    fell_back: bool = False
    quarantine_until: float = 0.0
    expiring: bool = False


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


class KVReceiver(FlowHalf):
    """Waits for senders to fill registered blocks, with deadlines and quarantine."""

    def __init__(
        self, transport: Transport, engine: EngineHandle, wait_s: float, quarantine_s: float,
        peer_gone: Callable[[str], bool] | None = None,
        reconnect: Callable[[str], PeerHandle | None] | None = None,
    ) -> None:  # fmt: skip
        """``peer_gone(engine_id)``: whether a sender's process is known to be gone (its
        address refuses connections or another engine answers there; blocking). With
        it, quarantined blocks whose sender never confirmed are held, and the sender
        asked again every ``quarantine_s``, until it confirms or is gone: our own
        teardown does not stop a peer's one-sided WRITEs. Without it, they go back
        after one ``quarantine_s`` and a teardown (in-process tests).
        ``reconnect(engine_id)``: connect afresh to ask a sender whose endpoint is gone."""
        super().__init__(transport, engine)
        self.wait_s = wait_s
        self.quarantine_s = quarantine_s
        self.peer_gone = peer_gone
        self.reconnect = reconnect
        self.stats = KVReceiverStats()
        self._waits: dict[str, _Wait] = {}
        self._asker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-recv-ask")

    def _notif_handlers(self) -> dict[type[ControlMessage], Handler]:
        return {
            KVDone: self._on_end_notif,
            KVFailed: self._on_end_notif,
            KVAlive: self._on_alive_notif,
            KVRegistered: self._on_registered_notif,
        }

    # ---- engine thread ----

    def expect(
        self,
        xid: str,
        peer: PeerHandle,
        blocks: list[int],
        first_block: int,
        num_tokens: int,
        on_done: OnDone,
        on_failed: OnFailed,
        on_first_token: OnFirstToken | None = None,
    ) -> bool:
        """Register `blocks` (for the transfer's blocks ``first_block ..``) with the sender.

        Takes our own reference on them until the sender is done. False (nothing
        kept, nothing called) if the registration could not be sent, or if another
        wait (or its quarantine) holds `xid`. Until the sender acknowledges it, the
        registration is sent again every third of the wait (`_tick`).
        """
        msg = KVRegister(xid, blocks, first_block, num_tokens, self.wait_s, self.wait_s)
        now = time.monotonic()
        wait = _Wait(
            xid, peer, list(blocks), now + self.wait_s, on_done, on_failed, reg=msg,
            reg_sent_at=now, on_first_token=on_first_token,
        )  # fmt: skip
        with self._lock:
            if xid in self._waits:
                logger.warning("xid=%s: already waited on; not registering again", xid)
                return False
            self._waits[xid] = wait
        self.engine.acquire_blocks(blocks)
        try:
            self.transport.send_notif(peer, self.codec.encode(msg), xid)
        except Exception as exc:
            logger.warning("xid=%s: cannot register with %s: %s", xid, peer.engine_id, exc)
            with self._lock:
                self._waits.pop(xid, None)
            self.engine.release_blocks(blocks)
            return False
        return True

    def cancel(self, xid: str, reason: str) -> bool:
        """Stop waiting for `xid` now (its flow falls back); False if unknown or over."""
        with self._lock:
            wait = self._waits.get(xid)
        if wait is None or wait.fell_back:
            return False
        self._give_up(wait, reason, WaitFailure.CANCELLED)
        return True

    def _on_end(self, msg: KVDone | KVFailed, sender: str) -> None:
        """The sender is done with ``msg.xid``: no WRITE can land any more."""
        wait = self._pop_wait(msg.xid, sender)
        if wait is None:
            return
        self.engine.release_blocks(wait.blocks)
        first_token = msg.first_token
        if wait.on_first_token is not None and first_token is not None and (
            wait.fell_back or isinstance(msg, KVFailed)
        ):
            wait.on_first_token(first_token)
        if wait.fell_back:
            self.stats.num_late += 1
        elif isinstance(msg, KVDone):
            self.stats.num_received += 1
            self.stats.num_received_blocks += len(wait.blocks)
            wait.on_done(msg)
        else:
            self.stats.num_failed += 1
            logger.warning("xid=%s: the sender gave up (%s)", msg.xid, msg.reason)
            wait.on_failed(WaitFailure.SENDER_FAILED, msg.reason)

    def _pop_wait(self, xid: str, sender: str) -> _Wait | None:
        with self._lock:
            wait = self._waits.get(xid)
            if wait is None:
                logger.info("xid=%s: message from %s for no pending transfer", xid, sender)
                return None
            if sender != wait.peer.engine_id:
                logger.warning(
                    "xid=%s: message from %s, expected %s; ignored",
                    xid,
                    sender,
                    wait.peer.engine_id,
                )
                return None
            return self._waits.pop(xid)

    def _give_up(self, wait: _Wait, reason: str, cause: WaitFailure) -> None:
        """Stop waiting: the flow falls back; quarantine the registered blocks."""
        with self._lock:
            wait.fell_back = True
            wait.quarantine_until = time.monotonic() + self.quarantine_s
        self.stats.num_failed += 1
        logger.warning("xid=%s: %s; falling back", wait.xid, reason)
        self._tell(wait.peer, KVCancel(wait.xid, reason))
        wait.on_failed(cause, reason)

    def _expire(self, wait: _Wait) -> None:
        with self._lock:
            wait.expiring = False
            current = self._waits.get(wait.xid) is wait
        if not current:
            return
        if not wait.fell_back:
            if time.monotonic() > wait.deadline:
                self._give_up(
                    wait, f"no word from the sender for {self.wait_s:g} s", WaitFailure.DEADLINE
                )
            return
        if self.peer_gone is None:
            self._release_unconfirmed(wait, "no word from the sender")
            return
        # Only the sender can say that nothing of its can land: ask it again (off this
        # thread: it may need a handshake), unless its process is gone.
        with self._lock:
            wait.expiring = True  # until the answer to the asking
        self._asker.submit(self._ask_sender, wait)

    def _ask_sender(self, wait: _Wait) -> None:
        """Asker thread: is the sender gone? else ask it to confirm (KVCancel again)."""
        assert self.peer_gone is not None
        engine_id = wait.peer.engine_id
        try:
            gone = self.peer_gone(engine_id)
        except Exception:
            logger.exception("xid=%s: cannot tell whether %s is gone", wait.xid, engine_id)
            gone = False
        if gone:
            self.engine.call(partial(self._release_unconfirmed, wait, "the sender is gone"))
            return
        peer = wait.peer
        if not self.transport.is_connected(engine_id) and self.reconnect is not None:
            peer = self.reconnect(engine_id) or peer
        logger.warning("xid=%s: quarantined blocks unconfirmed; asking %s again", wait.xid,
                       engine_id)  # fmt: skip
        self._tell(peer, KVCancel(wait.xid, "still waiting for confirmation"))
        self.engine.call(partial(self._requarantine, wait))

    def _requarantine(self, wait: _Wait) -> None:
        with self._lock:
            wait.quarantine_until = time.monotonic() + self.quarantine_s
            wait.expiring = False
            self.stats.num_quarantine_asks += 1

    def _release_unconfirmed(self, wait: _Wait, why: str) -> None:
        """Engine thread: give quarantined blocks back without the sender's word."""
        with self._lock:
            if self._waits.get(wait.xid) is not wait:
                return  # confirmed meanwhile
            del self._waits[wait.xid]
        logger.warning(
            "xid=%s: %s (%s); tearing its endpoint down and releasing quarantined blocks",
            wait.xid, why, wait.peer.engine_id,
        )  # fmt: skip
        self.stats.num_teardowns += 1
        self.transport.disconnect(wait.peer)
        self.engine.release_blocks(wait.blocks)

    # ---- pump thread ----

    def _on_end_notif(self, msg: ControlMessage, sender: str) -> None:
        assert isinstance(msg, KVDone | KVFailed)
        self.engine.call(lambda: self._on_end(msg, sender))

    def _on_alive_notif(self, msg: ControlMessage, sender: str) -> None:
        """The sender still holds ``xid``: restart the wait (nothing to do in the engine)."""
        assert isinstance(msg, KVAlive)
        now = time.monotonic()
        with self._lock:
            wait = self._waits.get(msg.xid)
            if wait is None or wait.fell_back or sender != wait.peer.engine_id:
                return  # no answer: the sender's deadline stays where ours was
            wait.deadline = max(wait.deadline, now + self.wait_s)
            wait.is_registered = True
            self.stats.num_alive_received += 1
            peer = wait.peer
        self._tell(peer, KVAliveAck(msg.xid, msg.sent_at))

    def _on_registered_notif(self, msg: ControlMessage, sender: str) -> None:
        """The sender holds our registration of ``xid``: stop re-sending it."""
        with self._lock:
            wait = self._waits.get(msg.xid)
            if wait is not None and sender == wait.peer.engine_id:
                wait.is_registered = True

    def _tick(self, now: float) -> None:
        due: list[_Wait] = []
        resend: list[tuple[PeerHandle, KVRegister]] = []
        with self._lock:
            for wait in self._waits.values():
                limit = wait.quarantine_until if wait.fell_back else wait.deadline
                if now > limit and not wait.expiring:
                    wait.expiring = True
                    due.append(wait)
                elif (
                    not wait.fell_back
                    and not wait.is_registered
                    and now - wait.reg_sent_at >= self.wait_s / HEARTBEATS_PER_WAIT
                ):
                    wait.reg_sent_at = now
                    left = wait.deadline - now
                    resend.append((wait.peer, msgspec.structs.replace(wait.reg, time_left_s=left)))
            self.stats.num_registrations_resent += len(resend)
        for wait in due:
            self.engine.call(partial(self._expire, wait))
        for peer, reg in resend:
            logger.info("xid=%s: registration not acknowledged; sending it again", reg.xid)
            self._tell(peer, reg)

    def is_waiting(self, xid: str) -> bool:
        """Whether a wait (or its quarantine) holds `xid`."""
        with self._lock:
            return xid in self._waits

    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waits)


__all__ = ["KVReceiver", "KVReceiverStats", "OnDone", "OnFailed", "WaitFailure"]
