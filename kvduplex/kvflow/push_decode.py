"""Decode's side of the layer-wise push: a request waits for its prompt's KV.

::

    HTTP prepare: register(PushSpec)      (before the request reaches the engine)
    admission: prefix hit + blocks for the rest ──► KVReceiver.expect (KVRegister to P)
    KVDone{first_token} ──► KVReceived: the request decodes on from P's first token
    KVFailed / deadline / cancel ──► KVReceiveFailed: the request prefills its prompt here

The outcomes are results (`take_finished`) that the engine's next step applies:
nothing here changes a request.

While a request waits for admission (queued on decode), its spec sends
prefill `KVWaiting` every third of the wait, which keeps prefill's wait for
the registration open; a spec whose request left before admission is dropped.

The router cancels a push when prefill fails, which can be before decode has
the request (prefill refused at once, the request still on its way here): such
a cancel is kept for up to a wait (`MAX_EARLY_CANCELS` at most), and the
request, when it comes, prefills its prompt here without waiting for KV.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from kvduplex.common.kv_layout import num_blocks_for_tokens
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.scheduler_output import KVFirstToken
from kvduplex.engine.scheduler_output import KVReceived
from kvduplex.engine.scheduler_output import KVReceiveFailed
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.engine.scheduler_output import RemoteKVAllocation
from kvduplex.kvflow.inbox import XidInUseError
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVWaiting
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.kvflow.receiver import KVReceiver
from kvduplex.kvflow.receiver import WaitFailure
from kvduplex.kvflow.sender import HEARTBEATS_PER_WAIT
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)

MAX_EARLY_CANCELS = 4096
"""Cancels of pushes decode has not heard of yet, kept at most (the oldest go first)."""


@dataclass
class PushSpec:
    """Where a decode request's pushed KV comes from (set before it is added)."""

    xid: str
    peer: PeerHandle
    prefill_url: str
    request_id: str | None = None
    """Decode's request for it; a spec whose request is gone before admission is dropped."""


@dataclass
class PushDecodeStats:
    num_received: int = 0
    num_received_blocks: int = 0
    num_fallbacks: int = 0
    num_skipped_blocks: int = 0
    """Blocks not pushed because the local prefix cache had them."""
    num_waiting_sent: int = 0


