"""The sending half of every KV flow: WRITE blocks into blocks a peer registered.

A *job* is one transfer ``xid`` to one peer, over a run of ``num_blocks``
blocks. Its source is either

* a prefill request (push): its blocks fill as the prefill computes, and
  `kvduplex.kvflow.push_prefill.PushSender` (this class plus the engine's
  step hooks) WRITEs each layer of a chunk's finished blocks while the next
  layer runs; or
* blocks already computed (return): the job holds its own references on them
  and WRITEs them all at once when the registration arrives (`offer`).

::

    expect()/offer()     registration (KVRegister: dst for blocks first_block..)
         │                   │
         ▼                   ▼
    [ 0 .. first_block │ first_block ......................... num_blocks )
       peer has them      WRITE as computed (push) or at once (return)
                          every WRITE ended ──► KVDone{first_token} / KVFailed

Failure rules:

* Deadlines bound silence, not queueing. While the job is registered, the
  sender sends `KVAlive` every third of the receiver's wait; the receiver's
  `KVAliveAck` moves the sender's own deadline on by the wait from when the
  heartbeat left, so the sender never WRITEs after the receiver's deadline (a
  receiver that gave up does not answer). Before registration, the receiver's
  `KVWaiting` keeps the job. Only a healthy engine sends heartbeats.
* `KVFailed` goes out only once none of the job's WRITEs can land any more
  (each transfer handle is *settled*, not just failed: a deadline ends the
  wait, not the WRITE). A failed WRITE still unsettled ``deadline_s`` later
  has its peer's endpoint torn down, which settles it.
* Source blocks of each WRITE are referenced until it is settled, so a
  preemption or an abort cannot hand them to another request under a WRITE
  that may still be reading them.
* A job whose registration never comes is dropped after ``registration_wait_s``.
* Each registration received is acknowledged (`KVRegistered`, again for a
  duplicate: the receiver re-sends until it hears one). One that can never be
  served (another engine's, sizes that do not match, an xid cancelled or a job
  already ended) is refused with `KVFailed` to its sender: nothing was or will
  be written into those blocks, so the receiver falls back and reuses them.
* Deadlines travel as durations: a registration's ``time_left_s`` is counted
  from when it arrived here, on this host's monotonic clock.

Threads: jobs are created, registered and ended on the engine thread; the
transport's completion callbacks and the notification pump only take
``_lock`` (which guards ``_jobs`` and every job's counters) or queue an engine
call. (The file is longer than most: the engine-thread, completion and pump
parts of one job state machine share that lock and its invariants, so they
stay together.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from functools import partial

from kvduplex.engine.connector import EngineHandle
from kvduplex.engine.request import Request
from kvduplex.kvflow.half import FlowHalf
from kvduplex.kvflow.messages import KVAlive
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVDone
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.kvflow.messages import KVWaiting
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.notify import Handler
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

logger = logging.getLogger(__name__)

HEARTBEATS_PER_WAIT = 3
"""`KVAlive` messages per wait period: a lost one or two do not end the wait."""


@dataclass(frozen=True)
class Registration:
    """A received `KVRegister`, with who sent it and when it arrived (monotonic)."""

    msg: KVRegister
    sender: str
    received_at: float


@dataclass
class Chunk:
    """Blocks one step (or one catch-up) WRITEs for one job, layer by layer or at once."""

    src: list[int]
    dst: list[int]
    hi: int
    """Job blocks [0, hi) are sent once this chunk's layers are posted."""
    num_pending: int = 0
    """WRITEs of this chunk not ended yet; the last one drops the source references."""
    from_layer: int = 0
    """First layer the layer hook still WRITEs (a registration mid-forward did the rest)."""


