"""Prefill's leases on held blocks, for the pull flow.

A pulled prefill finishes with its blocks held by the scheduler
(``hold_blocks_on_finish``); its lease keeps them until decode releases them
(``POST /internal/release``) or the lease expires. Decode is told ``lease_s``
and counts it from its own arrival, so the lease is kept `TRANSIT_GRACE_S`
longer::

    P starts the lease ─► answers ─► router ─► D arrives
    P holds:  |────────────── lease_s ──────────────|── TRANSIT_GRACE_S ──|
    D READs:        (transit) |──────── lease_s - margin ────────|
"""

from __future__ import annotations

import asyncio
import logging

from kvduplex.engine.async_engine import AsyncEngine

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
    """Prefill's leases on held blocks, keyed by xid. Use from the event loop."""

    def __init__(self, engine: AsyncEngine, lease_s: float) -> None:
        """``lease_s``: the lease told to decode; the blocks are held `TRANSIT_GRACE_S`
        longer unless released."""
        self.engine = engine
        self.lease_s = lease_s
        self.hold_s = lease_s + TRANSIT_GRACE_S
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def start(self, xid: str) -> None:
        """Start the lease before telling decode about it."""
        loop = asyncio.get_running_loop()
        self._timers[xid] = loop.call_later(self.hold_s, self._expire, xid)

    def _expire(self, xid: str) -> None:
        if self._timers.pop(xid, None) is not None:
            logger.warning("xid=%s: pull lease expired after %.1f s; releasing", xid, self.hold_s)
            self.engine.call(lambda e: e.scheduler.release_held(xid))

    async def release(self, xid: str) -> bool:
        """Release now; False if no lease is held under `xid` (also when `xid` names a
        request held for another reason, e.g. a push in flight: not ours to release)."""
        timer = self._timers.pop(xid, None)
        if timer is None:
            return False
        timer.cancel()
        released = await self.engine.run_in_engine(lambda e: e.scheduler.release_held(xid))
        return bool(released)

    def __len__(self) -> int:
        return len(self._timers)


__all__ = ["TRANSIT_GRACE_S", "LeaseTable"]
