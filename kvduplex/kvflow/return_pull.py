"""The vLLM-style return, kept for comparison (``--return-mode pull``).

Decode keeps each session's last finished turn (its blocks held) for a lease;
at the start of the session's next turn, prefill READs the blocks its prefix
cache lacks and then prefills::

    D: turn finished ── held under a lease (the session's previous turn released)
    next turn, router: POST D /internal/kv/retained {session} ──► block ids, keys, tokens
    router ──► P /internal/push/prefill {..., pull_from: those}
    P: READ the blocks it lacks from D (its prefill waits for it), cache them, prefill

Unlike the duplex return, decode pins the turn's blocks between turns, and the
READ sits on the next turn's critical path.

Its two halves side by side, what the routes call: `RetainedTurnSide` (decode:
describe and pin a retained turn) and `RetainedReadSide` (prefill: READ it within
decode's pin).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.half import ReadRunner
from kvduplex.kvflow.inbox import EngineGoneError
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.lease import TRANSIT_GRACE_S
from kvduplex.kvflow.machines.read import Outcome
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.transport.base import Transport
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle

logger = logging.getLogger(__name__)

READ_PIN_MARGIN_S = 0.5
"""A READ of a retained turn ends this long before decode's pin does."""


@dataclass
class RetainSpec:
    """A decode request whose finished turn is kept for the next turn's READ (its
    ``connector_meta``; added with ``hold_blocks_on_finish``)."""

    session_id: str


