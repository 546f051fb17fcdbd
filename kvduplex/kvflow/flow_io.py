"""The flow I/O threads: messages and calls that may block, off the engine thread.

The engine thread owns every flow's state and never waits on the network. What
may block goes here as a typed request; a failure is logged (and, for
`CheckSender`, its answer goes back to the flow inbox as `SenderChecked`,
also when the check failed).
Two threads carry the requests out, each in order, so that no HTTP call or
handshake to one stuck peer can hold up a notification to another::

    engine thread ── Notify / NotifyEngine ─────► sends ──► kv-flow-io ──► transport
                 └── CheckSender / TearDownEndpoint /       (a send that must connect
                     ReleaseLease ──► waits ──► kv-flow-wait  afresh goes to waits)
                                                 ──► HTTP, handshakes, disconnect

A notification to a peer whose endpoint a teardown removed connects afresh
first (``reconnect``): a KVFailed must reach its receiver, or its blocks stay
quarantined. Its first try is on the sends thread; the connecting and the
second try are on the waits thread, behind whatever else waits there.

`close` stops the sends thread after what was submitted, and the sends thread
then stops the waits thread, so that a send it hands over to connect afresh
while `close` runs is still carried out. A request that comes too late for a
thread (submitted after `close`) is logged, never dropped unseen.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import assert_never

from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.inbox import SenderChecked
from kvduplex.kvflow.inbox import SenderCheckTarget
from kvduplex.kvflow.messages import KVCancel
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)

PeerOf = Callable[[str], PeerHandle | None]


@dataclass(frozen=True)
class Notify:
    """Send ``msg`` to ``peer``; ``reconnect``: connect afresh and retry once if it fails;
    a message that cannot go is logged at ``failure_level``."""

    peer: PeerHandle
    msg: ControlMessage
    reconnect: bool = False
    failure_level: int = logging.INFO


@dataclass(frozen=True)
class NotifyEngine:
    """`Notify` the peer with this engine id, connecting if need be."""

    engine_id: str
    msg: ControlMessage
    failure_level: int = logging.WARNING


@dataclass(frozen=True)
class CheckSender:
    """Is ``peer`` (a quarantined wait's sender) gone (``peer_gone``)? If not, ask it
    again to confirm (KVCancel), connecting afresh (``reconnect``) if its endpoint is
    gone. The answer goes to ``to`` through the inbox."""

    xid: str
    peer: PeerHandle
    to: SenderCheckTarget
    peer_gone: Callable[[str], bool]
    reconnect: PeerOf | None


@dataclass(frozen=True)
class TearDownEndpoint:
    """Remove the endpoint to ``peer``: whatever of ours it still holds settles."""

    peer: PeerHandle
    why: str
    xid: str


@dataclass(frozen=True)
class ReleaseLease:
    """Tell prefill at ``prefill_url`` to drop its lease on ``xid`` (best effort)."""

    release: Callable[[str, str], None]
    prefill_url: str
    xid: str


@dataclass(frozen=True)
class _Reconnect:
    """A send that failed (or found no connection): connect to ``engine_id`` afresh and
    send ``msg`` once more (waits thread)."""

    engine_id: str
    msg: ControlMessage
    level: int


IORequest = Notify | NotifyEngine | CheckSender | TearDownEndpoint | ReleaseLease
_Blocking = CheckSender | TearDownEndpoint | ReleaseLease | _Reconnect


class FlowIO:
    """One instance's flow I/O threads; `submit` from the engine thread, `close` at exit."""

    def __init__(
        self, transport: Transport, inbox: FlowInbox, peer_of: PeerOf | None = None,
        reconnect: PeerOf | None = None,
    ) -> None:  # fmt: skip
        """``peer_of(engine_id)``: a connected peer; ``reconnect(engine_id)``: connect
        afresh (blocking)."""
        self.transport = transport
        self.inbox = inbox
        self.peer_of = peer_of
        self.reconnect = reconnect
        self.codec = MessageCodec()
        self._sends: queue.SimpleQueue[Notify | NotifyEngine | None] = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[_Blocking | None] = queue.SimpleQueue()
        self._send_thread: threading.Thread | None = None
        self._wait_thread: threading.Thread | None = None
        self._closed = False

    def submit(self, request: IORequest) -> None:
        if self._closed:
            logger.info("flow I/O closed; dropping %s", type(request).__name__)
            return
        if self._send_thread is None:  # both at once, here on the engine thread
            self._send_thread = threading.Thread(
                target=self._run_sends, name="kv-flow-io", daemon=True
            )
            self._wait_thread = threading.Thread(
                target=self._run_waits, name="kv-flow-wait", daemon=True
            )
            self._send_thread.start()
            self._wait_thread.start()
        match request:
            case Notify() | NotifyEngine():
                self._sends.put(request)
            case CheckSender() | TearDownEndpoint() | ReleaseLease():
                self._waits.put(request)
            case _:
                assert_never(request)

    def close(self) -> None:
        """Stop the threads after what was submitted, and the sends it hands over to
        connect afresh (idempotent; does not wait)."""
        if self._closed:
            return
        self._closed = True
        self._sends.put(None)  # the sends thread stops the waits thread once it ends
        if self._send_thread is None:
            self._waits.put(None)

    def _run_sends(self) -> None:
        self._run(self._sends)
        self._waits.put(None)  # after every send this thread handed over to reconnect
        self._log_left(self._sends)

    def _run_waits(self) -> None:
        self._run(self._waits)
        self._log_left(self._waits)

    def _run(self, requests: queue.SimpleQueue[Any]) -> None:
        while (request := requests.get()) is not None:
            try:
                self._carry_out(request, self._waits.put)
            except Exception:
                logger.exception("flow I/O %s failed", type(request).__name__)

    @staticmethod
    def _log_left(requests: queue.SimpleQueue[Any]) -> None:
        """The thread ended: what was queued behind its end is not carried out."""
        while True:
            try:
                request = requests.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                logger.warning("flow I/O closed; dropping %s (xid=%s)",
                               type(request).__name__, _xid_of(request))  # fmt: skip

    def carry_out(self, request: IORequest) -> None:
        """Do ``request`` now and wholly, on the calling thread (a test's stepper)."""
        self._carry_out(request, self._carry_out_now)

    def _carry_out_now(self, request: _Blocking) -> None:
        self._carry_out(request, self._carry_out_now)

    def _carry_out(self, request: IORequest | _Reconnect, later: Callable[[_Blocking], None]) -> None:
        """Do ``request``; what it must connect for goes to ``later``."""
        match request:
            case Notify(peer, msg, reconnect, level):
                if not self._try_send(peer, msg, level if not reconnect else None):
                    later(_Reconnect(peer.engine_id, msg, level))
            case NotifyEngine(engine_id, msg, level):
                found = self.peer_of(engine_id) if self.peer_of is not None else None
                if found is None or not self._try_send(found, msg, None):
                    later(_Reconnect(engine_id, msg, level))
            case _Reconnect(engine_id, msg, level):
                fresh = self.reconnect(engine_id) if self.reconnect is not None else None
                if fresh is None:
                    logger.log(level, "xid=%s: cannot tell %s: not connected", msg.xid, engine_id)
                    return
                self._try_send(fresh, msg, level)
            case CheckSender():
                self._check_sender(request)
            case TearDownEndpoint(peer, why, xid):
                logger.warning("xid=%s: %s; tearing the endpoint with %s down",
                               xid, why, peer.engine_id)  # fmt: skip
                self.transport.disconnect(peer)
            case ReleaseLease(release, prefill_url, xid):
                release(prefill_url, xid)
            case _:
                assert_never(request)

    def _try_send(self, peer: PeerHandle, msg: ControlMessage, level: int | None) -> bool:
        """Send once; a failure is logged at ``level`` (None: not logged, retried)."""
        try:
            self.transport.send_notif(peer, self.codec.encode(msg), msg.xid)
            return True
        except Exception as exc:
            if level is not None:
                logger.log(level, "xid=%s: cannot tell %s: %s", msg.xid, peer.engine_id, exc)
            return False

    def _check_sender(self, check: CheckSender) -> None:
        """Answer ``check`` through the inbox, whatever fails on the way (logged): its wait
        asks nothing more until the answer comes, so a lost answer would hold its
        quarantined blocks until the sender itself spoke. A check that failed answers
        "not gone": the wait asks again after its next quarantine."""
        xid, peer = check.xid, check.peer
        engine_id = peer.engine_id
        try:
            gone = check.peer_gone(engine_id)
        except Exception:
            logger.exception("xid=%s: cannot tell whether %s is gone", xid, engine_id)
            gone = False
        try:
            if not gone:
                if not self.transport.is_connected(engine_id) and check.reconnect is not None:
                    peer = check.reconnect(engine_id) or peer
                logger.warning("xid=%s: quarantined blocks unconfirmed; asking %s again",
                               xid, engine_id)  # fmt: skip
                self._try_send(peer, KVCancel(xid, "still waiting for confirmation"), logging.INFO)
        except Exception:
            logger.exception("xid=%s: cannot ask %s again", xid, engine_id)
        finally:
            self.inbox.put(SenderChecked(xid, gone, check.to))


def _xid_of(request: IORequest | _Reconnect) -> str:
    match request:
        case Notify() | NotifyEngine() | _Reconnect():
            return request.msg.xid
        case CheckSender() | TearDownEndpoint() | ReleaseLease():
            return request.xid
        case _:
            assert_never(request)


__all__ = [
    "CheckSender", "FlowIO", "IORequest", "Notify", "NotifyEngine", "ReleaseLease",
    "TearDownEndpoint",
]  # fmt: skip
