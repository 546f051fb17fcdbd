"""The layer-wise push flow: prefill WRITEs each layer's KV into blocks decode allocated.

::

    router ──► P /internal/push/prefill {xid, prompt, decode_url}     (at the same time)
    router ──► D /v1/... {kv_transfer_params: {mode: push, xid, prefill_url}}
    D: admit, allocate the blocks its prefix cache lacks ──notif──► P: PushRegister
    P: after each layer of each chunk, WRITE that layer's finished blocks
       (registration late? first WRITE everything already computed, then stream)
    P: first token sampled, every WRITE done ──notif──► D: KVDone{first_token}
    D: decode from P's first token; nothing is recomputed

Prefill side: `PushSender`, the prefill instance's `KVConnector`. Decode side:
`PushReceiver`, one part of the decode instance's connector. Both keep their
state on the engine thread; the transport's completion callbacks and the
notification pump only take a lock or enqueue an engine call.

Failure rules:

* Deadlines bound silence, not queueing. While P holds a registered job (queued
  behind other prefills, computing, writing) it sends D a `PushAlive` every
  third of D's wait; each one restarts D's wait, and D's `PushAliveAck` moves
  P's own deadline on by the wait from when the heartbeat left, so P still never
  writes after D's deadline (a D that gave up does not answer). While D's
  request waits for admission on D (not registered yet), D sends P heartbeats
  that keep P's wait for the registration open. Only a healthy engine sends
  them, so a stopped, killed or failed peer goes silent and the wait runs out.
* D waits at most ``kv_wait_timeout_s`` without word from P. On expiry it tells P to stop
  (`PushCancel`), computes the prompt itself into fresh blocks, and keeps its
  own reference on the registered blocks (quarantine) until P confirms that no
  WRITE can land any more (`KVFailed` / `KVDone`) or a further transfer
  deadline passed. A late WRITE therefore never lands in a block that holds
  someone else's KV.
* P sends `KVFailed` only once none of its WRITEs is in flight; D then computes
  locally in the blocks it already has.
* P keeps the request's blocks (held) until every WRITE from them ended, and
  references the source blocks of each WRITE, so a preemption cannot hand them
  to another request under an in-flight WRITE.
* P waits at most ``kv_wait_timeout_s`` for a registration (without word from
  D), then drops the job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from kvduplex.engine.request import Request
from kvduplex.engine.scheduler import SchedulerOutput
from kvduplex.transfer.messages import ControlMessage, KVDone, KVFailed, MessageCodec
from kvduplex.transfer.metrics import KVFlowMetrics
from kvduplex.transfer.transport import PeerHandle, TransferHandle, TransferState, Transport

if TYPE_CHECKING:
    from kvduplex.engine.async_engine import AsyncEngine
    from kvduplex.transfer.notify import NotificationPump

logger = logging.getLogger(__name__)
T = TypeVar("T")


class PushRegister(ControlMessage, tag="push_register", frozen=True):
    """Decode's destination blocks for prompt blocks ``first_block ..`` of transfer ``xid``."""

    block_ids: list[int]
    first_block: int
    """Prompt blocks before this one decode already has (its prefix cache)."""
    num_prompt_tokens: int
    wait_s: float
    """How long decode waits from sending this without hearing from prefill (each
    `PushAlive` restarts it); prefill writes nothing after that."""
    sent_at: float
    """Decode's wall clock (`time.time`) when it sent this: a registration that arrives
    late (prefill stalled) gets only what is left of decode's wait."""


class PushAlive(ControlMessage, tag="push_alive", frozen=True):
    """The sender still holds transfer ``xid`` and its engine runs: restart the wait for it."""

    sent_at: float = 0.0
    """The sender's `time.monotonic()` when it sent this (echoed by `PushAliveAck`)."""


class PushAliveAck(ControlMessage, tag="push_alive_ack", frozen=True):
    """Decode restarted its wait for ``xid`` on the `PushAlive` sent at ``sent_at``."""

    sent_at: float


HEARTBEATS_PER_WAIT = 3
"""`PushAlive` messages per wait period: a lost one or two do not end the wait."""


class PushCancel(ControlMessage, tag="push_cancel", frozen=True):
    """Decode stopped waiting for ``xid``; prefill stops writing and confirms with KVFailed."""

    reason: str = ""