class PushDecode:
    """Pushed requests on decode: specs until admission, then a `KVReceiver` wait.

    Engine thread only, but for `submit` (a route registers a spec through the inbox)."""

    def __init__(
        self,
        receiver: KVReceiver,
        engine: EngineHandle,
        metrics: KVFlowMetrics | None = None,
    ) -> None:
        self.receiver = receiver
        self.engine = engine
        self.block_size = engine.block_size
        self.wait_s = receiver.wait_s
        self.metrics = metrics
        self.stats = PushDecodeStats()
        self._specs: dict[str, PushSpec] = {}
        self._spec_waiting_at: dict[str, float] = {}  # xid -> last KVWaiting to its prefill
        self._early_cancels: dict[str, float] = {}  # xid -> when, for a request still to come
        self._cancelled: set[str] = set()  # specs whose prefill failed: compute locally
        self._first_tokens: dict[str, int] = {}  # cancelled specs' first tokens, from P
        self._finished: list[KVTransferResult] = []
        receiver.inbox.every_tick(self._tick)
        receiver.on_unexpected_end = self._ended_before_admission

    def submit(self, spec: PushSpec) -> Future[None]:
        """Any thread: `register` on the engine thread; the future has its error."""
        return self.receiver.inbox.register(spec, self)

    def register(self, spec: PushSpec) -> None:
        """Engine thread, before the request is added. Raises ValueError for an xid
        another request waits on."""
        if spec.xid in self._specs or self.receiver.is_waiting(spec.xid):
            raise XidInUseError(f"xid {spec.xid!r} is in use by another request")
        self._specs[spec.xid] = spec
        if self._early_cancels.pop(spec.xid, None) is not None:
            # Kept, cancelled: the request prefills its prompt here when admitted.
            logger.info("xid=%s: cancelled before it came; computing locally", spec.xid)
            self._cancelled.add(spec.xid)
        self._spec_waiting_at[spec.xid] = time.monotonic()

    def num_specs(self) -> int:
        return len(self._specs)

    def owns(self, xid: str) -> bool:
        return xid in self._specs

    # ---- engine thread ----

    def take_finished(self) -> list[KVTransferResult]:
        """The outcomes of waits that ended since the last call, for the engine's step."""
        finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        return bool(self._finished)

    def start(self, alloc: RemoteKVAllocation) -> None:
        """The request was admitted with blocks for its whole prompt: register them."""
        xid, rid = alloc.transfer_id, alloc.request_id
        spec = self._specs.pop(xid, None)
        self._spec_waiting_at.pop(xid, None)
        cancelled = xid in self._cancelled
        self._cancelled.discard(xid)
        first_token = self._first_tokens.pop(xid, None)
        if cancelled:  # P failed: no registration
            if first_token is not None:  # the prompt computed here continues from it
                self._finished.append(KVFirstToken(rid, first_token))
            self._fall_back(rid, "cancelled", discard_blocks=False)
            return
        if spec is None:
            logger.warning("request %s: no push spec for %s; computing locally", rid, xid)
            self._finished.append(KVReceiveFailed(rid, discard_blocks=False))
            return
        req = self.engine.get_request(rid)
        if req is None:  # admitted this step: only a bug gets here
            logger.warning("request %s: gone at its admission; not registering %s", rid, xid)
            self._finished.append(KVReceiveFailed(rid, discard_blocks=False))
            return
        first = alloc.num_cached_tokens // self.block_size
        num_blocks = num_blocks_for_tokens(alloc.num_prompt_tokens, self.block_size)
        blocks = list(alloc.block_ids[first:num_blocks])
        self.stats.num_skipped_blocks += first
        if self.metrics is not None:
            self.metrics.remote_prefix_hit_tokens.inc(alloc.num_cached_tokens)
        ok = self.receiver.expect(
            xid, spec.peer, blocks, first, req.prompt_token_ids,
            on_done=partial(self._on_done, rid, len(blocks)),
            on_failed=partial(self._on_failed, rid),
            on_first_token=partial(self._on_first_token, rid),
        )  # fmt: skip
        if not ok:
            self._fall_back(rid, "register_failed", discard_blocks=False)

    def cancel(self, xid: str, reason: str) -> bool:
        """Stop waiting for `xid` (the router: prefill failed); False if unknown (kept for
        a request still to come: see the module docstring) or over."""
        if xid in self._specs:  # not admitted yet: it computes locally when admitted
            self._cancelled.add(xid)
            return True
        if self.receiver.cancel(xid, reason):
            return True
        if len(self._early_cancels) >= MAX_EARLY_CANCELS:
            del self._early_cancels[next(iter(self._early_cancels))]
        self._early_cancels[xid] = time.monotonic()
        return False

    def _ended_before_admission(self, msg: KVDone | KVFailed, sender: str) -> bool:
        """Prefill gave up a push that this decode queues for room (its pool needed the
        blocks): the request computes its prompt here when admitted, from prefill's first
        token (the client may have it). Any other end of a transfer not waited for is not
        this flow's."""
        spec = self._specs.get(msg.xid)
        if not isinstance(msg, KVFailed) or spec is None or spec.peer.engine_id != sender:
            return False
        logger.info("xid=%s: prefill gave it up before admission (%s); computing locally",
                    msg.xid, msg.reason)  # fmt: skip
        self._cancelled.add(msg.xid)
        if msg.first_token is not None:
            self._first_tokens[msg.xid] = msg.first_token
        return True

    def on_aborted(self, xid: str) -> None:
        """Engine thread: decode's request for `xid` was aborted. Before admission its
        spec goes and prefill is told to stop (KVCancel); after, the wait is cancelled
        (prefill is told the same; the registered blocks stay quarantined until it
        confirms that nothing can land)."""
        spec = self._specs.pop(xid, None)
        self._spec_waiting_at.pop(xid, None)
        self._first_tokens.pop(xid, None)
        if xid in self._cancelled:  # its prefill failed: nothing to tell
            self._cancelled.discard(xid)
            return
        if spec is not None:
            logger.info("xid=%s: decode request aborted before admission", xid)
            self.receiver.tell(spec.peer, KVCancel(xid, "the decode request was aborted"))
            return
        self.receiver.cancel(xid, "the decode request was aborted")

    def _on_done(self, rid: str, num_blocks: int, msg: KVDone) -> None:
        req = self.engine.get_request(rid)
        if req is None:
            return
        if msg.first_token is None:
            self._fall_back(rid, "no_first_token", discard_blocks=False)
            return
        num_bytes = num_blocks * self.receiver.transport.layout.bytes_per_block
        self._finished.append(
            KVReceived(
                rid, msg.first_token, msg.num_cached_tokens, num_bytes, msg.first_token_logprobs
            )
        )
        self.stats.num_received += 1
        self.stats.num_received_blocks += num_blocks
        if self.metrics is not None:
            self.metrics.received_tokens.inc(msg.num_tokens - req.num_cached_tokens)
            self.metrics.received_bytes.labels("prefill").inc(num_bytes)

    def _on_first_token(self, rid: str, token: int) -> None:
        """Prefill sampled the first token (the router may have sent it to the client
        already): a prompt computed here continues from it, if it has not sampled yet."""
        req = self.engine.get_request(rid)
        if req is not None and req.num_output_tokens == 0:
            self._finished.append(KVFirstToken(rid, token))

    def _on_failed(self, rid: str, cause: WaitFailure, reason: str) -> None:
        if self.engine.get_request(rid) is None:
            return  # aborted: nothing falls back
        self._fall_back(rid, cause.value, discard_blocks=cause.may_still_be_written)

    def _fall_back(self, rid: str, reason: str, *, discard_blocks: bool) -> None:
        self.stats.num_fallbacks += 1
        if self.metrics is not None:
            self.metrics.fallbacks.labels(reason).inc()
        self._finished.append(KVReceiveFailed(rid, discard_blocks=discard_blocks))

    def _drop_orphan_specs(self, specs: list[PushSpec]) -> None:
        """Forget specs whose request left before admission (aborted, or never added), so
        that their heartbeats stop; prefill's own wait for the registration then ends the
        job."""
        gone = [
            s.xid for s in specs if s.request_id and self.engine.get_request(s.request_id) is None
        ]
        for xid in gone:
            if self._specs.pop(xid, None) is not None:
                logger.info("xid=%s: decode request gone before admission", xid)
            self._spec_waiting_at.pop(xid, None)
            self._cancelled.discard(xid)
            self._first_tokens.pop(xid, None)

    def _tick(self, now: float) -> None:
        while self._early_cancels:  # in the order they came
            xid, at = next(iter(self._early_cancels.items()))
            if now - at < self.wait_s:
                break
            del self._early_cancels[xid]
        if not self.engine.is_healthy:
            return
        beats: list[PushSpec] = []  # specs due a heartbeat, and a check that they still queue
        for xid, at in self._spec_waiting_at.items():
            if now - at >= self.wait_s / HEARTBEATS_PER_WAIT:
                self._spec_waiting_at[xid] = now
                beats.append(self._specs[xid])
        if not beats:
            return
        waiting = [spec for spec in beats if spec.xid not in self._cancelled]
        self.stats.num_waiting_sent += len(waiting)
        self._drop_orphan_specs(beats)
        for spec in waiting:  # a cancelled spec's prefill failed: nothing to keep open
            if spec.xid in self._specs:
                self.receiver.tell(spec.peer, KVWaiting(spec.xid))


__all__ = ["PushDecode", "PushDecodeStats", "PushSpec"]
