"""The duplex return: decode pushes a finished turn's blocks into prefill's prefix cache.

It is the push flow reversed, built from the same `KVSender` (on decode) and
`KVReceiver` (on prefill)::

    D: turn finished (blocks held) ── next step, after the answer went out
    D: KVOffer{session, keys, token ids, parent key} ──────────────► P
                         P: recompute the keys from the tokens (else decline);
                            keep the leading blocks it has (pool or tier), allocate the rest
                            (evicting unreferenced cached blocks) or decline
    D ◄── KVRegister{dst for blocks first_block..} (or KVDecline) ── P
    D: one WRITE of every layer of those blocks ──────────────────► P's blocks
    D: KVDone ─────────────────────────────────────────────────────► P: insert the
                                                            blocks into its prefix cache

Nothing is pinned: decode's job references its blocks from the offer until its
WRITE ended (the request itself released them at the offer); prefill's new
blocks enter its cache only once complete, so a turn that arrives meanwhile
misses and recomputes, never reads half-written KV. Every wait is a
`KVSender`/`KVReceiver` wait with its deadline; any failure leaves the blocks
uncached (slower next turn, never a wrong token).

Which blocks: the offer starts at ``from_block``, by default the first block
that is not wholly prompt when the prompt's KV came from prefill (which
computed the prompt and cached its full blocks), else the first block (decode
computed the prompt itself: a short append, or a fallback). It ends at the
last full block whose KV decode computed, or earlier where the request's
``max_tokens`` says (the router's limit: a reasoning the client will strip
is never hit, so never sent). Prefill answers with the first
offered block it lacks, so what it has is never sent again: a block its KV tier
holds counts as held (its next lookup promotes it), so it is not sent either::

    offered   k4   k5   k6   k7   k8
    P holds   pool pool tier tier  -     -> KVRegister{first_block 4}: only k8 moves

The routes reach this machinery only through the flow's facade,
`return_flow` (its decode and prefill halves side by side).
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from dataclasses import dataclass
from functools import partial

from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.eviction import ReleaseTag
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.kvflow.messages import KVDecline
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVOffer
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.kvflow.receiver import KVReceiver
from kvduplex.kvflow.receiver import WaitFailure
from kvduplex.kvflow.sender import KVSender
from kvduplex.kvflow.sender import SendJob
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)


@dataclass
class ReturnSpec:
    """Where a decode request's finished turn goes: the request's ``connector_meta``
    (added with ``hold_blocks_on_finish``, so its blocks outlive the finish)."""

    session_id: str
    peer: PeerHandle
    from_block: int | None = None
    """First block to offer; None: the first block that is not wholly prompt."""
    max_tokens: int | None = None
    """The offer ends at or before this many tokens of the turn (whole blocks only); None:
    at the last full block decode computed."""


@dataclass
class ReturnStats:
    num_offered: int = 0
    num_done: int = 0
    num_failed: int = 0
    num_declined: int = 0
    num_sent_blocks: int = 0
    num_sent_bytes: int = 0
    num_received_blocks: int = 0
    """Prefill side: blocks inserted into the prefix cache."""
    num_accepted: int = 0
    num_refused: int = 0
    """Prefill side: offers declined (see the metrics for why)."""


@dataclass
class ReturnRecord:
    """One finished turn's return, as decode saw it (for per-turn accounting)."""

    num_prompt_tokens: int
    num_output_tokens: int
    num_offered_blocks: int
    num_sent_blocks: int = 0
    num_sent_bytes: int = 0
    outcome: str = "in_flight"
    """in_flight, done, declined or failed."""