def _run(fn: Callable[[T], None], arg: T, _engine: object) -> None:
    """``engine.call(partial(_run, fn, arg))`` runs ``fn(arg)`` in the engine thread."""
    fn(arg)


def _num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# --------------------------------------------------------------------------- prefill side


@dataclass
class _Chunk:
    """The blocks one step WRITEs for one job, layer by layer."""

    src: list[int]
    dst: list[int]
    hi: int
    """Prompt blocks [0, hi) are sent once this chunk's layers are posted."""
    num_pending: int = 0
    """WRITEs of this chunk not ended yet; the last one drops the source references."""
    from_layer: int = 0
    """First layer the layer hook still WRITEs (a registration mid-forward did the rest)."""


@dataclass
class _Job:
    xid: str
    peer: PeerHandle
    num_prompt_tokens: int
    num_blocks: int
    expires_at: float
    """Registration deadline (until registered; decode's heartbeats move it on), then
    decode's own deadline (moved on by each acknowledged heartbeat)."""
    reg: PushRegister | None = None
    alive_sent_at: float = 0.0
    expiring: bool = False
    """An `_expire` call is queued for the engine thread (one at a time)."""
    sent: int = 0
    """Prompt blocks [0, sent) are written (or decode has them)."""
    in_flight: int = 0
    error: str | None = None
    first_token: int | None = None
    num_cached_tokens: int = 0
    """Prompt tokens prefill served from its own prefix cache."""
    compute_done_at: float | None = None
    first_post_at: float | None = None
    last_done_at: float | None = None
    ended: bool = False
    num_bytes: int = 0


@dataclass
class PushSenderStats:
    num_done: int = 0
    num_failed: int = 0
    num_written_blocks: int = 0
    num_writes: int = 0
    num_late_registrations: int = 0
    """Registrations that found blocks already computed (written at once)."""
    transfer_s: float = 0.0
    exposed_s: float = 0.0
    """Part of ``transfer_s`` after the prefill's compute ended (not hidden)."""
    num_alive_sent: int = 0
    num_alive_received: int = 0


