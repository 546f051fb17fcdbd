"""The flow I/O thread: messages and calls that may block, off the engine thread.

The engine thread owns every flow's state and never waits on the network. What
may block goes here as a typed request, one thread carries them out in order,
and a failure is logged (or, for `CheckSender`, its answer goes back to the
flow inbox as `SenderChecked`)::

    engine thread ── Notify / NotifyEngine / CheckSender / TearDownEndpoint /
                     ReleaseLease ──► queue ──► kv-flow-io thread ──► transport, HTTP

A notification to a peer whose endpoint a teardown removed connects afresh
first (``reconnect``): a KVFailed must reach its receiver, or its blocks stay
quarantined.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
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


IORequest = Notify | NotifyEngine | CheckSender | TearDownEndpoint | ReleaseLease


class FlowIO:
    """One instance's flow I/O thread; `submit` from the engine thread, `close` at exit."""

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
        self._queue: queue.SimpleQueue[IORequest | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, request: IORequest) -> None:
        if self._closed:
            logger.info("flow I/O closed; dropping %s", type(request).__name__)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-flow-io", daemon=True)
            self._thread.start()
        self._queue.put(request)

    def close(self) -> None:
        """Stop the thread after what was submitted (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                self.carry_out(request)
            except Exception:
                logger.exception("flow I/O %s failed", type(request).__name__)

    def carry_out(self, request: IORequest) -> None:
        """Do ``request`` now, on the calling thread (the I/O thread, or a test)."""
        match request:
            case Notify(peer, msg, reconnect, level):
                self._notify(peer, msg, reconnect, level)
            case NotifyEngine(engine_id, msg, level):
                found = self.peer_of(engine_id) if self.peer_of is not None else None
                if found is None and self.reconnect is not None:
                    found = self.reconnect(engine_id)
                if found is None:
                    logger.info("xid=%s: cannot tell %s: not connected", msg.xid, engine_id)
                    return
                self._notify(found, msg, True, level)
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

    def _notify(self, peer: PeerHandle, msg: ControlMessage, reconnect: bool, level: int) -> None:
        try:
            self.transport.send_notif(peer, self.codec.encode(msg), msg.xid)
            return
        except Exception as exc:
            problem: Exception = exc
        fresh = self.reconnect(peer.engine_id) if reconnect and self.reconnect else None
        if fresh is not None:
            try:
                self.transport.send_notif(fresh, self.codec.encode(msg), msg.xid)
                return
            except Exception as exc:
                problem = exc
        logger.log(level, "xid=%s: cannot tell %s: %s", msg.xid, peer.engine_id, problem)

    def _check_sender(self, check: CheckSender) -> None:
        xid, peer = check.xid, check.peer
        engine_id = peer.engine_id
        try:
            gone = check.peer_gone(engine_id)
        except Exception:
            logger.exception("xid=%s: cannot tell whether %s is gone", xid, engine_id)
            gone = False
        if not gone:
            if not self.transport.is_connected(engine_id) and check.reconnect is not None:
                peer = check.reconnect(engine_id) or peer
            logger.warning("xid=%s: quarantined blocks unconfirmed; asking %s again",
                           xid, engine_id)  # fmt: skip
            self._notify(peer, KVCancel(xid, "still waiting for confirmation"), False,
                         logging.INFO)  # fmt: skip
        self.inbox.put(SenderChecked(xid, gone, check.to))


__all__ = [
    "CheckSender", "FlowIO", "IORequest", "Notify", "NotifyEngine", "ReleaseLease",
    "TearDownEndpoint",
]  # fmt: skip