class TurnRetainer:
    """Decode's side: keep each session's last turn held for ``lease_s``.

    Bounded: the turns held together take at most ``max_blocks`` blocks (the
    oldest are let go first), since the sessions are named by clients. A turn
    `describe`d for a READ is pinned (our own references on its blocks) for
    ``pin_s``, so that its blocks cannot be reused under the READ even if the
    session's next turn or the lease lets the turn go meanwhile. Prefill counts
    ``pin_s`` from its own arrival, so the pin is kept `TRANSIT_GRACE_S` longer.
    """

    def __init__(
        self, engine: EngineHandle, lease_s: float, max_blocks: int | None = None,
        pin_s: float = 10.0, inbox: FlowInbox | None = None,
    ) -> None:  # fmt: skip
        """Engine thread only; ``inbox`` ticks it (expiring leases and pins)."""
        self.engine = engine
        self.lease_s = lease_s
        self.max_blocks = max_blocks if max_blocks is not None else max(1, engine.num_blocks // 4)
        self.pin_s = pin_s
        # session -> (request id, expiry, blocks held); oldest first
        self._by_session: dict[str, tuple[str, float, int]] = {}
        self._pins: list[tuple[float, list[int]]] = []  # (until, blocks) for READs under way
        if inbox is not None:
            inbox.every_tick(self._tick)

    def on_finished(self, finished: list[Request]) -> None:
        for req in finished:
            if not isinstance(req.connector_meta, RetainSpec):
                continue
            if req.finish_reason is FinishReason.ABORT:
                continue
            session = req.connector_meta.session_id
            previous = self._by_session.pop(session, None)
            self._by_session[session] = (
                req.request_id,
                time.monotonic() + self.lease_s,
                len(req.block_ids),
            )
            evicted = self._over_budget()
            if previous is not None:
                self.engine.release_held(previous[0])
            for rid in evicted:
                logger.info("request %s: retained turn let go (retained turns over %d blocks)",
                            rid, self.max_blocks)  # fmt: skip
                self.engine.release_held(rid)

    def _over_budget(self) -> list[str]:
        """Pop the oldest retained turns until the rest fit in ``max_blocks`` (the newest
        one always stays)."""
        total = sum(n for _, _, n in self._by_session.values())
        gone: list[str] = []
        while total > self.max_blocks and len(self._by_session) > 1:
            session = next(iter(self._by_session))
            rid, _, n = self._by_session.pop(session)
            total -= n
            gone.append(rid)
        return gone

    def describe(self, session_id: str) -> dict[str, Any] | None:
        """The retained turn's full blocks, their keys and tokens; None if none is held.

        Engine thread. Pins the blocks described for ``pin_s`` (the time it tells;
        held `TRANSIT_GRACE_S` longer): a READ of them cannot find them reused.
        """
        entry = self._by_session.get(session_id)
        if entry is None:
            return None
        req = self.engine.get_request(entry[0])
        if req is None:
            return None
        bs = self.engine.block_size
        n = min(req.num_computed_tokens // bs, len(req.block_ids), len(req.block_hashes))
        pinned = list(req.block_ids[:n])
        self.engine.acquire_blocks(pinned)
        self._pins.append((time.monotonic() + self.pin_s + TRANSIT_GRACE_S, pinned))
        return {
            "pin_s": self.pin_s,
            "block_ids": list(req.block_ids[:n]),
            "keys": [bytes(k).hex() for k in req.block_hashes[:n]],
            "token_ids": list(req.all_token_ids[: n * bs]),
        }

    def _expire(self) -> None:
        now = time.monotonic()
        gone = [s for s, (_, until, _) in self._by_session.items() if now > until]
        rids = [self._by_session.pop(s)[0] for s in gone]
        unpinned = [blocks for until, blocks in self._pins if now > until]
        self._pins = [(u, b) for u, b in self._pins if now <= u]
        for rid in rids:
            self.engine.release_held(rid)
        for blocks in unpinned:
            self.engine.release_blocks(blocks)

    def num_retained(self) -> int:
        return len(self._by_session)

    def num_pinned(self) -> int:
        """Described turns whose blocks are still pinned for a READ."""
        return len(self._pins)

    def _tick(self, now: float) -> None:
        if any(now > u for _, u, _ in self._by_session.values()) or any(
            now > u for u, _ in self._pins
        ):
            self._expire()


class RetainedReader:
    """Prefill's side: READ the retained blocks its prefix cache lacks, then cache them."""

    def __init__(
        self,
        transport: Transport,
        engine: EngineHandle,
        inbox: FlowInbox,
        io: FlowIO,
        deadline_s: float,
        metrics: KVFlowMetrics | None = None,
    ) -> None:
        self.transport = transport
        self.engine = engine
        self.inbox = inbox
        self.io = io
        self.deadline_s = deadline_s
        self.metrics = metrics
        self.num_read_blocks = 0

    def start(
        self, peer: PeerHandle, xid: str, remote_blocks: list[int], keys_hex: list[str],
        token_ids: list[int], deadline_s: float | None = None,
    ) -> Future[int]:  # fmt: skip
        """Engine thread: post the READ of the missing blocks; the future gives the number
        of blocks cached once it ended (0: nothing was missing, or it failed), or the error
        of its handler, or EngineGoneError once the engine ended before it did.

        ``deadline_s`` (at most the reader's own): the READ must end while decode still
        pins the blocks, or it is not cached."""
        done: Future[int] = Future()
        if not self.inbox.track(done):  # failed if the engine ends before the READ does
            return done
        bs = self.engine.block_size
        keys = compute_block_hashes(token_ids, bs, self.engine.identity)
        if len(keys) != len(remote_blocks) or [bytes(k).hex() for k in keys] != keys_hex:
            logger.warning("xid=%s: retained blocks do not match their tokens; not read", xid)
            done.set_result(0)
            return done
        have = self.engine.cached_prefix(keys)
        num_have = len(have)
        missing = keys[num_have:]
        if not missing:
            done.set_result(0)
            return done
        # The cached prefix the READ extends is ours until the READ ended: allocating the
        # missing blocks, and whatever allocates meanwhile, may evict cached blocks, and
        # the READ's blocks would be cached after a gap that no lookup gets past.
        self.engine.acquire_blocks(have)
        local = self.engine.try_allocate_blocks(len(missing))
        if local is None:
            self.engine.release_blocks(have)
            done.set_result(0)
            return done
        read_s = self.deadline_s if deadline_s is None else min(deadline_s, self.deadline_s)

        def on_outcome(o: Outcome, handle: TransferHandle | None) -> None:  # engine thread
            try:
                self._finish(xid, o, handle, local, missing, done)
            except BaseException as exc:  # the caller hears it too, not only the log
                if not done.done():
                    done.set_exception(exc)
                raise
            finally:
                self.engine.release_blocks(have)

        runner = ReadRunner(
            self.transport, self.engine, self.inbox, self.io, peer, xid, local,
            remote_blocks[num_have:], read_s, self.deadline_s, on_outcome,
        )  # fmt: skip
        runner.start(acquire=False)  # the allocation is our reference, until settled
        return done

    def _finish(
        self, xid: str, o: Outcome, handle: TransferHandle | None, local: list[int],
        keys: list[BlockHash], done: Future[int],
    ) -> None:  # fmt: skip
        """Cache what was read whole; failed blocks are never cached (they go back once
        nothing can land in them)."""
        n = 0
        if o.ok and handle is not None:
            self.engine.cache_blocks(local, keys, HitSource.DECODE)
            n = len(local)
            self.num_read_blocks += n
            if self.metrics is not None:
                self.metrics.return_blocks.labels("read").inc(n)
                self.metrics.return_bytes.labels("read").inc(handle.num_bytes)
                self.metrics.received_bytes.labels("decode").inc(handle.num_bytes)
        else:
            logger.warning("xid=%s: READ of retained blocks failed: %s", xid, o.reason)
        done.set_result(n)


@dataclass(frozen=True)
class RetainedTurnRef:
    """A decode's retained turn, as its ``/internal/kv/retained`` described it."""

    decode_url: str
    engine_id: str | None
    block_ids: list[int]
    keys: list[str]
    token_ids: list[int]
    pin_left_s: float | None
    """How long decode still pins the blocks, from when the router sent this on."""


class RetainedTurnSide:
    """Decode's half of the retained-turn return: describe a session's retained turn for
    the next turn's prefill to READ (pinning its blocks)."""

    def __init__(self, engine: AsyncEngine, retainer: TurnRetainer) -> None:
        self.engine = engine
        self.retainer = retainer

    async def describe(self, session_id: str) -> dict[str, Any] | None:
        """`TurnRetainer.describe` on the engine thread; None if no turn is retained."""
        result: dict[str, Any] | None = await self.engine.run_in_engine(
            partial(_describe, self.retainer, session_id)
        )
        return result


def _describe(retainer: TurnRetainer, session_id: str, _engine: LLMEngine) -> dict[str, Any] | None:
    return retainer.describe(session_id)


class RetainedReadSide:
    """Prefill's half of the retained-turn return: before a push prefill, READ the
    decode's retained blocks this prefix cache lacks, ending while decode still pins
    them (else not at all)."""

    def __init__(
        self, engine: AsyncEngine, reader: RetainedReader,
        get_peer: Callable[[str, str | None], PeerHandle],
    ) -> None:  # fmt: skip
        """``get_peer(url, engine_id)``: connect to the decode instance (blocking)."""
        self.engine = engine
        self.reader = reader
        self.get_peer = get_peer

    async def read(self, xid: str, turn: RetainedTurnRef, arrived: float) -> int:
        """The blocks read and cached (0: nothing missing, decode unreachable, the pin ran
        out, or the READ failed). ``arrived``: when this request arrived (monotonic).

        The READ's deadline counts from its post, so it gets what is left, at the post,
        of the pin counted from the request's arrival: the handshake and the wait for
        the engine thread (behind a prefill step) come out of it. Raises ValueError for
        block ids outside decode's pool, EngineGoneError once the engine ended."""
        ends_at = None
        if turn.pin_left_s is not None:
            ends_at = arrived + turn.pin_left_s - READ_PIN_MARGIN_S
            if _pin_left_s(xid, ends_at) is None:
                return 0
        try:
            peer = await asyncio.to_thread(self.get_peer, turn.decode_url, turn.engine_id)
        except Exception as exc:
            logger.warning("xid=%s: retained turn at %s unreachable: %s", xid, turn.decode_url, exc)
            return 0
        bad = [b for b in turn.block_ids if b >= peer.layout.num_blocks]
        if bad:
            raise ValueError(
                f"block {bad[0]} is out of range; {turn.decode_url} has "
                f"{peer.layout.num_blocks} blocks"
            )
        post = partial(self._post, peer, xid, turn, ends_at)
        done: Future[int] = await self.engine.run_in_engine(post)
        try:
            return await asyncio.wrap_future(done)
        except EngineGoneError:
            raise
        except Exception:  # its handler failed: the prefill computes what it lacks
            logger.exception("xid=%s: READ of retained blocks failed", xid)
            return 0

    def _post(
        self, peer: PeerHandle, xid: str, turn: RetainedTurnRef, ends_at: float | None,
        _engine: LLMEngine,
    ) -> Future[int]:  # fmt: skip
        """Engine thread: post the READ with what is left of the pin now."""
        deadline_s = None
        if ends_at is not None:
            deadline_s = _pin_left_s(xid, ends_at)
            if deadline_s is None:
                skipped: Future[int] = Future()
                skipped.set_result(0)
                return skipped
        return self.reader.start(
            peer, f"{xid}-read", turn.block_ids, turn.keys, turn.token_ids, deadline_s
        )


def _pin_left_s(xid: str, ends_at: float) -> float | None:
    """Seconds left until a retained-turn READ must end (``ends_at``, monotonic); None,
    logged, if none are."""
    left = ends_at - time.monotonic()
    if left <= 0:
        logger.info("xid=%s: decode's pin on the retained turn ran out; not read", xid)
        return None
    return left


__all__ = [
    "READ_PIN_MARGIN_S", "RetainSpec", "RetainedReadSide", "RetainedReader", "RetainedTurnRef",
    "RetainedTurnSide", "TurnRetainer",
]  # fmt: skip