class PushSender:
    """The prefill instance's connector: streams each job's KV into decode's blocks."""

    def __init__(
        self,
        transport: Transport,
        engine: AsyncEngine,
        block_size: int,
        registration_wait_s: float,
        deadline_s: float,
        metrics: KVFlowMetrics | None = None,
        peer_of: Callable[[str], PeerHandle | None] | None = None,
    ) -> None:
        """``peer_of(engine_id)`` finds a connected peer (to answer registrations of
        pushes that no longer exist)."""
        self.transport = transport
        self.engine = engine
        self.block_size = block_size
        self.peer_of = peer_of
        self.registration_wait_s = registration_wait_s
        self.deadline_s = deadline_s
        self.metrics = metrics
        self.stats = PushSenderStats()
        self.codec = MessageCodec()
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._early: dict[str, tuple[PushRegister, str, float]] = {}
        self._cancelled: dict[str, float] = {}  # xid -> until when it is refused
        self._chunks: dict[str, _Chunk] = {}  # this step's, by request id (= xid)
        self._step_seqs: dict[str, tuple[int, int]] = {}  # this step's jobs: xid -> (start, end)
        self._regs: list[tuple[PushRegister, str]] = []  # received, not applied yet
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-push-notify")

    def attach(self, pump: NotificationPump) -> None:
        pump.on(PushRegister, self._on_register_notif)
        pump.on(PushCancel, self._on_cancel_notif)
        pump.on(PushAlive, self._on_alive_notif)
        pump.on(PushAliveAck, self._on_alive_ack_notif)
        pump.every_tick(self._tick)

    # ---- engine thread: jobs ----

    def expect(self, xid: str, peer: PeerHandle, num_prompt_tokens: int) -> None:
        """A push prefill named `xid` is about to be added (its request id is `xid`).

        Raises ValueError for an xid in progress or one decode already cancelled.
        """
        if xid in self._jobs:
            raise ValueError(f"a push with xid {xid!r} is already in progress")
        if xid in self._cancelled:
            raise ValueError(f"the push {xid!r} was cancelled by decode")
        job = _Job(
            xid, peer, num_prompt_tokens, _num_blocks(num_prompt_tokens, self.block_size),
            expires_at=time.monotonic() + self.registration_wait_s,
        )  # fmt: skip
        with self._lock:
            self._jobs[xid] = job
            early = self._early.pop(xid, None)
        if early is not None:
            self._register(early[0], early[1])

    def cancel(self, xid: str, reason: str) -> bool:
        """Stop writing `xid`; decode hears KVFailed once nothing is in flight. False if unknown.

        An unknown xid is remembered for a while, so that a prefill or
        registration arriving after its cancellation is refused.
        """
        job = self._jobs.get(xid)
        if job is None:
            with self._lock:
                self._cancelled[xid] = time.monotonic() + 2 * self.registration_wait_s
                self._early.pop(xid, None)
            return False
        sched = self.engine.engine.scheduler
        req = sched.get_request(xid)
        if req is not None and not req.is_finished:
            self.engine.engine.abort_request(xid)
        self._fail(job, reason)
        return True

    def _register(self, msg: PushRegister, sender: str, layer: int | None = None) -> None:
        """Apply a registration; `layer` is the last computed layer when called mid-forward."""
        job = self._jobs.get(msg.xid)
        if job is None:
            if msg.xid not in self._cancelled:
                with self._lock:
                    self._early[msg.xid] = (msg, sender, time.monotonic() + self.registration_wait_s)
                return
            # Cancelled before it began: nothing will be written, decode may reuse the blocks.
            peer = self.peer_of(sender) if self.peer_of is not None else None
            if peer is not None:
                self._notify.submit(self._send, peer, KVFailed(msg.xid, "cancelled"))
            return
        if job.reg is not None or job.ended:
            logger.warning("xid=%s: duplicate registration from %s ignored", msg.xid, sender)
            return
        problem = self._check_registration(job, msg, sender)
        if problem is not None:
            logger.warning("xid=%s: registration refused: %s", msg.xid, problem)
            self._fail(job, problem)
            return
        job.reg = msg
        left = min(msg.wait_s, msg.sent_at + msg.wait_s - time.time())
        job.expires_at = time.monotonic() + left
        job.alive_sent_at = time.monotonic()
        if left <= 0:
            self._fail(job, "the registration arrived after decode stopped waiting")
            return
        job.sent = msg.first_block
        req = self.engine.engine.scheduler.get_request(msg.xid)
        if req is None:
            self._maybe_end(job)
            return
        # Registration after prefill began: write what is computed at once.
        step = self._step_seqs.get(msg.xid)
        if step is not None and layer is not None:  # mid-forward: this chunk's layers 0..layer
            start, end = step
            self._catch_up(job, req, self._blocks_done(job, start))
            hi = self._blocks_done(job, end)
            if hi > job.sent:
                chunk = self._plan(job, req, hi)
                chunk.num_pending = self.transport.layout.num_layers - layer
                chunk.from_layer = layer + 1
                self._chunks[job.xid] = chunk
                self._post(job, chunk, layers=list(range(layer + 1)))
        else:
            self._catch_up(job, req, self._blocks_done(job, req.num_computed_tokens))
        self._maybe_end(job)

    def _blocks_done(self, job: _Job, num_computed: int) -> int:
        """Prompt blocks whose every token is computed once `num_computed` tokens are."""
        if num_computed >= job.num_prompt_tokens:
            return job.num_blocks
        return num_computed // self.block_size

    def _catch_up(self, job: _Job, req: Request, hi: int) -> None:
        """WRITE blocks [sent, hi), all layers, in one transfer."""
        if hi > job.sent:
            self.stats.num_late_registrations += 1
            chunk = self._plan(job, req, hi)
            chunk.num_pending = 1
            self._post(job, chunk, layers=None)
            job.sent = hi

    def _check_registration(self, job: _Job, msg: PushRegister, sender: str) -> str | None:
        if sender != job.peer.engine_id:
            return f"sent by {sender}, but the push goes to {job.peer.engine_id}"
        if msg.num_prompt_tokens != job.num_prompt_tokens:
            return (
                f"decode has {msg.num_prompt_tokens} prompt tokens, prefill {job.num_prompt_tokens}"
            )
        if not 0 <= msg.first_block <= job.num_blocks or (
            msg.first_block + len(msg.block_ids) != job.num_blocks
        ):
            return (
                f"decode registered blocks {msg.first_block}..+{len(msg.block_ids)} "
                f"of a {job.num_blocks}-block prompt"
            )
        return None

    def _plan(self, job: _Job, req: Request, hi: int) -> _Chunk:
        assert job.reg is not None
        lo, first = job.sent, job.reg.first_block
        src = list(req.block_ids[lo:hi])
        self.engine.engine.block_pool.acquire(src)
        return _Chunk(src=src, dst=list(job.reg.block_ids[lo - first : hi - first]), hi=hi)

    # ---- KVConnector ----

    def on_scheduled(self, out: SchedulerOutput) -> None:
        self._chunks.clear()
        self._step_seqs.clear()
        if out.seqs:
            self.transport.set_compute_busy(True)
        if not self._jobs:
            return
        for seq in out.seqs:
            job = self._jobs.get(seq.request.request_id)
            if job is None or job.error is not None:
                continue
            end = seq.start_pos + seq.num_new_tokens
            self._step_seqs[job.xid] = (seq.start_pos, end)
            if job.reg is None:
                continue
            hi = self._blocks_done(job, end)
            if hi > job.sent:
                chunk = self._plan(job, seq.request, hi)
                chunk.num_pending = self.transport.layout.num_layers
                self._chunks[job.xid] = chunk

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        if not self._step_seqs:
            return None

        def on_layer_done(layer: int) -> None:
            self._drain_registrations(layer)
            for xid, chunk in self._chunks.items():
                if chunk.from_layer <= layer:
                    self._post(self._jobs[xid], chunk, layers=[layer])

        return on_layer_done

    def on_step_done(
        self, out: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> None:
        self.transport.set_compute_busy(False)
        for xid, chunk in self._chunks.items():
            self._jobs[xid].sent = chunk.hi
        self._chunks.clear()
        self._step_seqs.clear()
        now = time.monotonic()
        for req in finished:
            job = self._jobs.get(req.request_id)
            if job is None or not req.output_token_ids:
                continue
            job.first_token = req.output_token_ids[0]
            job.num_cached_tokens = req.num_cached_tokens
            job.compute_done_at = now
            self._maybe_end(job)

    def _drain_registrations(self, layer: int | None = None) -> None:
        """Apply registrations the pump received (between steps, or between two layers)."""
        with self._lock:
            regs, self._regs = self._regs, []
        for msg, sender in regs:
            self._register(msg, sender, layer)

    def take_updated_requests(self) -> list[Request]:
        return []

    def has_pending_work(self) -> bool:
        return False

    # ---- posting and completion (any thread after posting) ----

    def _post(self, job: _Job, chunk: _Chunk, layers: list[int] | None) -> None:
        if job.error is None and time.monotonic() >= job.expires_at:
            self._fail(job, "decode's wait ran out")  # never WRITE after decode's deadline
        if job.error is not None:
            self._chunk_part_done(job, chunk)
            return
        with self._lock:
            job.in_flight += 1
            if job.first_post_at is None:
                job.first_post_at = time.monotonic()
        deadline = min(self.deadline_s, max(0.001, job.expires_at - time.monotonic()))
        try:
            handle = self.transport.write(
                job.peer, job.xid, chunk.src, chunk.dst, layers=layers, deadline_s=deadline
            )
        except Exception as exc:  # a bug in the plan, or the transport closed
            logger.exception("xid=%s: WRITE failed to post", job.xid)
            self._on_write_done(job, chunk, None, f"post failed: {exc}")
            return
        handle.add_done_callback(lambda h: self._on_write_done(job, chunk, h, h.reason))

    def _on_write_done(
        self, job: _Job, chunk: _Chunk, handle: TransferHandle | None, reason: str | None
    ) -> None:
        ok = handle is not None and handle.state is TransferState.DONE
        with self._lock:
            job.in_flight -= 1
            job.last_done_at = time.monotonic()
            if ok:
                assert handle is not None
                job.num_bytes += handle.num_bytes
                self.stats.num_writes += 1
            elif job.error is None:
                job.error = f"WRITE failed: {reason}"
        if not ok:
            logger.warning("xid=%s: WRITE to %s failed: %s", job.xid, job.peer.engine_id, reason)
        self._chunk_part_done(job, chunk)
        self._maybe_end(job)

    def _chunk_part_done(self, job: _Job, chunk: _Chunk) -> None:
        """One of the chunk's WRITEs ended (or was skipped); the last one drops the source refs."""
        with self._lock:
            chunk.num_pending -= 1
            last = chunk.num_pending <= 0
        if last and chunk.src:
            src = chunk.src
            self.engine.call(lambda e: e.block_pool.release(reversed(src)))

    def _fail(self, job: _Job, reason: str) -> None:
        with self._lock:
            if job.error is None:
                job.error = reason
        self._maybe_end(job)

    def _maybe_end(self, job: _Job) -> None:
        """Send KVDone / KVFailed once nothing is in flight; then forget the job."""
        with self._lock:
            if job.ended or job.in_flight > 0:
                return
            if job.error is None and (
                job.first_token is None or job.reg is None or job.sent < job.num_blocks
            ):
                return
            job.ended = True
            end = time.monotonic()
        if job.error is None:
            assert job.first_token is not None
            msg: ControlMessage = KVDone(
                job.xid, job.num_prompt_tokens, job.first_token, job.num_cached_tokens
            )
        else:
            msg = KVFailed(job.xid, job.error)
        if job.reg is not None:
            self._notify.submit(self._send, job.peer, msg)
        self._account(job, end)
        xid = job.xid

        def forget(e: object) -> None:
            self._jobs.pop(xid, None)
            self.engine.engine.scheduler.release_held(xid)

        self.engine.call(forget)

    def _account(self, job: _Job, end: float) -> None:
        s = self.stats
        transfer_s = exposed_s = 0.0
        if job.first_post_at is not None and job.last_done_at is not None:
            transfer_s = job.last_done_at - job.first_post_at
            if job.compute_done_at is not None:
                exposed_s = max(0.0, end - job.compute_done_at)
        if job.error is None:
            s.num_done += 1
            s.num_written_blocks += job.num_blocks - (job.reg.first_block if job.reg else 0)
            s.transfer_s += transfer_s
            s.exposed_s += min(exposed_s, transfer_s) if transfer_s else exposed_s
        else:
            s.num_failed += 1
        if self.metrics is not None:
            self.metrics.on_push_sent(job.error is None, transfer_s, exposed_s)
        logger.debug(
            "xid=%s: push %s, %d bytes, transfer %.1f ms, exposed %.1f ms",
            job.xid, "done" if job.error is None else f"failed ({job.error})",
            job.num_bytes, transfer_s * 1e3, exposed_s * 1e3,
        )  # fmt: skip

    def _send(self, peer: PeerHandle, msg: ControlMessage) -> None:
        try:
            self.transport.send_notif(peer, self.codec.encode(msg), msg.xid)
        except Exception as exc:
            logger.warning("xid=%s: cannot tell %s: %s", msg.xid, peer.engine_id, exc)

    # ---- notification pump ----

    def _on_register_notif(self, msg: ControlMessage, sender: str) -> None:
        """Queue it; the next layer of a running forward applies it, or the engine call does."""
        assert isinstance(msg, PushRegister)
        with self._lock:
            self._regs.append((msg, sender))
        self.engine.call(lambda _e: self._drain_registrations())

    def _on_cancel_notif(self, msg: ControlMessage, sender: str) -> None:
        assert isinstance(msg, PushCancel)
        logger.info("xid=%s: decode %s cancelled the push: %s", msg.xid, sender, msg.reason)
        self.engine.call(lambda _e: self.cancel(msg.xid, f"cancelled by decode: {msg.reason}"))

    def _on_alive_notif(self, msg: ControlMessage, sender: str) -> None:
        """Decode still waits to admit ``xid``: keep waiting for its registration."""
        now = time.monotonic()
        with self._lock:
            job = self._jobs.get(msg.xid)
            if job is None or job.reg is not None or job.ended or sender != job.peer.engine_id:
                return
            job.expires_at = max(job.expires_at, now + self.registration_wait_s)
            self.stats.num_alive_received += 1

    def _on_alive_ack_notif(self, msg: ControlMessage, sender: str) -> None:
        """Decode restarted its wait when our heartbeat sent at ``sent_at`` arrived, so
        its deadline is at least ``sent_at`` + its wait: ours may move there."""
        assert isinstance(msg, PushAliveAck)
        with self._lock:
            job = self._jobs.get(msg.xid)
            if job is None or job.reg is None or job.ended or sender != job.peer.engine_id:
                return
            job.expires_at = max(job.expires_at, msg.sent_at + job.reg.wait_s)

    def _tick(self, now: float) -> None:
        beats: list[_Job] = []
        healthy = self.engine.is_healthy
        with self._lock:
            for j in self._jobs.values():
                if not healthy or j.reg is None or j.ended or j.error is not None:
                    continue
                if now - j.alive_sent_at >= j.reg.wait_s / HEARTBEATS_PER_WAIT:
                    j.alive_sent_at = now
                    beats.append(j)
            self.stats.num_alive_sent += len(beats)
            expired = []
            for j in self._jobs.values():
                if not j.ended and not j.expiring and now > j.expires_at:
                    j.expiring = True  # a busy engine thread gets one call, not one per tick
                    expired.append(j.xid)
            stale = [xid for xid, (_, _, until) in self._early.items() if now > until]
            for xid in [x for x, until in self._cancelled.items() if now > until]:
                del self._cancelled[xid]
        for j in beats:
            self._notify.submit(self._send, j.peer, PushAlive(j.xid, now))
        for xid in expired:
            self.engine.call(partial(_run, self._expire, xid))
        for xid in stale:
            self.engine.call(partial(_run, self._drop_early, xid))

    def _expire(self, xid: str) -> None:
        job = self._jobs.get(xid)
        if job is not None:
            with self._lock:
                job.expiring = False
        if job is None or job.ended or time.monotonic() <= job.expires_at:
            return
        what = "no registration from decode" if job.reg is None else "decode's wait ran out"
        logger.warning("xid=%s: %s; dropping the push", xid, what)
        self.cancel(xid, what)

    def _drop_early(self, xid: str) -> None:
        """A registration for a prefill that never came (decode's deadline covers it)."""
        with self._lock:
            early = self._early.pop(xid, None)
        if early is not None:
            logger.warning("xid=%s: registration from %s but no such prefill", xid, early[1])

    def close(self) -> None:
        self._notify.shutdown(wait=False)


# ---------------------------------------------------------------------------- decode side


@dataclass
class PushSpec:
    """Where a decode request's pushed KV comes from (set before it is added)."""

    xid: str
    peer: PeerHandle
    prefill_url: str
    request_id: str | None = None
    """Decode's request for it; a spec whose request is gone before admission is dropped."""


@dataclass
class _Wait:
    spec: PushSpec
    request_id: str
    blocks: list[int]
    """Our own references on the registered blocks (released when P is done with them)."""
    deadline: float
    fell_back: bool = False
    quarantine_until: float = 0.0
    expiring: bool = False


@dataclass
class PushReceiverStats:
    num_received: int = 0
    num_received_blocks: int = 0
    num_fallbacks: int = 0
    num_skipped_blocks: int = 0
    """Blocks not pushed because the local prefix cache had them."""
    num_late: int = 0
    """KVDone/KVFailed that arrived after the deadline had passed."""
    num_alive_sent: int = 0
    num_alive_received: int = 0


class PushReceiver:
    """Decode's half of the push flow (a `KVConnector`; beside pull in `DecodeConnector`)."""

    def __init__(
        self,
        transport: Transport,
        engine: AsyncEngine,
        block_size: int,
        wait_s: float,
        quarantine_s: float,
        metrics: KVFlowMetrics | None = None,
    ) -> None:
        self.transport = transport
        self.engine = engine
        self.block_size = block_size
        self.wait_s = wait_s
        self.quarantine_s = quarantine_s
        self.metrics = metrics
        self.stats = PushReceiverStats()
        self.codec = MessageCodec()
        self._lock = threading.Lock()
        self._specs: dict[str, PushSpec] = {}
        self._spec_alive_at: dict[str, float] = {}  # xid -> last PushAlive to its prefill
        self._waits: dict[str, _Wait] = {}  # by xid
        self._updated: list[Request] = []

    def attach(self, pump: NotificationPump) -> None:
        pump.on(KVDone, self._on_done_notif)
        pump.on(KVFailed, self._on_failed_notif)
        pump.on(PushAlive, self._on_alive_notif)
        pump.every_tick(self._tick)

    def register(self, spec: PushSpec) -> None:
        """From any thread, before the request is added."""
        with self._lock:
            self._specs[spec.xid] = spec
            self._spec_alive_at[spec.xid] = time.monotonic()

    def owns(self, xid: str) -> bool:
        with self._lock:
            return xid in self._specs

    # ---- KVConnector part (engine thread) ----

    def on_scheduled(self, out: SchedulerOutput) -> None:
        for req in out.remote_kv_allocated:
            self._start(req)

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        return None

    def on_step_done(
        self, out: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> None:
        return None

    def take_updated_requests(self) -> list[Request]:
        updated, self._updated = self._updated, []
        return updated

    def has_pending_work(self) -> bool:
        return False

    def _start(self, req: Request) -> None:
        assert req.remote_kv is not None
        xid = req.remote_kv.transfer_id
        with self._lock:
            spec = self._specs.pop(xid, None)
            self._spec_alive_at.pop(xid, None)
        sched = self.engine.engine.scheduler
        if spec is None:
            logger.warning(
                "request %s: no push spec for %s; computing locally", req.request_id, xid
            )
            sched.on_remote_kv_failed(req.request_id)
            return
        first = req.num_cached_tokens // self.block_size
        blocks = list(req.block_ids[first : _num_blocks(req.num_prompt_tokens, self.block_size)])
        self.engine.engine.block_pool.acquire(blocks)
        msg = PushRegister(xid, blocks, first, req.num_prompt_tokens, self.wait_s, time.time())
        wait = _Wait(spec, req.request_id, blocks, time.monotonic() + self.wait_s)
        with self._lock:
            self._waits[xid] = wait
        self.stats.num_skipped_blocks += first
        if self.metrics is not None:
            self.metrics.remote_prefix_hit_tokens.inc(req.num_cached_tokens)
        try:
            self.transport.send_notif(spec.peer, self.codec.encode(msg), xid)
        except Exception as exc:
            logger.warning("xid=%s: cannot register with %s: %s", xid, spec.prefill_url, exc)
            with self._lock:
                self._waits.pop(xid, None)
            self.engine.engine.block_pool.release(reversed(blocks))
            self._fall_back(req.request_id, "register_failed", discard_blocks=False)

    def _fall_back(self, request_id: str, reason: str, *, discard_blocks: bool) -> None:
        self.stats.num_fallbacks += 1
        if self.metrics is not None:
            self.metrics.fallbacks.labels(reason).inc()
        try:
            self.engine.engine.scheduler.on_remote_kv_failed(
                request_id, discard_blocks=discard_blocks
            )
        except KeyError:
            logger.info("request %s: gone before its KV arrived", request_id)

    # ---- messages from prefill (engine thread) ----

    def _on_done(self, msg: KVDone, sender: str) -> None:
        wait = self._pop_wait(msg.xid, sender)
        if wait is None:
            return
        self.engine.engine.block_pool.release(reversed(wait.blocks))
        if wait.fell_back:
            self.stats.num_late += 1
            return
        sched = self.engine.engine.scheduler
        req = sched.get_request(wait.request_id)
        if msg.first_token is None or req is None:
            if req is not None:
                self._fall_back(wait.request_id, "no_first_token", discard_blocks=False)
            return
        try:
            self.engine.engine.resume_with_first_token(wait.request_id, msg.first_token)
        except KeyError:
            return
        req.num_remote_cached_tokens = msg.num_cached_tokens
        self._updated.append(req)
        self.stats.num_received += 1
        self.stats.num_received_blocks += len(wait.blocks)
        if self.metrics is not None:
            self.metrics.received_tokens.inc(msg.num_tokens - req.num_cached_tokens)

    def _on_failed(self, msg: KVFailed, sender: str) -> None:
        wait = self._pop_wait(msg.xid, sender)
        if wait is None:
            return
        self.engine.engine.block_pool.release(reversed(wait.blocks))
        if wait.fell_back:
            self.stats.num_late += 1
            return
        logger.warning("xid=%s: prefill gave up (%s); computing locally", msg.xid, msg.reason)
        self._fall_back(wait.request_id, "sender_failed", discard_blocks=False)

    def _pop_wait(self, xid: str, sender: str) -> _Wait | None:
        with self._lock:
            wait = self._waits.get(xid)
            if wait is None:
                logger.info("xid=%s: message from %s for no pending push", xid, sender)
                return None
            if sender != wait.spec.peer.engine_id:
                logger.warning(
                    "xid=%s: message from %s, expected %s; ignored",
                    xid,
                    sender,
                    wait.spec.peer.engine_id,
                )
                return None
            return self._waits.pop(xid)

    def cancel(self, xid: str, reason: str) -> bool:
        """Stop waiting for `xid` now (compute locally); False if unknown."""
        with self._lock:
            spec = self._specs.pop(xid, None)
            self._spec_alive_at.pop(xid, None)
            wait = self._waits.get(xid)
        if spec is not None:  # not admitted yet: it computes locally when admitted
            return True
        if wait is None or wait.fell_back:
            return False
        self._give_up(wait, reason, "cancelled")
        return True

    def _give_up(self, wait: _Wait, reason: str, label: str) -> None:
        """Stop waiting: compute locally into fresh blocks; quarantine the registered ones."""
        wait.fell_back = True
        wait.quarantine_until = time.monotonic() + self.quarantine_s
        logger.warning("xid=%s: %s; computing the prompt locally", wait.spec.xid, reason)
        self._tell(wait.spec, PushCancel(wait.spec.xid, reason))
        self._fall_back(wait.request_id, label, discard_blocks=True)

    # ---- pump thread ----

    def _on_done_notif(self, msg: ControlMessage, sender: str) -> None:
        assert isinstance(msg, KVDone)
        self.engine.call(lambda _e: self._on_done(msg, sender))

    def _on_failed_notif(self, msg: ControlMessage, sender: str) -> None:
        assert isinstance(msg, KVFailed)
        self.engine.call(lambda _e: self._on_failed(msg, sender))

    def _on_alive_notif(self, msg: ControlMessage, sender: str) -> None:
        """Prefill still holds ``xid``: restart the wait (nothing to do in the engine)."""
        assert isinstance(msg, PushAlive)
        now = time.monotonic()
        with self._lock:
            wait = self._waits.get(msg.xid)
            if wait is None or wait.fell_back or sender != wait.spec.peer.engine_id:
                return  # no answer: prefill's deadline stays where ours was
            wait.deadline = max(wait.deadline, now + self.wait_s)
            self.stats.num_alive_received += 1
            spec = wait.spec
        self._tell(spec, PushAliveAck(msg.xid, msg.sent_at))

    def _tell(self, spec: PushSpec, msg: ControlMessage) -> None:
        """Send `msg` to the push's prefill; a peer we cannot reach is only logged."""
        try:
            self.transport.send_notif(spec.peer, self.codec.encode(msg), msg.xid)
        except Exception as exc:
            logger.info("xid=%s: cannot tell %s: %s", msg.xid, spec.prefill_url, exc)

    def _tick(self, now: float) -> None:
        beats: list[PushSpec] = []
        due: list[_Wait] = []
        with self._lock:
            if self.engine.is_healthy:
                for xid, at in self._spec_alive_at.items():
                    if now - at >= self.wait_s / HEARTBEATS_PER_WAIT:
                        self._spec_alive_at[xid] = now
                        beats.append(self._specs[xid])
                self.stats.num_alive_sent += len(beats)
        if beats:
            self.engine.call(partial(_run, self._drop_orphan_specs, beats))
        with self._lock:
            for wait in self._waits.values():
                limit = wait.quarantine_until if wait.fell_back else wait.deadline
                if now > limit and not wait.expiring:
                    wait.expiring = True
                    due.append(wait)
        for spec in beats:
            self._tell(spec, PushAlive(spec.xid))
        for wait in due:
            self.engine.call(partial(_run, self._expire, wait))

    def _drop_orphan_specs(self, specs: list[PushSpec]) -> None:
        """Forget specs whose request left before admission (aborted), so that their
        heartbeats stop; prefill's own wait for the registration then ends the job."""
        sched = self.engine.engine.scheduler
        gone = [s.xid for s in specs if s.request_id and sched.get_request(s.request_id) is None]
        with self._lock:
            for xid in gone:
                if self._specs.pop(xid, None) is not None:
                    logger.info("xid=%s: decode request gone before admission", xid)
                self._spec_alive_at.pop(xid, None)

    def _expire(self, wait: _Wait) -> None:
        wait.expiring = False
        if not wait.fell_back:
            self._give_up(
                wait, f"no word from prefill for {self.wait_s:g} s", "deadline"
            )
            return
        with self._lock:
            if self._waits.get(wait.spec.xid) is not wait:
                return
            del self._waits[wait.spec.xid]
        logger.warning("xid=%s: no word from prefill; releasing quarantined blocks", wait.spec.xid)
        self.engine.engine.block_pool.release(reversed(wait.blocks))

    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waits)
