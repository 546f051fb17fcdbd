"""Prefill's leases on held blocks, for the pull flow.

A pulled prefill finishes with its blocks held by the scheduler
(``hold_blocks_on_finish``); its lease keeps them until decode releases them
(``POST /internal/release``) or the lease expires.
"""

from __future__ import annotations

import asyncio
import logging

from kvduplex.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


class LeaseTable:
    """Prefill's leases on held blocks, keyed by xid. Use from the event loop."""

    def __init__(self, engine: AsyncEngine, lease_s: float) -> None:
        self.engine = engine
        self.lease_s = lease_s
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def start(self, xid: str) -> None:
        loop = asyncio.get_running_loop()
        self._timers[xid] = loop.call_later(self.lease_s, self._expire, xid)

    def _expire(self, xid: str) -> None:
        if self._timers.pop(xid, None) is not None:
            logger.warning("xid=%s: pull lease expired after %.1f s; releasing", xid, self.lease_s)
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


__all__ = ["LeaseTable"]
