"""How each connected peer is used: the facts that decide when a peer may be forgotten.

A transport records, per peer engine id, when it last used the peer (a transfer
posted, a notification sent to it or received from it, a connect), how many of
its transfers with the peer are not settled yet (`TransferHandle.settled`: a
byte of theirs may still move), and whether a transfer or a notification to it
failed for a reason on the peer's side. `PeerDirectory.sweep` reads them
(`PeerUsage.get`) to forget peers that left, and `why_forget` is its rule::

    unsettled transfers with it ──────────────────────────► keep (never torn down
                                                             while one may still land)
    its handshake refused (the directory's own mark) ─────► forget: refused
    a transfer / notification to it failed ───────────────► forget: failed
    unused for idle_s (no post, no notification) ─────────► forget: idle
    else ─────────────────────────────────────────────────► keep

Entries of disconnected peers go once their last transfer settled, so the
table holds the connected peers and those with a transfer still in flight.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from dataclasses import replace
from typing import TypeVar

from kvduplex.transport.protocol import TransferHandle

V = TypeVar("V")


class ForgetReason(enum.Enum):
    """Why a peer was forgotten (a metrics label)."""

    REFUSED = "refused"
    """Its address refused the handshake (nothing listens there, or not a member)."""
    FAILED = "failed"
    """A transfer or a notification to it failed on its side."""
    IDLE = "idle"
    """Unused for longer than the directory's idle bound."""
    TORN_DOWN = "torn_down"
    """A flow tore its endpoint down already; only the directory's entry was left."""


@dataclass(frozen=True)
class PeerUse:
    """One peer's use, as `PeerUsage.get` reports it."""

    last_used: float
    """`time.monotonic()` of its last post, notification (either way) or connect."""
    num_unsettled: int = 0
    """Transfers with it that are not settled: while any, it is never torn down idly."""
    failed: str | None = None
    """Why the last failure on its side happened, or None (cleared by a connect)."""
    is_connected: bool = True


class PeerUsage:
    """Per peer engine id: last use, unsettled transfers, failure. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, PeerUse] = {}

    def connected(self, engine_id: str) -> None:
        """A (re)connect: the peer is in use and no failure of an earlier one counts."""
        now = time.monotonic()
        with self._lock:
            old = self._peers.get(engine_id)
            unsettled = 0 if old is None else old.num_unsettled
            self._peers[engine_id] = PeerUse(now, unsettled)

    def disconnected(self, engine_id: str) -> None:
        """The peer was disconnected: its entry goes once nothing with it is unsettled."""
        with self._lock:
            use = self._peers.get(engine_id)
            if use is None:
                return
            if use.num_unsettled == 0:
                del self._peers[engine_id]
            else:
                self._peers[engine_id] = replace(use, is_connected=False)

    def used(self, engine_id: str) -> None:
        """A notification went to or came from the peer."""
        now = time.monotonic()
        with self._lock:
            use = self._peers.get(engine_id)
            if use is not None:
                self._peers[engine_id] = replace(use, last_used=now)

    def posted(self, handle: TransferHandle) -> None:
        """A transfer with the peer was created: unsettled until its handle settles."""
        peer = handle.peer_engine_id
        now = time.monotonic()
        with self._lock:
            use = self._peers.get(peer) or PeerUse(now, is_connected=False)
            self._peers[peer] = replace(use, last_used=now, num_unsettled=use.num_unsettled + 1)
        handle.add_settled_callback(self._settled)

    def failed(self, engine_id: str, why: str) -> None:
        """A transfer or notification to the peer failed on its side."""
        with self._lock:
            use = self._peers.get(engine_id)
            if use is not None:
                self._peers[engine_id] = replace(use, failed=why)

    def get(self, engine_id: str) -> PeerUse | None:
        with self._lock:
            return self._peers.get(engine_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def _settled(self, handle: TransferHandle) -> None:
        peer = handle.peer_engine_id
        with self._lock:
            use = self._peers.get(peer)
            if use is None:
                return
            use = replace(use, num_unsettled=max(0, use.num_unsettled - 1))
            if use.num_unsettled == 0 and not use.is_connected:
                del self._peers[peer]
            else:
                self._peers[peer] = use


def why_forget(
    use: PeerUse | None, refused: bool, idle_s: float | None, now: float
) -> ForgetReason | None:
    """Why a connected peer should be forgotten now, or None to keep it (see the module
    docstring). ``refused``: its address refused the handshake; ``idle_s`` None: never
    for idleness alone."""
    if use is not None and use.num_unsettled > 0:
        return None
    if refused:
        return ForgetReason.REFUSED
    if use is None:
        return None
    if use.failed is not None:
        return ForgetReason.FAILED
    if idle_s is not None and now - use.last_used >= idle_s:
        return ForgetReason.IDLE
    return None


def remember_last(table: OrderedDict[str, V], key: str, value: V, limit: int) -> None:
    """Put ``key`` last in ``table``, dropping the oldest entries past ``limit``."""
    table.pop(key, None)
    table[key] = value
    while len(table) > limit:
        table.popitem(last=False)


__all__ = ["ForgetReason", "PeerUsage", "PeerUse", "remember_last", "why_forget"]
