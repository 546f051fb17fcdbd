"""Prefill fetches a session's history from decode's pool (the router's fetch plan).

When decode holds a session's history and prefill no longer does (prefill's pool
turned over since the session was there), the router has decode lend the prompt's
cached prefix to prefill, which READs it and computes only the new tokens::

    router ── POST D /internal/kv/fetch {xid, session_id, prompt_token_ids} ──► D
              D: the prompt's longest cached prefix (its last token left to compute),
                 one reference of ours on each of its blocks, leased under xid
    router ◄── {engine_id, block_ids, keys, num_tokens, lease_s}
    router ── POST P /internal/push/prefill {..., pull_from: those, lease_xid} ──► P
              P: READ the blocks it lacks (`return_pull.RetainedReadSide`, ending
                 before the lease does), cache them, prefill the rest
    P ── POST D /internal/release {xid} ──► D: references dropped (else at expiry)

The lease keeps the blocks from eviction and reuse while a READ of them may run.
Decode holds them `TRANSIT_GRACE_S` past the lease it tells (prefill counts the lease
from its own arrival, after the router's transit), and prefill releases only once its
READ ended: a READ that ended well read the blocks whole before the release, and one
that failed is never cached, so whatever lands after the release is thrown away.

Everything here runs on the engine thread (`PrefixLeases`, ticked by the flow inbox);
`FetchDecodeSide` is what decode's routes call.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.handle import EngineHandle
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.lease import TRANSIT_GRACE_S

logger = logging.getLogger(__name__)


class FetchRefusal(enum.Enum):
    NOT_CACHED = "not_cached"
    """No full block of the prompt (but its last token) is cached here."""
    NO_ROOM = "no_room"
    """The blocks leased together are at the bound (`PrefixLeases.max_blocks`)."""
    XID_IN_USE = "xid_in_use"
    """A lease is held under this xid already."""


class FetchRefused(Exception):
    """Decode does not lend this prefix; prefill computes it."""

    def __init__(self, xid: str, reason: FetchRefusal, detail: str) -> None:
        super().__init__(f"xid {xid!r}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class PrefixLease:
    """The blocks of a prompt's cached prefix, leased for prefill's READ."""

    block_ids: list[int]
    keys: list[BlockHash]
    num_tokens: int
    """``len(block_ids) * block_size``: the prompt tokens they hold."""
    lease_s: float
    """How long they stay leased, as told to prefill."""


def lendable_keys(token_ids: Sequence[int], block_size: int, identity: bytes) -> list[BlockHash]:
    """The keys of a prompt's full blocks before its last token: what decode may lend
    (prefill computes at least the last token, for its first token)."""
    num_full = (len(token_ids) - 1) // block_size
    return compute_block_hashes(token_ids[: num_full * block_size], block_size, identity)


class PrefixLeases:
    """Decode's leases on cached prefixes that prefill READs, keyed by xid (engine thread).

    Bounded: the blocks leased together are at most ``max_blocks`` (a quarter of the pool
    by default), since a lease keeps them from eviction however long the session is; a
    prefix longer than the room left is lent in part (its head)."""

    def __init__(
        self, engine: EngineHandle, lease_s: float, inbox: FlowInbox | None = None,
        max_blocks: int | None = None,
    ) -> None:  # fmt: skip
        """``lease_s``: the lease told to prefill; the blocks are held `TRANSIT_GRACE_S`
        longer unless released. ``inbox`` ticks the table (expiry)."""
        self.engine = engine
        self.lease_s = lease_s
        self.hold_s = lease_s + TRANSIT_GRACE_S
        self.max_blocks = max_blocks if max_blocks is not None else max(1, engine.num_blocks // 4)
        self._leases: dict[str, tuple[float, list[int]]] = {}  # xid -> (let go at, blocks)
        if inbox is not None:
            inbox.every_tick(self._tick)

    def grant(self, xid: str, keys: Sequence[BlockHash]) -> PrefixLease:
        """Lease the longest cached prefix of `keys` (a prompt's `lendable_keys`), as much
        of it as the bound leaves room for. Raises `FetchRefused` when nothing of it is
        cached, the bound leaves no room, or `xid` holds a lease already."""
        if xid in self._leases:
            raise FetchRefused(xid, FetchRefusal.XID_IN_USE, "a lease is held under it")
        bs = self.engine.block_size
        block_ids = self.engine.cached_prefix(keys)
        if not block_ids:
            raise FetchRefused(xid, FetchRefusal.NOT_CACHED, "no block of the prompt is cached")
        room = self.max_blocks - self.num_leased_blocks()
        if room <= 0:
            raise FetchRefused(
                xid, FetchRefusal.NO_ROOM, f"{self.max_blocks} blocks are leased already"
            )
        del block_ids[room:]  # the head of a prefix too long for the room left
        self.engine.acquire_blocks(block_ids)
        self._leases[xid] = (time.monotonic() + self.hold_s, block_ids)
        return PrefixLease(
            block_ids, list(keys[: len(block_ids)]), len(block_ids) * bs, self.lease_s
        )

    def release(self, xid: str) -> bool:
        """Drop the lease now (prefill's READ ended); False if none is held under `xid`."""
        entry = self._leases.pop(xid, None)
        if entry is None:
            return False
        self.engine.release_blocks(entry[1])
        return True

    def _tick(self, now: float) -> None:
        for xid in [x for x, (end, _) in self._leases.items() if now > end]:
            _, blocks = self._leases.pop(xid)
            logger.info("xid=%s: fetch lease expired after %.1f s; releasing", xid, self.hold_s)
            self.engine.release_blocks(blocks)

    def num_leased_blocks(self) -> int:
        return sum(len(b) for _, b in self._leases.values())

    def __len__(self) -> int:
        return len(self._leases)


class FetchDecodeSide:
    """Decode's half of the fetch: lease a prompt's cached prefix, release it."""

    def __init__(self, engine: AsyncEngine, leases: PrefixLeases) -> None:
        self.engine = engine
        self.leases = leases

    async def grant(self, xid: str, token_ids: list[int]) -> PrefixLease:
        """`PrefixLeases.grant` of the prompt `token_ids` on the engine thread, its keys
        hashed off it (a long prompt's take a while); raises `FetchRefused`."""
        engine = self.leases.engine
        keys = await asyncio.to_thread(
            lendable_keys, token_ids, engine.block_size, engine.identity
        )
        lease: PrefixLease = await self.engine.run_in_engine(
            partial(_grant, self.leases, xid, keys)
        )
        return lease

    async def release(self, xid: str) -> bool:
        """End the lease on `xid` now; False if none is held under it."""
        return bool(await self.engine.run_in_engine(partial(_release, self.leases, xid)))


def _grant(
    leases: PrefixLeases, xid: str, keys: list[BlockHash], _engine: LLMEngine
) -> PrefixLease:
    return leases.grant(xid, keys)


def _release(leases: PrefixLeases, xid: str, _engine: LLMEngine) -> bool:
    return leases.release(xid)


__all__ = [
    "FetchDecodeSide", "FetchRefusal", "FetchRefused", "PrefixLease", "PrefixLeases",
    "lendable_keys",
]  # fmt: skip