class ReturnOfferer:
    """Decode's side: offer each finished session turn, WRITE what prefill lacks.

    Engine thread only (`records` may be read from anywhere)."""

    MAX_RECORDS = 4096
    """Recent returns kept by request id (`records`); the oldest are dropped."""

    def __init__(
        self, sender: KVSender, engine: EngineHandle, metrics: KVFlowMetrics | None = None
    ) -> None:
        self.sender = sender
        self.engine = engine
        self.block_size = engine.block_size
        self.metrics = metrics
        self.stats = ReturnStats()
        self.codec = MessageCodec()
        self._records: OrderedDict[str, ReturnRecord] = OrderedDict()
        self._to_offer: list[tuple[Request, ReturnSpec]] = []
        """Turns that finished in the last step, offered at the next (`offer_finished`)."""
        sender.inbox.on(KVDecline, self._on_decline_notif)

    def records(self) -> dict[str, dict[str, int | str]]:
        """The recent returns by request id (any thread: a snapshot of the table, which
        only the engine thread changes)."""
        return {rid: asdict(rec) for rid, rec in list(self._records.items())}

    def _record(self, rid: str, rec: ReturnRecord) -> None:
        self._records[rid] = rec
        while len(self._records) > self.MAX_RECORDS:
            self._records.popitem(last=False)

    def on_finished(self, finished: list[Request]) -> None:
        """A step finished these requests: their turns are offered at the next step
        (`offer_finished`), once their answers went out.

        An aborted request is never held, so it is never offered.
        """
        for req in finished:
            if isinstance(req.connector_meta, ReturnSpec):
                self._to_offer.append((req, req.connector_meta))

    def has_pending_work(self) -> bool:
        return bool(self._to_offer)

    def offer_finished(self) -> None:
        """Before a step: offer the turns that finished in the last one (the engine
        dispatched that step's outputs in between)."""
        to_offer, self._to_offer = self._to_offer, []
        for req, spec in to_offer:
            self._offer(req, spec)

    def _offer(self, req: Request, spec: ReturnSpec) -> None:
        rid = req.request_id
        try:
            if req.finish_reason is None or req.finish_reason is FinishReason.ABORT:
                return
            offer = self._build_offer(req, spec)
            if offer is None:
                return
            xid, blocks, msg = offer
            rec = ReturnRecord(req.num_prompt_tokens, req.num_output_tokens, len(blocks))
            self._record(rid, rec)
            self.sender.offer(
                xid, spec.peer, blocks, msg.token_ids, on_end=partial(self._on_end, rec)
            )
        finally:
            self.engine.release_held(rid)
        self.stats.num_offered += 1
        try:
            self.sender.transport.send_notif(spec.peer, self.codec.encode(msg), xid)
        except Exception as exc:
            logger.warning("xid=%s: cannot offer to %s: %s", xid, spec.peer.engine_id, exc)
            self.sender.decline(xid, f"offer not sent: {exc}")
        logger.debug(
            "xid=%s: session %s offers blocks %d..+%d to %s",
            xid, spec.session_id, spec.from_block, len(blocks), spec.peer.engine_id,
        )  # fmt: skip

    def _build_offer(self, req: Request, spec: ReturnSpec) -> tuple[str, list[int], KVOffer] | None:
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_ids), len(req.block_hashes))
        if spec.max_tokens is not None:
            num_full = min(num_full, spec.max_tokens // bs)
        first = spec.from_block
        if first is None:  # the prompt's sender has its full blocks; else offer them all
            first = req.num_prompt_tokens // bs if req.num_remote_cached_tokens is not None else 0
        if first >= num_full:
            return None
        keys = req.block_hashes[first:num_full]
        parent = req.block_hashes[first - 1] if first > 0 else None
        xid = f"ret-{uuid.uuid4().hex}"
        msg = KVOffer(
            xid, spec.session_id, [bytes(k) for k in keys],
            list(req.all_token_ids[first * bs : num_full * bs]),
            None if parent is None else bytes(parent),
        )  # fmt: skip
        return xid, list(req.block_ids[first:num_full]), msg

    def _on_end(self, rec: ReturnRecord, job: SendJob) -> None:
        if job.error is None:
            self.stats.num_done += 1
            num_sent = job.num_blocks - (job.reg.first_block if job.reg else 0)
            self.stats.num_sent_blocks += num_sent
            self.stats.num_sent_bytes += job.num_bytes
            rec.num_sent_blocks, rec.num_sent_bytes = num_sent, job.num_bytes
            outcome = "done"
            if self.metrics is not None:
                self.metrics.return_blocks.labels("sent").inc(num_sent)
                self.metrics.return_bytes.labels("sent").inc(job.num_bytes)
        elif job.declined:
            self.stats.num_declined += 1
            outcome = "declined"
        else:
            self.stats.num_failed += 1
            outcome = "failed"
        rec.outcome = outcome
        if self.metrics is not None:
            self.metrics.returns.labels(outcome).inc()

    def _on_decline_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        assert isinstance(msg, KVDecline)
        logger.debug("xid=%s: %s declined the return: %s", msg.xid, sender, msg.reason)
        self.sender.decline(msg.xid, f"declined: {msg.reason}", by=sender)


class ReturnAcceptor:
    """Prefill's side: take the blocks of an offer it lacks, in its prefix cache and in
    the KV tier below it (engine thread)."""

    def __init__(
        self,
        receiver: KVReceiver,
        engine: EngineHandle,
        peer_of: Callable[[str], PeerHandle | None],
        metrics: KVFlowMetrics | None = None,
        max_blocks_per_offer: int | None = None,
        max_blocks_in_flight: int | None = None,
    ) -> None:
        """``max_blocks_per_offer`` bounds one offer, ``max_blocks_in_flight`` the blocks
        that accepted offers hold together until they end (None: unbounded): returns run
        in the background, and must not take the pool prefills need."""
        self.receiver = receiver
        self.engine = engine
        self.block_size = engine.block_size
        self.peer_of = peer_of
        self.metrics = metrics
        self.max_blocks_per_offer = max_blocks_per_offer
        self.max_blocks_in_flight = max_blocks_in_flight
        self.num_blocks_in_flight = 0
        """Blocks accepted offers hold (engine thread)."""
        self.stats = ReturnStats()
        receiver.inbox.on(KVOffer, self._on_offer_notif)

    def _on_offer_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        assert isinstance(msg, KVOffer)
        self.accept(msg, sender)

    def accept(self, msg: KVOffer, sender: str) -> None:
        """Answer an offer: register destination blocks, or decline (and say why).

        ``sender`` is the engine whose transport agent delivered the offer (the
        transport refused any offer whose envelope named another engine, or that
        came from an agent it never connected to); it must also be a peer this
        instance handshook with itself.
        """
        peer = self.peer_of(sender)
        if peer is None:
            logger.warning("xid=%s: offer from %s, which is not a connected peer", msg.xid, sender)
            self._count_refusal("unknown_peer")
            return
        problem, keys = self._check(msg)
        num_have = 0
        if problem is None:
            problem, num_have = self._num_held(msg, keys)
        if problem is not None:
            self._decline(peer, msg.xid, problem)
            return
        missing = keys[num_have:]
        if not missing:
            self._decline(peer, msg.xid, "has_all", num_have)
            return
        cap = self.max_blocks_in_flight
        if cap is not None and self.num_blocks_in_flight + len(missing) > cap:
            self._decline(peer, msg.xid, "busy", num_have)
            return
        blocks = self.engine.try_allocate_blocks(len(missing))
        if blocks is None:
            self._decline(peer, msg.xid, "no_room", num_have)
            return
        ok = self.receiver.expect(
            msg.xid, peer, blocks, num_have, msg.token_ids,
            on_done=partial(self._on_done, blocks, missing, msg.session_id),
            on_failed=partial(self._on_failed, blocks),
        )  # fmt: skip
        if not ok:
            self.engine.release_blocks(blocks)
            return
        self.num_blocks_in_flight += len(blocks)
        self.stats.num_accepted += 1

    def _check(self, msg: KVOffer) -> tuple[str | None, list[BlockHash]]:
        """Why the offer cannot be taken (a metrics label), and its keys."""
        bs = self.block_size
        n = len(msg.keys)
        if n == 0 or len(msg.token_ids) != n * bs:
            return "malformed", []
        if self.max_blocks_per_offer is not None and n > self.max_blocks_per_offer:
            return "too_large", []
        parent = None if msg.parent_key is None else BlockHash(msg.parent_key)
        keys = compute_block_hashes(msg.token_ids, bs, self.engine.identity, parent)
        if [bytes(k) for k in keys] != list(msg.keys):
            return "keys_mismatch", []
        return None, keys

    def _num_held(self, msg: KVOffer, keys: list[BlockHash]) -> tuple[str | None, int]:
        """How many leading offered blocks this instance holds, in its pool or in the KV
        tier below it (a lookup promotes those; one question to the tier, nothing loaded),
        or why the offer cannot be taken: its parent is held nowhere (blocks after a prefix
        we lack could never be hit: lookups stop at a miss)."""
        if msg.parent_key is None:
            return None, self.engine.num_held_prefix(keys)
        num_held = self.engine.num_held_prefix([BlockHash(msg.parent_key), *keys])
        if num_held == 0:
            return "prefix_missing", 0
        return None, num_held - 1

    def _decline(self, peer: PeerHandle, xid: str, reason: str, num_held: int = 0) -> None:
        self._count_refusal(reason)
        self.receiver.tell(peer, KVDecline(xid, reason, num_held))

    def _count_refusal(self, reason: str) -> None:
        self.stats.num_refused += 1
        if self.metrics is not None:
            self.metrics.return_declined.labels(reason).inc()

    def _on_done(
        self, blocks: list[int], keys: list[BlockHash], session_id: str, msg: KVDone
    ) -> None:
        self.num_blocks_in_flight -= len(blocks)
        num_cached = self.engine.cache_blocks(blocks, keys, HitSource.DECODE)
        self.engine.release_blocks(blocks, ReleaseTag.returned(session_id))
        self.stats.num_received_blocks += len(blocks)
        if self.metrics is not None:
            self.metrics.return_blocks.labels("received").inc(len(blocks))
            self.metrics.returns.labels("received").inc()
            num_bytes = len(blocks) * self.receiver.transport.layout.bytes_per_block
            self.metrics.received_bytes.labels("decode").inc(num_bytes)
        logger.debug("xid=%s: %d returned blocks cached (%d new)", msg.xid, len(blocks), num_cached)

    def _on_failed(self, blocks: list[int], cause: WaitFailure, reason: str) -> None:
        self.num_blocks_in_flight -= len(blocks)  # (the receiver may still hold them)
        self.engine.release_blocks(blocks)
        if self.metrics is not None:
            self.metrics.returns.labels(f"receive_{cause.value}").inc()


__all__ = ["ReturnAcceptor", "ReturnOfferer", "ReturnSpec", "ReturnStats"]
