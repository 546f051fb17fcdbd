"""What the transport speaks: regions, transfer states and handles, notifications, errors.

The interface itself, `Transport` (move KV regions between two instances'
pools), is the abstract base class in `kvduplex.transport.base`.

A *region* is one (layer, K|V, block) slice of a pool, ``layout.block_bytes``
long (see `kvduplex.engine.kv_cache`). Each transport registers its whole pool
once and prepares one descriptor per region; a peer's descriptors are prepared
once at `Transport.connect`. A transfer then only names region *indices*::

    index = (layer * 2 + kv) * num_blocks + block

Transfers are one-sided: the initiator WRITEs its regions into the peer's or
READs the peer's into its own; the peer's CPU is not involved beyond polling
its agent. A WRITE may carry a notification that the target receives once,
after the data landed, through `Transport.poll_notifs`.

Lifecycle of a transfer (``xid`` chosen by the caller)::

    transfer() ──► PENDING ──► DONE ───────────────────────────────► settled
                      │
                      └──────► FAILED (reason: peer error, deadline, disconnect)
                                 │ nothing can move any more ──────► settled
                                 └ may still land (a deadline ended the wait,
                                   not the transfer) ── backend done with it,
                                   or the peer's endpoint torn down ► settled

*Final* (DONE or FAILED) ends the caller's wait; *settled* says that no byte
of the transfer can reach either pool any more. Between the two, a FAILED
transfer "may still land": its source and target blocks must stay referenced
(never reused, recomputed into, or inserted into a prefix cache) until it is
settled. A DONE transfer is settled when it finishes.

Every transfer has a deadline. ``transfer`` never raises for transport
failures: it returns a handle, possibly already FAILED. It raises
``ValueError`` only for caller bugs (block ids out of range, length mismatch,
a notification on a READ).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.kv_layout import KVKind

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    """Where a transfer is; DONE and FAILED are final."""

    PENDING = "pending"
    """Posted; the data may be on its way."""
    DONE = "done"
    """Every descriptor landed; a notification, if any, reaches the peer after the data."""
    FAILED = "failed"
    """Ended without a guarantee about the target's bytes; `FailureKind` says why."""


class TransferOp(enum.Enum):
    """Direction of a transfer, seen from its initiator."""

    WRITE = "write"
    """The initiator's regions into the peer's; may carry a notification."""
    READ = "read"
    """The peer's regions into the initiator's; never notifies the peer."""


class FailureKind(enum.Enum):
    """Why a transfer failed (a metrics label; the reason string has the details)."""

    DEADLINE = "deadline"
    PEER = "peer"
    """The transport reported an error (peer died, connection lost)."""
    POST = "post"
    """The transfer could not be posted."""
    DISCONNECTED = "disconnected"
    """`Transport.disconnect` or `Transport.close` while in flight."""
    INJECTED = "injected"
    """Fault injection of the in-process fake."""


@dataclass(frozen=True)
class Region:
    """One (layer, K|V, block) region of a pool."""

    layer: int
    kv: KVKind
    block: int


ALL_KINDS: tuple[KVKind, ...] = (KVKind.K, KVKind.V)


class TransferError(Exception):
    """Base of the transfer layer's errors."""


class TransferFailed(TransferError):
    """A transfer ended FAILED; carries its transfer id and the reason."""

    def __init__(self, xid: str, reason: str) -> None:
        super().__init__(f"transfer {xid} failed: {reason}")
        self.xid = xid
        self.reason = reason


class IncompatibleLayoutError(TransferError):
    """A peer's pool cannot exchange blocks with ours; the message says what differs."""


class IncompatibleModelError(IncompatibleLayoutError):
    """A peer serves something else (its `ModelFingerprint` differs from ours): its KV
    would be wrong here and ours there. The message names each field that differs."""


class PeerUnavailableError(TransferError):
    """A peer could not be reached (handshake, notification)."""


@dataclass(frozen=True)
class PeerHandle:
    """A connected peer, returned by `Transport.connect`. Opaque to callers."""

    engine_id: str
    agent_name: str
    layout: KVCacheLayout


@dataclass(frozen=True)
class Notification:
    """A notification received from a peer.

    ``xid`` is the transfer id of the WRITE that carried it, or the one given
    to `Transport.send_notif`. ``payload`` is the sender's bytes, typically a
    `kvduplex.transport.messages.MessageCodec`-encoded `ControlMessage`.
    """

    peer_engine_id: str
    xid: str | None
    payload: bytes


DoneCallback = Callable[["TransferHandle"], None]


