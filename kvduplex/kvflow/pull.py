"""The pull flow: decode READs a finished prefill's held blocks.

Prefill side: `kvduplex.kvflow.lease.LeaseTable` keeps a finished request's
blocks (held by the scheduler) until decode releases them or the lease expires.

Decode side: `PullConnector` (part of decode's connector) posts one NIXL READ per request
once the scheduler allocated its blocks, for the blocks the local prefix
cache lacks. Everything runs on the engine thread: the READ's end comes
back through the flow inbox, and the outcome (`KVReceived` /
`KVReceiveFailed`) is recorded for the engine's next step to apply
(`take_finished`). Specs are registered through the inbox too (`register`
from a route). Release requests to prefill go over HTTP from the flow I/O
thread, never from the engine thread.

Prefill's lease is released once nothing of the READ can read its blocks any
more: at the READ's settlement, not at its outcome. A READ that failed at its
deadline may still be reading (a deadline ends the wait, not the transfer),
so the request computes its prompt here at once, while prefill keeps the
source blocks until the READ settles (it lands, or its endpoint is torn down)::

    READ posted ── outcome (ok, failed) ──► the request resumes or recomputes
                └─ settled ──────────────► ReleaseLease (prefill may reuse its blocks)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING
from typing import Any

import httpx

from kvduplex.common.kv_layout import num_blocks_for_tokens
from kvduplex.common.trust import secret_headers
from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.scheduler_output import KVReceived
from kvduplex.engine.scheduler_output import KVReceiveFailed
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.engine.scheduler_output import RemoteKVAllocation
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import ReleaseLease
from kvduplex.kvflow.half import ReadRunner
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.inbox import XidInUseError
from kvduplex.kvflow.machines.read import Outcome
from kvduplex.kvflow.messages import ids_digest
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.transport.base import Transport
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import PeerUnavailableError
from kvduplex.transport.protocol import TransferHandle

if TYPE_CHECKING:
    from kvduplex.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

RELEASE_PATH = "/internal/release"


@dataclass
class PullSpec:
    """Where decode reads a request's prompt KV from."""

    xid: str
    peer: PeerHandle
    prefill_url: str
    block_ids: list[int]
    num_tokens: int
    ids_digest: bytes
    """`ids_digest` of the prompt prefill computed into the blocks (its answer's): decode
    reads nothing unless its own prompt's digest is the same."""
    lease_ends_at: float | None = None
    """Monotonic time (here) after which prefill may have reused the blocks."""
    num_cached_tokens: int = 0
    """Prompt tokens prefill served from its prefix cache."""
    request_id: str | None = None
    """Decode's request for it: a spec whose request never reached the engine is dropped."""
    registered_at: float = field(default_factory=lambda: time.monotonic())
    """When decode registered it (this module's clock, read at that moment)."""


# A READ must be able to finish this long before prefill's lease ends.
LEASE_MARGIN_S = 0.5


@dataclass
class PullStats:
    num_pulls: int = 0
    num_pulled_blocks: int = 0
    num_failed: int = 0
    num_skipped_blocks: int = 0
    """Blocks not read because the local prefix cache had them."""
    num_prompt_mismatches: int = 0
    """Pulls refused because prefill computed other token ids than the request's prompt."""


