"""The table of NIXL transfers of one transport: post queue, in flight, deadlines.

Lifecycle of one transfer here::

    submit ─► posted inline (small, queue empty) ─┐
       └────► queued ─► drain_posts (progress) ───┴► in flight ─► check_all:
                                                      DONE ─► release, finish DONE
                                                      ERR  ─► release, finish FAILED
                                                      past deadline ─► finish FAILED,
                                                        may still land: kept in flight
                                                        ─► DONE / ERR ─► release, settle
    fail(peer) (disconnect, close) ─► release, finish FAILED; one NIXL had not finished
        (released: only cancelled) or would not release may still land until the
        caller has torn the peer's endpoint down (`settle_peer`)

A deadline ends the caller's wait, not the transfer: NIXL's release of an
active transfer only asks UCX to cancel requests that may already be on the
wire, so the table keeps polling it and settles it only when NIXL reports it
finished (or the peer's endpoint is gone). Posting holds the post lock, so
transfers are posted in submit order. A NIXL handle that cannot be released is
kept and released later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import Protocol

from kvduplex.transport.nixl_agent import NixlAgent
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import TransferError
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState
from kvduplex.transport.regions import IndexArray

logger = logging.getLogger(__name__)

class Complete(Protocol):
    """`Transport._complete`."""

    def __call__(
        self,
        handle: TransferHandle,
        state: TransferState,
        reason: str | None = None,
        failure: FailureKind | None = None,
        *,
        may_still_land: bool = False,
    ) -> None: ...


Settle = Callable[[TransferHandle, str], None]


@dataclass
class Job:
    """One transfer to post."""

    handle: TransferHandle
    peer_id: str
    agent_name: str
    """The target's NIXL agent."""
    dlist: Any
    """The target's prepared descriptor list."""
    local: IndexArray
    """Indices into our own prepared descriptor list, one per region moved."""
    remote: IndexArray
    """Indices into ``dlist``, pairwise with ``local``."""
    notif: bytes
    """Encoded envelope, or b"" for none."""
    hints: tuple[bytes, bytes] | None = None
    """Large transfers: the XFER_BEGIN envelope to send first and the XFER_END one to
    send when the transfer ends."""