class TransferHandle:
    """The state of one posted transfer. Thread-safe.

    The transport finishes a handle exactly once (DONE or FAILED), then calls
    the done callbacks on the finishing thread (usually the progress thread):
    callbacks must be quick and must not raise (exceptions are logged).
    """

    def __init__(
        self,
        xid: str,
        op: TransferOp,
        peer_engine_id: str,
        num_descriptors: int,
        num_bytes: int,
        deadline_s: float,
    ) -> None:
        self.xid = xid
        self.op = op
        self.peer_engine_id = peer_engine_id
        self.num_descriptors = num_descriptors
        self.num_bytes = num_bytes
        self.deadline_s = deadline_s
        self.created_at = time.monotonic()
        self.expires_at = self.created_at + deadline_s
        self.post_time_s = 0.0
        """Seconds the caller's transfer() took (the caller's cost)."""
        self.backend_post_s: float | None = None
        """Seconds the backend's post took (NIXL make + post; over shared memory
        it includes the copy), or None if it was never posted."""
        self.finished_at: float | None = None
        self._state = TransferState.PENDING
        self._reason: str | None = None
        self._failure: FailureKind | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[DoneCallback] = []
        self._settled = False
        self._settle_on_finish = False
        self._lands_late = False
        self._settled_event = threading.Event()
        self._settled_callbacks: list[DoneCallback] = []

    def __repr__(self) -> str:
        return f"TransferHandle(xid={self.xid!r}, op={self.op.value}, state={self._state.value})"

    @property
    def settled(self) -> bool:
        """No byte of this transfer can move any more (see the module docstring)."""
        return self._settled

    @property
    def may_still_land(self) -> bool:
        """FAILED, but the backend has not ruled out that its data still arrives."""
        return self._state is TransferState.FAILED and self._lands_late and not self._settled

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def reason(self) -> str | None:
        """Why it failed, or None."""
        return self._reason

    @property
    def failure(self) -> FailureKind | None:
        return self._failure

    @property
    def duration_s(self) -> float | None:
        """Seconds from creation to completion, or None while pending."""
        return None if self.finished_at is None else self.finished_at - self.created_at

    def done(self) -> bool:
        return self._state is not TransferState.PENDING

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until final or ``timeout`` seconds passed; return the state then."""
        self._event.wait(timeout)
        return self._state

    def result(self, timeout: float | None = None) -> None:
        """Wait; return if DONE, raise TransferFailed if FAILED, TimeoutError if still pending."""
        state = self.wait(timeout)
        if state is TransferState.FAILED:
            raise TransferFailed(self.xid, self._reason or "unknown")
        if state is TransferState.PENDING:
            raise TimeoutError(f"transfer {self.xid} still pending after {timeout} s")

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(handle)`` once it is final (at once, here, if it already is)."""
        with self._lock:
            if self._state is TransferState.PENDING:
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def add_settled_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(handle)`` once it is settled (at once, here, if it already is).

        Runs after the done callbacks, on the settling thread; same rules as those.
        """
        with self._lock:
            if not self._settled:
                self._settled_callbacks.append(fn)
                return
        self._run_callback(fn)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Block until settled or ``timeout`` seconds passed; return whether it is."""
        return self._settled_event.wait(timeout)

    def finish(
        self,
        state: TransferState,
        reason: str | None = None,
        failure: FailureKind | None = None,
        *,
        may_still_land: bool = False,
    ) -> bool:
        """Make the handle final. Transport-internal; returns False if it already was.

        A DONE handle, or a FAILED one without ``may_still_land``, is settled too;
        otherwise the backend calls `settle` once nothing can move any more.
        """
        assert state is not TransferState.PENDING
        assert not (may_still_land and state is TransferState.DONE)
        with self._lock:
            if self._state is not TransferState.PENDING:
                return False
            self.finished_at = time.monotonic()
            self._reason = reason
            self._failure = failure
            self._lands_late = may_still_land
            self._state = state
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for fn in callbacks:
            self._run_callback(fn)
        if not may_still_land or self._settle_on_finish:
            self.settle()
        return True

    def settle(self) -> bool:
        """Nothing of this transfer can move any more. Transport-internal; called before
        the handle is final, it takes effect when it becomes final. Returns False if it
        already was settled (or is not final yet)."""
        with self._lock:
            if self._state is TransferState.PENDING:  # the backend raced its own finish
                self._settle_on_finish = True
                return False
            if self._settled:
                return False
            self._settled = True
            callbacks, self._settled_callbacks = self._settled_callbacks, []
        self._settled_event.set()
        for fn in callbacks:
            self._run_callback(fn)
        return True

    def _run_callback(self, fn: DoneCallback) -> None:
        try:
            fn(self)
        except Exception:
            logger.exception("xid=%s done callback %r raised", self.xid, fn)
