"""Prefill's leases on held blocks, for the pull flow.

A pulled prefill finishes with its blocks held by the scheduler
(``hold_blocks_on_finish``); its lease keeps them until decode releases them
(``POST /internal/release``) or the lease expires. Decode is told ``lease_s``
and counts it from its own arrival, so the lease is kept `TRANSIT_GRACE_S`
longer::

    P starts the lease ─► answers ─► router ─► D arrives
    P holds:  |────────────── lease_s ──────────────|── TRANSIT_GRACE_S ──|
    D READs:        (transit) |──────── lease_s - margin ────────|

The table lives on the engine thread, like every flow's state: the flow inbox
ticks it (expiry), and the pull facade (`kvduplex.kvflow.pull_flow`) starts
and releases leases there.
"""

from __future__ import annotations

import logging
import time

from kvduplex.engine.handle import EngineHandle
from kvduplex.kvflow.inbox import FlowInbox

logger = logging.getLogger(__name__)

TRANSIT_GRACE_S = 2.0
"""How long the holder of blocks a peer reads keeps them past the time it told the
reader (a pull lease here; a retained turn's pin on decode). The reader counts that
time from its own arrival, which comes later by the transit through the router
(and its queues); holding on this much longer keeps a READ the reader starts within
its window off reused blocks while that transit takes less than this plus the
reader's own margin. It costs blocks only where nobody releases them sooner: a
lease decode never released, and every pin (pins end only with their time)."""


class LeaseTable:
    """Prefill's leases on held blocks, keyed by xid (engine thread)."""

    def __init__(
        self, engine: EngineHandle, lease_s: float, inbox: FlowInbox | None = None
    ) -> None:
        """``lease_s``: the lease told to decode; the blocks are held `TRANSIT_GRACE_S`
        longer unless released. ``inbox`` ticks the table (expiry)."""
        self.engine = engine
        self.lease_s = lease_s
        self.hold_s = lease_s + TRANSIT_GRACE_S
        self._ends: dict[str, float] = {}  # xid -> when its blocks are let go
        if inbox is not None:
            inbox.every_tick(self._tick)

    def start(self, xid: str) -> None:
        """Start the lease before telling decode about it."""
        self._ends[xid] = time.monotonic() + self.hold_s

    def release(self, xid: str) -> bool:
        """Release now; False if no lease is held under `xid` (also when `xid` names a
        request held for another reason, e.g. a push in flight: not ours to release)."""
        if self._ends.pop(xid, None) is None:
            return False
        return self.engine.release_held(xid)

    def _tick(self, now: float) -> None:
        for xid in [x for x, end in self._ends.items() if now > end]:
            del self._ends[xid]
            logger.warning("xid=%s: pull lease expired after %.1f s; releasing", xid, self.hold_s)
            self.engine.release_held(xid)

    def __len__(self) -> int:
        return len(self._ends)


__all__ = ["TRANSIT_GRACE_S", "LeaseTable"]