@dataclass
class SendJob:
    """One transfer this instance sends."""

    xid: str
    peer: PeerHandle
    num_tokens: int
    num_blocks: int
    expires_at: float
    """Registration deadline (until registered; `KVWaiting` moves it on), then the
    receiver's own deadline (moved on by each acknowledged heartbeat)."""
    src_blocks: list[int] | None = None
    """Computed source blocks the job references (return); None: the request ``xid``'s
    blocks, as its prefill computes them (push)."""
    needs_first_token: bool = False
    """Push: KVDone carries the prefill's first token, so the job ends after it."""
    reg: KVRegister | None = None
    alive_sent_at: float = 0.0
    expiring: bool = False
    """An `_expire` call is queued for the engine thread (one at a time)."""
    sent: int = 0
    """Blocks [0, sent) are written (or the receiver has them)."""
    in_flight: int = 0
    error: str | None = None
    first_token: int | None = None
    num_cached_tokens: int = 0
    """Prompt tokens the prefill served from its own prefix cache."""
    compute_done_at: float | None = None
    first_post_at: float | None = None
    last_done_at: float | None = None
    ended: bool = False
    declined: bool = False
    """The receiver took nothing (a return offer it did not need or had no room for)."""
    num_bytes: int = 0
    unsettled_since: float | None = None
    """When a WRITE of the job first failed while its data could still land."""
    confirm_end: bool = False
    """The receiver cancelled: it hears how the job ended even if it never registered."""
    torn_down: bool = False
    """The peer's endpoint was torn down to settle the job's WRITEs."""
    on_end: list[Callable[[SendJob], None]] = field(default_factory=list)
    """Engine-thread callbacks once the job ended (done or failed)."""


@dataclass
class KVSenderStats:
    """This instance's sent jobs since it started (served as push stats)."""

    num_done: int = 0
    num_failed: int = 0
    num_written_blocks: int = 0
    num_writes: int = 0
    num_bytes: int = 0
    num_late_registrations: int = 0
    """Registrations that found blocks already computed (written at once)."""
    transfer_s: float = 0.0
    exposed_s: float = 0.0
    """Part of ``transfer_s`` after the job's compute ended (not hidden)."""
    num_alive_sent: int = 0
    num_waiting_received: int = 0
    num_teardowns: int = 0
    """Peer endpoints torn down because a failed WRITE would not settle."""
    num_registrations_refused: int = 0
    """Registrations answered with KVFailed (wrong engine, sizes, cancelled, ended)."""