class PullConnector:
    """Decode's connector for the pull flow: engine thread only, but for `submit`.

    A spec is registered before its request is added (`submit` from a route).
    """

    def __init__(
        self,
        transport: Transport,
        engine: EngineHandle,
        inbox: FlowInbox,
        io: FlowIO,
        deadline_s: float,
        release: Callable[[str, str], None] | None = None,
        metrics: KVFlowMetrics | None = None,
    ) -> None:
        self.transport = transport
        self.metrics = metrics
        self.engine = engine
        self.inbox = inbox
        self.io = io
        self.block_size = engine.block_size
        self.deadline_s = deadline_s
        self.stats = PullStats()
        self._release = release or http_release
        self._specs: dict[str, PullSpec] = {}
        self._in_flight: dict[str, TransferHandle] = {}  # request id -> read
        self._finished: list[KVTransferResult] = []
        inbox.every_tick(self._tick)

    def submit(self, spec: PullSpec) -> Future[None]:
        """Any thread: `register` on the engine thread; the future has its error."""
        return self.inbox.register(spec, self)

    def register(self, spec: PullSpec) -> None:
        """Engine thread, before the request is added. Raises ValueError for an xid
        another request waits on."""
        if spec.xid in self._specs:
            raise XidInUseError(f"xid {spec.xid!r} is in use by another request")
        self._specs[spec.xid] = spec

    def forget(self, xid: str) -> PullSpec | None:
        return self._specs.pop(xid, None)

    def has_pending_work(self) -> bool:
        """READs not settled, or outcomes the engine has not taken yet."""
        return bool(self._in_flight or self._finished)

    def take_finished(self) -> list[KVTransferResult]:
        """Engine thread: the outcomes of pulls since the last call, for the engine's step."""
        finished, self._finished = self._finished, []
        return finished

    def num_specs(self) -> int:
        return len(self._specs)

    def num_in_flight(self) -> int:
        """READs posted and not settled (they hold prefill's lease)."""
        return len(self._in_flight)

    def _tick(self, now: float) -> None:
        """Drop specs whose request never arrived."""
        old = [s for s in self._specs.values() if now - s.registered_at > self.deadline_s]
        for spec in old:
            if spec.request_id is not None and self.engine.get_request(spec.request_id) is None:
                self.on_aborted(spec.xid)

    def on_aborted(self, xid: str) -> None:
        """Engine thread: decode's request for `xid` was aborted. One not admitted yet
        drops its spec and releases prefill's lease at once (a READ under way finishes
        on its own: its targets stay referenced until it settles, then the lease goes)."""
        spec = self.forget(xid)
        if spec is not None:
            logger.info("xid=%s: decode request aborted before its READ", xid)
            self._release_lease(spec)

    # ---- engine thread ----

    def start(self, alloc: RemoteKVAllocation) -> None:
        """The request was admitted with blocks for its prompt: READ what is missing."""
        rid = alloc.request_id
        spec = self.forget(alloc.transfer_id)
        if spec is None:
            logger.warning("request %s: no pull spec; computing the prompt locally", rid)
            self._finished.append(KVReceiveFailed(rid, discard_blocks=False))
            return
        if not self._read(alloc, spec):  # nothing was posted: the lease can go now
            self._release_lease(spec)

    def _read(self, alloc: RemoteKVAllocation, spec: PullSpec) -> bool:
        """Post the READ of what the request lacks; False if none was posted (the outcome
        is recorded already)."""
        rid = alloc.request_id
        num_blocks = num_blocks_for_tokens(alloc.num_prompt_tokens, self.block_size)
        first = alloc.num_cached_tokens // self.block_size
        if spec.num_tokens != alloc.num_prompt_tokens or len(spec.block_ids) < num_blocks:
            logger.warning(
                "request %s: prefill has %d tokens in %d blocks, the prompt %d tokens; "
                "computing locally", rid, spec.num_tokens, len(spec.block_ids),
                alloc.num_prompt_tokens,
            )  # fmt: skip
            self._finish(rid, spec, ok=False, num_read=0)
            return False
        if not self._is_same_prompt(rid, spec):
            self._finish(rid, spec, ok=False, num_read=0)
            return False
        local = list(alloc.block_ids[first:num_blocks])
        remote = spec.block_ids[first:num_blocks]
        self.stats.num_skipped_blocks += first
        if self.metrics is not None:
            self.metrics.remote_prefix_hit_tokens.inc(alloc.num_cached_tokens)
        if not local:
            self._finish(rid, spec, ok=True, num_read=0)
            return False
        deadline_s = self.deadline_s
        if spec.lease_ends_at is not None:
            deadline_s = min(deadline_s, spec.lease_ends_at - time.monotonic() - LEASE_MARGIN_S)
        if deadline_s <= 0:
            logger.warning(
                "request %s: prefill's lease on %s ran out; computing locally", rid, spec.xid
            )
            self._finish(rid, spec, ok=False, num_read=0)
            return False

        # Our own reference keeps the target blocks allocated while the READ can
        # still land (until it is settled), even if the request is aborted meanwhile.
        def on_outcome(o: Outcome, handle: TransferHandle | None) -> None:  # engine thread
            if handle is None:  # validation or a dead peer: compute locally
                logger.warning(
                    "request %s: READ from %s failed: %s", rid, spec.prefill_url, o.reason
                )
                self._finish(rid, spec, ok=False, num_read=0)
                return
            if not o.ok:
                logger.warning("request %s: READ %s failed: %s", rid, handle.xid, o.reason)
            self._finish(rid, spec, ok=o.ok, num_read=len(local), discard_blocks=o.discard)

        def on_settled() -> None:  # engine thread: nothing of the READ reads P's blocks
            self._in_flight.pop(rid, None)
            self._release_lease(spec)

        runner = ReadRunner(
            self.transport, self.engine, self.inbox, self.io, spec.peer, spec.xid, list(local),
            list(remote), deadline_s, self.deadline_s, on_outcome, on_settled,
        )  # fmt: skip
        handle = runner.start()
        if handle is not None:  # its settlement comes through the inbox, never inline
            self._in_flight[rid] = handle
        return True

    def _is_same_prompt(self, rid: str, spec: PullSpec) -> bool:
        """Whether prefill computed the request's own prompt (equal `ids_digest`); if not,
        logged with the xid and counted: the request computes its prompt here."""
        req = self.engine.get_request(rid)
        if req is not None and ids_digest(req.prompt_token_ids) == spec.ids_digest:
            return True
        if req is not None:
            logger.warning(
                "xid=%s: request %s: prefill computed other token ids than its prompt's (ids "
                "digest %s there, %s here); reading nothing, computing locally",
                spec.xid, rid, spec.ids_digest.hex()[:16],
                ids_digest(req.prompt_token_ids).hex()[:16],
            )  # fmt: skip
            if self.metrics is not None:
                self.metrics.prompt_mismatches.labels("pull").inc()
            self.stats.num_prompt_mismatches += 1
        return False

    def _finish(
        self, rid: str, spec: PullSpec, *, ok: bool, num_read: int, discard_blocks: bool = False
    ) -> None:
        """Have the next step resume the request with the KV read, or compute its prompt
        here (into fresh blocks when the READ may still land in the ones it has)."""
        req = self.engine.get_request(rid)
        if not ok:
            self.stats.num_failed += 1
            if self.metrics is not None:
                self.metrics.fallbacks.labels("pull_failed").inc()
        if req is None:  # aborted meanwhile
            logger.info("request %s: gone before its KV arrived", rid)
        elif ok:
            num_bytes = num_read * self.transport.layout.bytes_per_block
            self._finished.append(KVReceived(rid, None, spec.num_cached_tokens, num_bytes))
            self.stats.num_pulls += 1
            self.stats.num_pulled_blocks += num_read
            if self.metrics is not None:
                self.metrics.received_tokens.inc(req.num_prompt_tokens - req.num_cached_tokens)
                self.metrics.received_bytes.labels("prefill").inc(num_bytes)
        else:
            self._finished.append(KVReceiveFailed(rid, discard_blocks=discard_blocks))

    def _release_lease(self, spec: PullSpec) -> None:
        self.io.submit(ReleaseLease(self._release, spec.prefill_url, spec.xid))

    def close(self) -> None:
        self.io.close()