class XferTable:
    """Thread-safe; `drain_posts`, `check_all` and `retry_releases` run on the progress thread."""

    def __init__(
        self,
        agent: NixlAgent,
        local_dlist: Any,
        complete: Complete,
        settle: Settle,
        wake: Callable[[], None],
        inline_post_max_bytes: int,
    ) -> None:
        self._agent = agent
        self._local_dlist = local_dlist
        self._complete = complete
        self._settle = settle
        self._wake = wake
        self.inline_post_max_bytes = inline_post_max_bytes
        self._post_lock = threading.Lock()  # the queue; held while posting
        self._queue: deque[Job] = deque()
        self._lock = threading.Lock()  # in-flight table
        self._inflight: dict[int, tuple[Job, Any]] = {}
        self._expired: set[int] = set()
        """In flight past their deadline: finished FAILED, may still land."""
        self._unreleased: list[tuple[TransferHandle, Any, bool]] = []
        """Handles NIXL refused to release, and whether NIXL had finished them (DONE or
        ERR): a finished one settles once released, an active one only with its peer's
        endpoint (`settle_peer`)."""
        self._cancelled: list[TransferHandle] = []
        """Active transfers released (cancelled) by `fail`: UCX may still have them on the
        wire, so they settle only once their peer's endpoint is torn down."""

    @property
    def busy(self) -> bool:
        return bool(self._queue) or bool(self._inflight)

    def submit(self, job: Job) -> None:
        """Post now if small and nothing is queued (may raise), else queue for the progress thread."""
        with self._post_lock:
            if not self._queue and job.handle.num_bytes <= self.inline_post_max_bytes:
                self._post(job)
                return
            self._queue.append(job)
        self._wake()

    def drain_posts(self) -> int:
        """Post every queued job; a job that cannot be posted ends FAILED. Returns how many."""
        count = 0
        while True:
            with self._post_lock:
                if not self._queue:
                    return count
                job = self._queue.popleft()
                count += 1
                h = job.handle
                if time.monotonic() >= h.expires_at:
                    reason = f"deadline exceeded after {h.deadline_s:g} s (never posted)"
                    self._complete(h, TransferState.FAILED, reason, FailureKind.DEADLINE)
                    continue
                try:
                    self._post(job)
                except Exception as exc:
                    logger.warning("xid=%s failed to post to %s: %s", h.xid, job.peer_id, exc)
                    self._complete(h, TransferState.FAILED, f"post failed: {exc}", FailureKind.POST)

    def check_all(self) -> int:
        """Check every transfer in flight once; returns how many were checked.

        NIXL reads a released handle's freed memory, so each one is asked about under
        ``_lock`` and only while still in flight: `fail` takes a transfer out under
        it before releasing the handle. One uncontended lock a transfer keeps the
        poll cheap, and posts and `fail` wait for one check at most."""
        with self._lock:
            items = list(self._inflight.items())
        now = time.monotonic()
        num_checked = 0
        for key, entry in items:
            with self._lock:
                if self._inflight.get(key) is not entry:
                    continue  # fail() took it
                try:
                    status, reason = self._agent.check(entry[1]), "NIXL reported ERR"
                except Exception as exc:
                    status, reason = "ERR", f"{type(exc).__name__}: {exc}"
            num_checked += 1
            self._check(*entry, status, reason, now)
        return num_checked

    def fail(self, peer_id: str | None, reason: str, failure: FailureKind) -> int:
        """Fail the queued and in-flight transfers of ``peer_id`` (None: all); returns how many."""
        with self._post_lock:
            queued = [j for j in self._queue if peer_id in (None, j.peer_id)]
            self._queue = deque(j for j in self._queue if peer_id not in (None, j.peer_id))
        with self._lock:
            taken = [v for v in self._inflight.values() if peer_id in (None, v[0].peer_id)]
            for job, _ in taken:
                del self._inflight[id(job.handle)]
                self._expired.discard(id(job.handle))
        for job in queued:
            self._complete(job.handle, TransferState.FAILED, reason, failure)
        for job, xfer in taken:
            try:
                finished = self._agent.check(xfer) in ("DONE", "ERR")
            except Exception:
                finished = False
            released = self._release(job, xfer, finished)
            h = job.handle
            self._complete(h, TransferState.FAILED, reason, failure,
                           may_still_land=not (released and finished))  # fmt: skip
            if released and finished:
                self._settle(h, "released")
            elif released:  # cancelled, but perhaps already on the wire
                with self._lock:
                    self._cancelled.append(h)
        return len(queued) + len(taken)

    def settle_peer(self, peer_id: str | None, why: str) -> None:
        """The peer's endpoint (None: every peer's) is torn down: nothing unreleased to it
        can land any more. Call after `fail` for that peer and the endpoint's removal."""
        with self._lock:
            doomed = [h for h, _, _ in self._unreleased if peer_id in (None, h.peer_engine_id)]
            doomed += [h for h in self._cancelled if peer_id in (None, h.peer_engine_id)]
            self._cancelled = [h for h in self._cancelled if peer_id not in (None, h.peer_engine_id)]
        for h in doomed:
            self._settle(h, why)

    def retry_releases(self, final: bool = False) -> None:
        """Release handles NIXL refused to release before (log if ``final`` and still refused)."""
        if not self._unreleased:
            return
        with self._lock:
            pending, self._unreleased = self._unreleased, []
        what = "release at close" if final else None
        still = []
        for handle, xfer, finished in pending:
            if not self._agent.try_release(xfer, what):
                still.append((handle, xfer, finished))
            elif finished:
                self._settle(handle, "released")
            else:  # released while active: cancelled, perhaps already on the wire
                with self._lock:
                    self._cancelled.append(handle)
        with self._lock:
            self._unreleased.extend(still)

    # -- internals ------------------------------------------------------------

    def _post(self, job: Job) -> None:
        """Create and post; caller holds the post lock. Raises if NIXL refuses."""
        h = job.handle
        before = (job.agent_name, job.hints[0]) if job.hints is not None else None
        t0 = time.perf_counter()
        op = "WRITE" if h.op is TransferOp.WRITE else "READ"
        xfer, status = self._agent.post(
            op, self._local_dlist, job.local, job.dlist, job.remote, job.notif, before
        )
        h.backend_post_s = time.perf_counter() - t0
        if status == "ERR":
            raise TransferError("NIXL refused to post the transfer")
        if status == "DONE":  # completed inside the call (shared memory)
            self._release(job, xfer, True)  # a DONE handle is settled whatever the release says
            self._complete(h, TransferState.DONE, None, None)
            return
        with self._lock:
            self._inflight[id(h)] = (job, xfer)
        self._wake()

    def _check(self, job: Job, xfer: Any, status: str, reason: str, now: float) -> None:
        """Act on NIXL's ``status`` of a transfer in flight (``reason``: why, if ERR)."""
        h = job.handle
        if status == "PROC":
            if now >= h.expires_at and not h.done():
                with self._lock:
                    if id(h) not in self._inflight:
                        return  # fail() took it
                    self._expired.add(id(h))
                reason = f"deadline exceeded after {h.deadline_s:g} s"
                self._complete(h, TransferState.FAILED, reason, FailureKind.DEADLINE,
                               may_still_land=True)  # fmt: skip
            return
        with self._lock:
            if self._inflight.pop(id(h), None) is None:
                return  # fail() took it
            expired = id(h) in self._expired
            self._expired.discard(id(h))
        released = self._release(job, xfer, True)
        if expired:  # already FAILED at its deadline; now NIXL is done with it
            if released:
                self._settle(h, f"NIXL finished it ({status}) after its deadline")
        elif status == "DONE":
            self._complete(h, TransferState.DONE, None, None)
        else:
            self._complete(h, TransferState.FAILED, f"transport error: {reason}",
                           FailureKind.PEER, may_still_land=not released)  # fmt: skip

    def _release(self, job: Job, xfer: Any, finished: bool) -> bool:
        """Release (cancelling if active) the NIXL handle; keep it for retry if NIXL
        refuses. ``finished``: NIXL reported it DONE or ERR. Returns whether released."""
        released = self._agent.try_release(xfer, f"xid={job.handle.xid} release")
        if not released:
            with self._lock:
                self._unreleased.append((job.handle, xfer, finished))
        if job.hints is not None:
            self._agent.try_send_notif(job.agent_name, job.hints[1])
        return released


__all__ = ["Job", "XferTable"]