class KVSender(FlowHalf):
    """Streams jobs' KV into peers' registered blocks; the push part is a connector."""

    TELL_FAILURE_LEVEL = logging.WARNING

    def __init__(
        self,
        transport: Transport,
        engine: EngineHandle,
        registration_wait_s: float,
        deadline_s: float,
        metrics: KVFlowMetrics | None = None,
        peer_of: Callable[[str], PeerHandle | None] | None = None,
        reconnect: Callable[[str], PeerHandle | None] | None = None,
    ) -> None:
        """``peer_of(engine_id)`` finds a connected peer (to answer registrations of
        jobs that no longer exist)."""
        super().__init__(transport, engine)
        self.block_size = engine.block_size
        self.peer_of = peer_of
        self.reconnect = reconnect
        """``reconnect(engine_id)``: connect afresh to a peer whose endpoint was torn down
        (blocking; only on the notify thread), so that its KVFailed still reaches it."""
        self.registration_wait_s = registration_wait_s
        self.deadline_s = deadline_s
        self.metrics = metrics
        self.stats = KVSenderStats()
        self._jobs: dict[str, SendJob] = {}
        self._early: dict[str, tuple[Registration, float]] = {}  # xid -> (reg, kept until)
        self._cancelled: dict[str, float] = {}  # xid -> until when it is refused
        self._regs: list[Registration] = []  # received, not applied yet
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-send-notify")
        self._init_flow_state()

    def _init_flow_state(self) -> None:
        """Subclasses set up the state of their own kind of job here."""

    def _notif_handlers(self) -> dict[type[ControlMessage], Handler]:
        return {
            KVRegister: self._on_register_notif,
            KVCancel: self._on_cancel_notif,
            KVWaiting: self._on_waiting_notif,
            KVAliveAck: self._on_alive_ack_notif,
        }

    # ---- engine thread: jobs ----

    def offer(
        self,
        xid: str,
        peer: PeerHandle,
        src_blocks: list[int],
        num_tokens: int,
        on_end: Callable[[SendJob], None] | None = None,
    ) -> SendJob:
        """Return: send computed `src_blocks` once the peer registers destinations.

        Takes a reference on each block until the job ends. Raises ValueError for
        an xid in progress.
        """
        job = SendJob(
            xid, peer, num_tokens, len(src_blocks),
            expires_at=time.monotonic() + self.registration_wait_s,
            src_blocks=list(src_blocks), on_end=[on_end] if on_end else [],
        )  # fmt: skip
        self.engine.acquire_blocks(job.src_blocks or [])
        job.compute_done_at = time.monotonic()
        try:
            self._add(job)
        except ValueError:
            self.engine.release_blocks(job.src_blocks or [])
            raise
        return job

    def _add(self, job: SendJob) -> None:
        with self._lock:
            if job.xid in self._jobs:
                raise ValueError(f"a transfer with xid {job.xid!r} is already in progress")
            if job.xid in self._cancelled:
                raise ValueError(f"the transfer {job.xid!r} was cancelled by its receiver")
            self._jobs[job.xid] = job
            early = self._early.pop(job.xid, None)
        if early is not None:
            self._register(early[0])

    def decline(self, xid: str, reason: str) -> bool:
        """The receiver takes nothing of job `xid` (an offer declined): end it quietly."""
        job = self._jobs.get(xid)
        if job is None or job.reg is not None:
            return False
        job.declined = True
        self._fail(job, reason, notify=False)
        return True

    def cancel(self, xid: str, reason: str, receiver: str | None = None) -> bool:
        """Stop writing `xid`; the receiver hears KVFailed once nothing can land.

        ``receiver``: the engine that asked (its KVCancel); it hears KVFailed even if
        it never registered, so that it may reuse what it reserved at once. False if
        unknown; an unknown xid (or a job not registered yet) is remembered for a
        while, so that a job or registration arriving after its cancellation is
        refused.
        """
        job = self._jobs.get(xid)
        early = None
        if job is None or job.reg is None:
            with self._lock:
                self._cancelled[xid] = time.monotonic() + 2 * self.registration_wait_s
                early = self._early.pop(xid, None)
        if job is None:
            # Nothing was or will be written for it: whoever asked, or registered (and
            # was acknowledged), hears so at once.
            told = {receiver} if receiver else set()
            if early is not None:
                told.add(early[0].sender)
            for engine_id in told:
                self._notify.submit(
                    self._tell_engine, engine_id, KVFailed(xid, "no such transfer in progress")
                )
            return False
        if receiver is not None and receiver == job.peer.engine_id:
            job.confirm_end = True
        if job.src_blocks is None:
            req = self.engine.get_request(xid)
            if req is not None and not req.is_finished:
                self.engine.abort(xid)
        self._fail(job, reason)
        return True

    def _register(self, reg: Registration, layer: int | None = None) -> None:
        """Apply a registration; `layer` is the last computed layer when called mid-forward."""
        msg, sender = reg.msg, reg.sender
        job = self._jobs.get(msg.xid)
        if job is None:
            self._register_unknown(reg)
            return
        if sender != job.peer.engine_id:
            wrong = f"sent by {sender}, but the transfer goes to {job.peer.engine_id}"
            # Refused to its sender; the job waits on for its own receiver's.
            self._refuse(self._peer_of(sender), msg.xid, wrong)
            return
        if job.reg is not None:
            if not job.ended:
                logger.info("xid=%s: duplicate registration; acknowledged again", msg.xid)
                self._notify.submit(self._tell, job.peer, KVRegistered(msg.xid))
            return
        if job.ended:
            self._refuse(job.peer, msg.xid, f"the transfer already ended: {job.error}")
            return
        problem = self._check_registration(job, msg)
        now = time.monotonic()
        left = min(msg.wait_s, msg.time_left_s) - (now - reg.received_at)
        if problem is None and not left > 0:  # NaN too
            problem = "it arrived after the receiver stopped waiting"
        if problem is not None:
            self._refuse(job.peer, msg.xid, problem)
            self._fail(job, f"registration refused: {problem}")
            return
        with self._lock:
            job.reg = msg
            job.expires_at = now + left
            job.alive_sent_at = now
            job.sent = msg.first_block
        self._notify.submit(self._tell, job.peer, KVRegistered(msg.xid))
        if job.src_blocks is not None:
            self._catch_up(job, None, job.num_blocks)
            self._maybe_end(job)
            return
        self._register_request_job(job, layer)
        self._maybe_end(job)

    def _register_request_job(self, job: SendJob, layer: int | None) -> None:
        """A registration for a job whose source is a request: WRITE what it computed."""
        req = self.engine.get_request(job.xid)
        if req is not None:
            self._catch_up(job, req, self._blocks_done(job, req.num_computed_tokens))

    def _register_unknown(self, reg: Registration) -> None:
        """A registration for no job (yet): keep it for the job and acknowledge it, or,
        for an xid cancelled before it began, refuse it (nothing will be written)."""
        xid, peer = reg.msg.xid, self._peer_of(reg.sender)
        if xid in self._cancelled:
            self._refuse(peer, xid, "cancelled")
            return
        with self._lock:
            self._early[xid] = (reg, time.monotonic() + self.registration_wait_s)
        if peer is not None:
            self._notify.submit(self._tell, peer, KVRegistered(xid))

    def _tell(self, peer: PeerHandle, msg: ControlMessage) -> None:
        """Notify thread: send `msg`; to a peer whose endpoint a teardown removed, connect
        afresh first (a KVFailed must reach its receiver, or its blocks stay quarantined)."""
        try:
            self.transport.send_notif(peer, self.codec.encode(msg), msg.xid)
            return
        except Exception as exc:
            problem: Exception = exc
        fresh = self.reconnect(peer.engine_id) if self.reconnect is not None else None
        if fresh is not None:
            try:
                self.transport.send_notif(fresh, self.codec.encode(msg), msg.xid)
                return
            except Exception as exc:
                problem = exc
        logger.log(self.TELL_FAILURE_LEVEL, "xid=%s: cannot tell %s: %s",
                   msg.xid, peer.engine_id, problem)  # fmt: skip

    def _tell_engine(self, engine_id: str, msg: ControlMessage) -> None:
        """Notify thread: `_tell` the peer with this engine id, connecting if need be."""
        peer = self._peer_of(engine_id)
        if peer is None and self.reconnect is not None:
            peer = self.reconnect(engine_id)
        if peer is None:
            logger.info("xid=%s: cannot tell %s: not connected", msg.xid, engine_id)
            return
        self._tell(peer, msg)

    def _peer_of(self, engine_id: str) -> PeerHandle | None:
        return self.peer_of(engine_id) if self.peer_of is not None else None

    def _refuse(self, peer: PeerHandle | None, xid: str, problem: str) -> None:
        """Tell the sender of a registration that nothing will be written into its blocks."""
        self.stats.num_registrations_refused += 1
        logger.warning(
            "xid=%s: registration from %s refused: %s",
            xid, peer.engine_id if peer else "an unknown peer", problem,
        )  # fmt: skip
        if peer is not None:
            self._notify.submit(self._tell, peer, KVFailed(xid, f"registration refused: {problem}"))

    def _blocks_done(self, job: SendJob, num_computed: int) -> int:
        """Job blocks whose every token is computed once `num_computed` tokens are."""
        if num_computed >= job.num_tokens:
            return job.num_blocks
        return num_computed // self.block_size

    def _catch_up(self, job: SendJob, req: Request | None, hi: int) -> None:
        """WRITE blocks [sent, hi), all layers, in one transfer."""
        if hi > job.sent:
            if job.src_blocks is None:
                self.stats.num_late_registrations += 1
            chunk = self._plan(job, req, hi)
            chunk.num_pending = 1
            self._post(job, chunk, layers=None)
            job.sent = hi

    def _check_registration(self, job: SendJob, msg: KVRegister) -> str | None:
        """Why the job's own receiver's registration cannot be served, or None."""
        if msg.num_tokens != job.num_tokens:
            return f"the receiver has {msg.num_tokens} tokens, the sender {job.num_tokens}"
        if not 0 <= msg.first_block <= job.num_blocks or (
            msg.first_block + len(msg.block_ids) != job.num_blocks
        ):
            return (
                f"the receiver registered blocks {msg.first_block}..+{len(msg.block_ids)} "
                f"of a {job.num_blocks}-block transfer"
            )
        return None

    def _plan(self, job: SendJob, req: Request | None, hi: int) -> Chunk:
        assert job.reg is not None
        lo, first = job.sent, job.reg.first_block
        if job.src_blocks is not None:
            src = job.src_blocks[lo:hi]
        else:
            assert req is not None
            src = list(req.block_ids[lo:hi])
        self.engine.acquire_blocks(src)
        return Chunk(src=src, dst=list(job.reg.block_ids[lo - first : hi - first]), hi=hi)

    def _drain_registrations(self, layer: int | None = None) -> None:
        """Apply registrations the pump received (between steps, or between two layers)."""
        with self._lock:
            regs, self._regs = self._regs, []
        for reg in regs:
            self._register(reg, layer)

    # ---- posting and completion (any thread after posting) ----

    def _post(self, job: SendJob, chunk: Chunk, layers: list[int] | None) -> None:
        if job.error is None and time.monotonic() >= job.expires_at:
            self._fail(job, "the receiver's wait ran out")  # never WRITE after its deadline
        if job.error is not None:
            self._chunk_part_done(job, chunk)
            return
        with self._lock:
            job.in_flight += 1
            if job.first_post_at is None:
                job.first_post_at = time.monotonic()
            deadline = min(self.deadline_s, max(0.001, job.expires_at - time.monotonic()))
        try:
            handle = self.transport.transfer(
                TransferOp.WRITE, job.peer, job.xid, chunk.src, chunk.dst,
                layers=layers, deadline_s=deadline,
            )  # fmt: skip
        except Exception as exc:  # a bug in the plan, or the transport closed
            logger.exception("xid=%s: WRITE failed to post", job.xid)
            self._on_write_done(job, None, f"post failed: {exc}")
            self._on_write_settled(job, chunk, None)
            return
        handle.add_done_callback(lambda h: self._on_write_done(job, h, h.reason))
        handle.add_settled_callback(lambda h: self._on_write_settled(job, chunk, h))

    def _on_write_done(self, job: SendJob, handle: TransferHandle | None, reason: str | None) -> None:
        """A WRITE ended: a failure stops the job's further WRITEs at once. Its data may
        still land, so the job counts it in flight until it is settled."""
        if handle is not None and handle.state is TransferState.DONE:
            return
        with self._lock:
            if job.error is None:
                job.error = f"WRITE failed: {reason}"
            if handle is not None and handle.may_still_land:
                job.unsettled_since = job.unsettled_since or time.monotonic()
        logger.warning("xid=%s: WRITE to %s failed: %s", job.xid, job.peer.engine_id, reason)

    def _on_write_settled(
        self, job: SendJob, chunk: Chunk, handle: TransferHandle | None
    ) -> None:
        """Nothing of this WRITE can land any more: drop its source references; the
        job's last one lets it end (KVFailed only now: the receiver may reuse its blocks)."""
        with self._lock:
            job.in_flight -= 1
            job.last_done_at = time.monotonic()
            if handle is not None and handle.state is TransferState.DONE:
                job.num_bytes += handle.num_bytes
                self.stats.num_writes += 1
        self._chunk_part_done(job, chunk)
        self._maybe_end(job)

    def _chunk_part_done(self, job: SendJob, chunk: Chunk) -> None:
        """One of the chunk's WRITEs ended (or was skipped); the last one drops the source refs."""
        with self._lock:
            chunk.num_pending -= 1
            last = chunk.num_pending <= 0
        if last and chunk.src:
            src = chunk.src
            self.engine.call(lambda: self.engine.release_blocks(src))

    def _fail(self, job: SendJob, reason: str, *, notify: bool = True) -> None:
        with self._lock:
            if job.error is None:
                job.error = reason
        self._maybe_end(job, notify=notify)

    def _maybe_end(self, job: SendJob, *, notify: bool = True) -> None:
        """Send KVDone / KVFailed once nothing is in flight; then forget the job."""
        with self._lock:
            if job.ended or job.in_flight > 0:
                return
            if job.error is None and (
                job.reg is None
                or job.sent < job.num_blocks
                or (job.needs_first_token and job.first_token is None)
            ):
                return
            job.ended = True
            end = time.monotonic()
        if job.error is None:
            msg: ControlMessage = KVDone(
                job.xid, job.num_tokens, job.first_token, job.num_cached_tokens
            )
        else:
            msg = KVFailed(job.xid, job.error, job.first_token)
        if (job.reg is not None or job.confirm_end) and notify:
            self._notify.submit(self._tell, job.peer, msg)
        self._account(job, end)
        self.engine.call(lambda: self._forget(job))

    def _forget(self, job: SendJob) -> None:
        """Engine thread: drop an ended job and the blocks it kept."""
        with self._lock:
            if self._jobs.get(job.xid) is job:
                del self._jobs[job.xid]
        if job.src_blocks is not None:
            self.engine.release_blocks(job.src_blocks)
        elif not self.engine.release_held(job.xid):
            # Failed before its prefill finished (a WRITE failed, the receiver gave up):
            # nobody would release the blocks it holds when done, and its KV goes nowhere.
            req = self.engine.get_request(job.xid)
            if req is not None and not req.is_finished:
                self.engine.abort(job.xid)
        for fn in job.on_end:
            fn(job)

    def _account(self, job: SendJob, end: float) -> None:
        s = self.stats
        transfer_s = exposed_s = 0.0
        if job.first_post_at is not None and job.last_done_at is not None:
            transfer_s = job.last_done_at - job.first_post_at
            if job.compute_done_at is not None:
                exposed_s = max(0.0, end - max(job.compute_done_at, job.first_post_at))
        if job.error is None:
            s.num_done += 1
            s.num_written_blocks += job.num_blocks - (job.reg.first_block if job.reg else 0)
            s.num_bytes += job.num_bytes
            s.transfer_s += transfer_s
            s.exposed_s += min(exposed_s, transfer_s) if transfer_s else exposed_s
        else:
            s.num_failed += 1
        if self.metrics is not None and job.src_blocks is None:
            self.metrics.on_push_sent(job.error is None, transfer_s, exposed_s)
        logger.debug(
            "xid=%s: send %s, %d bytes, transfer %.1f ms, exposed %.1f ms",
            job.xid, "done" if job.error is None else f"failed ({job.error})",
            job.num_bytes, transfer_s * 1e3, exposed_s * 1e3,
        )  # fmt: skip

    # ---- notification pump ----

    def _on_register_notif(self, msg: ControlMessage, sender: str) -> None:
        """Queue it; the next layer of a running forward applies it, or the engine call does."""
        assert isinstance(msg, KVRegister)
        with self._lock:
            self._regs.append(Registration(msg, sender, time.monotonic()))
        self.engine.call(self._drain_registrations)

    def _on_cancel_notif(self, msg: ControlMessage, sender: str) -> None:
        assert isinstance(msg, KVCancel)
        logger.info("xid=%s: receiver %s cancelled: %s", msg.xid, sender, msg.reason)
        with self._lock:  # no WRITE is posted from now on (the engine call comes later)
            job = self._jobs.get(msg.xid)
            if job is not None and sender == job.peer.engine_id and job.error is None:
                job.error = f"cancelled by the receiver: {msg.reason}"
        self.engine.call(
            lambda: self.cancel(msg.xid, f"cancelled by the receiver: {msg.reason}", sender)
        )

    def _on_waiting_notif(self, msg: ControlMessage, sender: str) -> None:
        """The receiver still means to register ``xid``: keep waiting for it."""
        now = time.monotonic()
        with self._lock:
            job = self._jobs.get(msg.xid)
            if job is None or job.reg is not None or job.ended or sender != job.peer.engine_id:
                return
            job.expires_at = max(job.expires_at, now + self.registration_wait_s)
            self.stats.num_waiting_received += 1

    def _on_alive_ack_notif(self, msg: ControlMessage, sender: str) -> None:
        """The receiver restarted its wait when our heartbeat sent at ``sent_at`` arrived,
        so its deadline is at least ``sent_at`` + its wait: ours may move there.
        (``sent_at`` is our own monotonic clock echoed back; never trusted past now.)"""
        assert isinstance(msg, KVAliveAck)
        sent_at = min(msg.sent_at, time.monotonic())
        with self._lock:
            job = self._jobs.get(msg.xid)
            if job is None or job.reg is None or job.ended or sender != job.peer.engine_id:
                return
            job.expires_at = max(job.expires_at, sent_at + job.reg.wait_s)

    def _tick(self, now: float) -> None:
        beats: list[SendJob] = []
        healthy = self.engine.is_healthy
        with self._lock:
            jobs = list(self._jobs.values())
            stuck = [
                j for j in jobs
                if j.unsettled_since is not None and not j.torn_down and j.in_flight > 0
                and now - j.unsettled_since > self.deadline_s
            ]  # fmt: skip
            for j in stuck:
                j.torn_down = True
            self.stats.num_teardowns += len(stuck)
            for j in jobs:
                if not healthy or j.reg is None or j.ended or j.error is not None:
                    continue
                if now - j.alive_sent_at >= j.reg.wait_s / HEARTBEATS_PER_WAIT:
                    j.alive_sent_at = now
                    beats.append(j)
            self.stats.num_alive_sent += len(beats)
            expired = []
            for j in jobs:
                if not j.ended and not j.expiring and now > j.expires_at:
                    j.expiring = True  # a busy engine thread gets one call, not one per tick
                    expired.append(j.xid)
            stale = [xid for xid, (_, until) in self._early.items() if now > until]
            for xid in [x for x, until in self._cancelled.items() if now > until]:
                del self._cancelled[xid]
        for j in stuck:
            # NIXL has not let go of a failed WRITE: tearing the endpoint down is what
            # guarantees that it cannot land; the next transfer to the peer reconnects.
            logger.warning("xid=%s: a failed WRITE to %s is still unsettled after %g s; "
                           "tearing its endpoint down", j.xid, j.peer.engine_id, self.deadline_s)
            self.transport.disconnect(j.peer)
        for j in beats:
            self._notify.submit(self._tell, j.peer, KVAlive(j.xid, now))
        for xid in expired:
            self.engine.call(partial(self._expire, xid))
        for xid in stale:
            self.engine.call(partial(self._drop_early, xid))

    def _expire(self, xid: str) -> None:
        job = self._jobs.get(xid)
        if job is not None:
            with self._lock:
                job.expiring = False
        if job is None or job.ended or time.monotonic() <= job.expires_at:
            return
        what = (
            "no registration from the receiver"
            if job.reg is None
            else "the receiver's wait ran out"
        )
        logger.warning("xid=%s: %s; dropping the transfer", xid, what)
        self.cancel(xid, what)

    def _drop_early(self, xid: str) -> None:
        """A registration for a job that never came: refused (nothing will be written)."""
        with self._lock:
            early = self._early.pop(xid, None)
        if early is not None:
            # It was acknowledged: refuse it now, or its receiver waits out its deadline.
            sender = early[0].sender
            logger.warning("xid=%s: registration from %s but no such transfer", xid, sender)
            self._notify.submit(
                self._tell_engine, sender, KVFailed(xid, "registration refused: no such transfer")
            )

    def num_jobs(self) -> int:
        with self._lock:
            return len(self._jobs)

    def tables(self) -> dict[str, int]:
        """Sizes of the sender's tables (introspection): jobs, their WRITEs that may still
        land, registrations for no job yet, and cancelled xids remembered for a while."""
        with self._lock:
            return {
                "send_jobs": len(self._jobs),
                "send_writes_unsettled": sum(j.in_flight for j in self._jobs.values()),
                "send_early_registrations": len(self._early) + len(self._regs),
                "send_cancelled_tombstones": len(self._cancelled),
            }

    def close(self) -> None:
        self._notify.shutdown(wait=False)


__all__ = ["HEARTBEATS_PER_WAIT", "Chunk", "KVSender", "KVSenderStats", "Registration", "SendJob"]