def http_release(
    peer_url: str,
    xid: str,
    secret: str | None = None,
    verify: Callable[[str], None] | None = None,
    client: httpx.Client | None = None,
) -> None:
    """Tell the peer that lent blocks (prefill for a pull, decode for a fetch) to drop its
    lease on `xid` (best effort: the lease expires anyway), sending the cluster `secret` if
    there is one, once `verify(peer_url)` returned (`PeerVerifier.ensure`: the peer proved
    it holds the secret too; if it did not, nothing is sent and the lease expires).
    `client`: the instance's HTTP client for its peers (None: a one-off client)."""
    if verify is not None:
        try:
            verify(peer_url)
        except PeerUnavailableError as exc:
            logger.warning("xid=%s: release not sent: %s", xid, exc)
            return
    if client is not None and client.is_closed:  # the instance is shutting down
        logger.info("xid=%s: release not sent to %s: this instance is stopping", xid, peer_url)
        return
    try:
        post = httpx.post if client is None else client.post
        resp = post(
            peer_url.rstrip("/") + RELEASE_PATH, json={"xid": xid}, timeout=5.0,
            headers=secret_headers(secret),
        )  # fmt: skip
        if resp.status_code != 200:  # 404: the lease ended already; 401: secrets differ
            logger.log(
                logging.WARNING if resp.status_code == 401 else logging.INFO,
                "xid=%s: release at %s answered %d: %s",
                xid, peer_url, resp.status_code, resp.text[:200],
            )  # fmt: skip
    except httpx.HTTPError as exc:
        logger.warning("xid=%s: release at %s failed: %s", xid, peer_url, exc)


def block_ids_of(engine: LLMEngine, request_id: str) -> dict[str, Any] | None:
    """A held request's blocks, the `ids_digest` of its prompt (hex) and its first token
    (engine thread)."""
    req = engine.scheduler.get_request(request_id)
    if req is None:
        return None
    return {
        "block_ids": list(req.block_ids),
        "num_tokens": req.num_prompt_tokens,
        "ids_digest": ids_digest(req.prompt_token_ids).hex(),
        "first_token": req.output_token_ids[0] if req.output_token_ids else None,
        "num_cached_tokens": req.num_cached_tokens,
    }
