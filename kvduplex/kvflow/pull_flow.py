"""The pull flow's facade: its prefill half and its decode half side by side.

What the internal routes call; they only parse bodies and map errors::

    router ──► P  POST /internal/prefill ─► PullPrefillSide.prefill(request)
                  (its first token and its held blocks, under a lease)
    router ──► D  POST /v1/... kv_transfer_params ─► PullDecodeSide.admit(spec)
    D ──────► P  POST /internal/release ─► PullPrefillSide.release(xid)

The machinery is `lease.LeaseTable` (prefill) and `pull.PullConnector`
(decode's READ); both live on the engine thread, so each call goes there as
an engine command or a flow inbox request whose failure comes back to the
caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.kvflow.lease import LeaseTable
from kvduplex.kvflow.pull import PullConnector
from kvduplex.kvflow.pull import PullSpec
from kvduplex.kvflow.pull import block_ids_of

logger = logging.getLogger(__name__)


class PullPrefillSide:
    """Prefill's half: run a prompt to its first token and lease its blocks to the
    decode instance that READs them."""

    def __init__(self, engine: AsyncEngine, leases: LeaseTable) -> None:
        self.engine = engine
        self.leases = leases

    async def prefill(self, request: Request) -> dict[str, Any] | None:
        """Prefill ``request`` (its id is the xid; it holds its blocks on finish) and start
        its lease: its block ids, token count and first token, or None if it finished
        without held blocks. Raises what `AsyncEngine.generate` raises."""
        async for _ in self.engine.generate(request):
            pass
        return await self.engine.run_in_engine(partial(_hold, self.leases, request.request_id))

    async def release(self, xid: str) -> bool:
        """End the lease on ``xid`` now; False if none is held under it."""
        return bool(await self.engine.run_in_engine(partial(_release, self.leases, xid)))


def _hold(leases: LeaseTable, xid: str, engine: LLMEngine) -> dict[str, Any] | None:
    info = block_ids_of(engine, xid)
    if info is not None:
        leases.start(xid)
    return info


def _release(leases: LeaseTable, xid: str, _engine: LLMEngine) -> bool:
    return leases.release(xid)


class PullDecodeSide:
    """Decode's half: a request READs its prompt's KV from prefill's held blocks."""

    def __init__(self, pull: PullConnector) -> None:
        self.pull = pull

    def admit(self, spec: PullSpec) -> Callable[[], None]:
        """What registers ``spec`` as the request's ``on_admit`` (`AsyncEngine.generate`):
        on the engine thread, in the same turn as the request's add. The call raises
        XidInUseError (which rejects the request) for an xid another request waits on."""
        return partial(self.pull.register, spec)


__all__ = ["PullDecodeSide", "PullPrefillSide"]
