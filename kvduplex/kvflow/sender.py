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

The state of each job and these rules are a pure state machine,
`kvduplex.kvflow.machines.send.SendMachine` (push and return are one machine
with a source); this class is its adapter: it feeds each job's machine the
events of the engine's steps and those that arrive through the flow inbox
(messages, ticks, WRITEs that ended or settled), and carries the actions out
after it. Everything runs on the engine thread; messages go out from the
flow I/O thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import assert_never

from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.scheduler_output import KVSendCancelled
from kvduplex.engine.scheduler_output import KVSendEnded
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import Notify
from kvduplex.kvflow.flow_io import NotifyEngine
from kvduplex.kvflow.flow_io import TearDownEndpoint
from kvduplex.kvflow.half import FlowHalf
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.inbox import Granularity
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import Log
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.send import HEARTBEATS_PER_WAIT
from kvduplex.kvflow.machines.send import AbortPrefill
from kvduplex.kvflow.machines.send import AliveAck
from kvduplex.kvflow.machines.send import Begin
from kvduplex.kvflow.machines.send import Cancelled
from kvduplex.kvflow.machines.send import Chunk
from kvduplex.kvflow.machines.send import Count
from kvduplex.kvflow.machines.send import Declined
from kvduplex.kvflow.machines.send import Ended
from kvduplex.kvflow.machines.send import HeldSource
from kvduplex.kvflow.machines.send import PostWrite
from kvduplex.kvflow.machines.send import PrefillProgress
from kvduplex.kvflow.machines.send import Refuse
from kvduplex.kvflow.machines.send import Registered
from kvduplex.kvflow.machines.send import ReleasePrefill
from kvduplex.kvflow.machines.send import SendAction
from kvduplex.kvflow.machines.send import SendCounter
from kvduplex.kvflow.machines.send import SendEvent
from kvduplex.kvflow.machines.send import SendMachine
from kvduplex.kvflow.machines.send import Source
from kvduplex.kvflow.machines.send import Tick
from kvduplex.kvflow.machines.send import Tombstone
from kvduplex.kvflow.machines.send import Waiting
from kvduplex.kvflow.machines.send import WriteEnded
from kvduplex.kvflow.machines.send import WriteSettled
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.kvflow.messages import KVWaiting
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.kvflow.send_early import EarlyRegistrations
from kvduplex.kvflow.send_early import Registration
from kvduplex.kvflow.send_early import Tombstones
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

logger = logging.getLogger(__name__)

SendJob = SendMachine
"""One transfer this instance sends: its machine (the adapter keeps no other state)."""


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

    def count(self, counter: SendCounter) -> None:
        """Add one to the statistic a machine's `Count` names."""
        match counter:
            case SendCounter.LATE_REGISTRATIONS:
                self.num_late_registrations += 1
            case SendCounter.WRITES:
                self.num_writes += 1
            case SendCounter.TEARDOWNS:
                self.num_teardowns += 1
            case SendCounter.ALIVE_SENT:
                self.num_alive_sent += 1
            case SendCounter.WAITING_RECEIVED:
                self.num_waiting_received += 1
            case _:
                assert_never(counter)


class KVSender(FlowHalf):
    """Runs send machines: streams jobs' KV into peers' registered blocks; the push
    part is a connector (`kvduplex.kvflow.push_prefill.PushSender`)."""

    TELL_FAILURE_LEVEL = logging.WARNING

    def __init__(
        self,
        transport: Transport,
        engine: EngineHandle,
        inbox: FlowInbox,
        io: FlowIO,
        registration_wait_s: float,
        deadline_s: float,
        metrics: KVFlowMetrics | None = None,
        peer_of: Callable[[str], PeerHandle | None] | None = None,
        reconnect: Callable[[str], PeerHandle | None] | None = None,
    ) -> None:
        """``peer_of(engine_id)`` finds a connected peer (to answer registrations of
        jobs that no longer exist)."""
        super().__init__(transport, engine, inbox, io)
        self.block_size = engine.block_size
        self.peer_of = peer_of
        self.reconnect = reconnect
        """``reconnect(engine_id)``: connect afresh to a peer whose endpoint was torn down
        (blocking; the flow I/O thread's), so that its KVFailed still reaches it."""
        self.registration_wait_s = registration_wait_s
        self.deadline_s = deadline_s
        self.metrics = metrics
        self.stats = KVSenderStats()
        self._jobs: dict[str, SendMachine] = {}
        self._early = EarlyRegistrations()
        self._cancelled = Tombstones()
        self._finished: list[KVTransferResult] = []  # prefills' sends that ended
        self._layer: int | None = None
        """The last layer a running forward computed (None between steps): a registration
        drained mid-forward writes the layers up to it at once."""
        # A registration lands between two layers of a forward (its finished layers are
        # written at once); the rest waits for the step's end.
        inbox.on(KVRegister, self._on_register_notif, at=Granularity.LAYER)
        inbox.on(KVCancel, self._on_cancel_notif)
        inbox.on(KVWaiting, self._on_waiting_notif)
        inbox.on(KVAliveAck, self._on_alive_ack_notif)
        inbox.every_tick(self._tick)
        self._init_flow_state()

    def _init_flow_state(self) -> None:
        """Subclasses set up the state of their own kind of job here."""

    # ---- running machines ----

    def _new_job(
        self, xid: str, peer: PeerHandle, num_tokens: int, num_blocks: int, source: Source,
        on_end: Callable[[SendJob], None] | None = None,
    ) -> SendMachine:  # fmt: skip
        return SendMachine(
            xid, peer, num_tokens, num_blocks, self.block_size, self.deadline_s, source,
            expires_at=time.monotonic() + self.registration_wait_s,
            on_end=[on_end] if on_end else [],
        )  # fmt: skip

    def _feed(self, job: SendMachine, event: SendEvent) -> None:
        """Apply ``event`` to ``job``, then carry its actions out."""
        self._run(job, job.handle(event))

    def _run(self, job: SendMachine, actions: list[SendAction]) -> None:
        """Carry out a machine's actions, in order; an ended job is forgotten after them."""
        ended = False
        for a in actions:
            if isinstance(a, Ended):
                self._account(job, time.monotonic())
                ended = True
            else:
                self._do(job, a)
        if ended:
            self._forget(job)

    def _do(self, job: SendMachine, a: SendAction) -> None:
        match a:
            case PostWrite():
                self._post(job, a)
            case Tell():
                self._tell(job.peer, a.msg)
            case Refuse():
                own = a.engine_id == job.peer.engine_id
                self._refuse(job.peer if own else self._peer_of(a.engine_id), job.xid, a.problem)
            case AcquireBlocks():
                self.engine.acquire_blocks(list(a.block_ids))
            case ReleaseBlocks():
                self.engine.release_blocks(list(a.block_ids))
            case TearDown():
                self.io.submit(TearDownEndpoint(job.peer, a.why, job.xid))
            case AbortPrefill() | ReleasePrefill() | Tombstone() | Count() | Log():
                self._note(job, a)
            case Ended():
                pass  # `_run` forgets the job once the rest is carried out
            case _:
                assert_never(a)

    def _note(
        self, job: SendMachine, a: AbortPrefill | ReleasePrefill | Tombstone | Count | Log
    ) -> None:
        """The actions that only record something."""
        match a:
            case AbortPrefill():
                self._finished.append(KVSendCancelled(job.xid))
            case ReleasePrefill():
                # Also ends a prefill that failed before it finished (a WRITE failed, the
                # receiver gave up): nobody would release its blocks otherwise.
                self._finished.append(KVSendEnded(job.xid))
            case Tombstone():
                self._cancelled.add(job.xid, None, self._tombstone_until())
            case Count():
                self.stats.count(a.counter)
            case Log():
                logger.log(a.level, "xid=%s: %s", job.xid, a.text)
            case _:
                assert_never(a)

    def take_finished(self) -> list[KVTransferResult]:
        """What ended prefills' sends since the last call, for the step to apply (a held
        prefill's blocks are freed, a failed one stops)."""
        finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        return bool(self._finished)

    # ---- jobs ----

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
        job = self._new_job(
            xid, peer, num_tokens, len(src_blocks), HeldSource(tuple(src_blocks)), on_end
        )
        self._run(job, job.handle(Begin(time.monotonic())))  # nobody else sees it yet
        try:
            self._add(job)
        except ValueError:
            self.engine.release_blocks(src_blocks)
            raise
        return job

    def _add(self, job: SendJob) -> None:
        """Start ``job``; the registrations that came before it are applied to it (its
        machine refuses those from another engine than its receiver)."""
        xid, receiver = job.xid, job.peer.engine_id
        if xid in self._jobs:
            raise ValueError(f"a transfer with xid {xid!r} is already in progress")
        if self._cancelled.refuses(xid, receiver):
            raise ValueError(f"the transfer {xid!r} was cancelled by its receiver")
        if xid in self._cancelled:
            logger.warning("xid=%s: cancelled before it began, but not by its receiver %s; "
                           "ignored", xid, receiver)  # fmt: skip
        self._jobs[xid] = job
        for reg in self._early.take(xid, first=receiver):
            self._register(reg)

    def _tombstone_until(self) -> float:
        return time.monotonic() + 2 * self.registration_wait_s

    def decline(self, xid: str, reason: str, by: str | None = None) -> bool:
        """The receiver takes nothing of job `xid` (an offer declined): end it quietly.
        ``by``: the engine whose KVDecline says so; only the job's peer may."""
        job = self._jobs.get(xid)
        if job is None or job.reg is not None:
            return False
        if by is not None and by != job.peer.engine_id:
            logger.warning("xid=%s: KVDecline from %s ignored: the offer went to %s",
                           xid, by, job.peer.engine_id)  # fmt: skip
            return False
        self._feed(job, Declined(reason))
        return True

    def cancel(self, xid: str, reason: str, receiver: str | None = None) -> bool:
        """Stop writing `xid`; the receiver hears KVFailed once nothing can land.

        ``receiver``: the engine that asked (its KVCancel; None: this instance); it
        hears KVFailed even if it never registered, so that it may reuse what it
        reserved at once. False if unknown; an unknown xid (or a job not registered
        yet) is remembered for a while, so that a job or registration arriving after
        its cancellation is refused: from ``receiver`` only, when an engine asked
        (another engine's cancel binds neither a job to some other receiver nor that
        receiver's registration), from anyone when this instance cancels.
        """
        job = self._jobs.get(xid)
        dropped: list[Registration] = []
        if job is None or job.reg is None:
            self._cancelled.add(xid, receiver, self._tombstone_until())
            dropped = self._early.drop(xid, receiver)
        if job is None:
            # Nothing was or will be written for it: whoever asked, or registered (and
            # was acknowledged), hears so at once.
            told = {receiver} if receiver else set()
            told.update(reg.sender for reg in dropped)
            for engine_id in sorted(told):
                self.io.submit(NotifyEngine(engine_id, KVFailed(xid, "no such transfer in progress")))
            return False
        self._feed(job, Cancelled(reason, receiver))
        return True

    def _register(self, reg: Registration, layer: int | None = None) -> None:
        """Apply a registration; `layer` is the last computed layer when called mid-forward."""
        job = self._jobs.get(reg.msg.xid)
        if job is None:
            self._register_unknown(reg)
            return
        progress = None
        if job.source.streams:
            req = self.engine.get_request(job.xid)
            if req is not None:
                progress = PrefillProgress(req.num_computed_tokens, list(req.block_ids), layer)
        self._feed(
            job, Registered(reg.msg, reg.sender, reg.received_at, time.monotonic(), progress)
        )

    def _register_unknown(self, reg: Registration) -> None:
        """A registration for no job (yet): keep it for the job and acknowledge it, or,
        for an xid its sender (or this instance) cancelled, refuse it (nothing will be
        written). Another engine's registration of the same xid is kept beside it:
        the job, when it begins, takes its own receiver's."""
        xid, peer = reg.msg.xid, self._peer_of(reg.sender)
        if self._cancelled.refuses(xid, reg.sender):
            self._refuse(peer, xid, "cancelled")
            return
        self._early.keep(reg, time.monotonic() + self.registration_wait_s)
        if peer is not None:
            self._tell(peer, KVRegistered(xid))

    def _tell(self, peer: PeerHandle, msg: ControlMessage) -> None:
        """Send `msg` from the flow I/O thread; to a peer whose endpoint a teardown removed,
        it connects afresh first (a KVFailed must reach its receiver, or its blocks stay
        quarantined)."""
        self.io.submit(Notify(peer, msg, reconnect=True, failure_level=self.TELL_FAILURE_LEVEL))

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
            self._tell(peer, KVFailed(xid, f"registration refused: {problem}"))

    # ---- posting and completion ----

    def _post(self, job: SendMachine, a: PostWrite) -> None:
        try:
            handle = self.transport.transfer(
                TransferOp.WRITE, job.peer, job.xid, list(a.src), list(a.dst),
                layers=None if a.layers is None else list(a.layers), deadline_s=a.deadline_s,
            )  # fmt: skip
        except Exception as exc:  # a bug in the plan, or the transport closed
            logger.exception("xid=%s: WRITE failed to post", job.xid)
            self._on_write_done(job, a.write_id, None, f"post failed: {exc}")
            self._feed(job, WriteSettled(a.write_id, False, 0, time.monotonic()))
            return
        # A WRITE's end lands between two layers too: a failed one stops the next layer's.
        self.inbox.watch(handle, _WriteWatch(self, job, a.write_id), at=Granularity.LAYER)

    def _on_write_done(
        self, job: SendMachine, write_id: int, handle: TransferHandle | None, reason: str | None
    ) -> None:
        """A WRITE ended: a failure stops the job's further WRITEs at once. Its data may
        still land, so the job counts it in flight until it is settled."""
        ok = handle is not None and handle.state is TransferState.DONE
        may_still_land = handle is not None and handle.may_still_land
        self._feed(job, WriteEnded(write_id, ok, may_still_land, reason, time.monotonic()))
        if not ok:
            logger.warning("xid=%s: WRITE to %s failed: %s", job.xid, job.peer.engine_id, reason)

    def _forget(self, job: SendMachine) -> None:
        """Drop an ended job (its source's release was among its last actions)."""
        if self._jobs.get(job.xid) is job:
            del self._jobs[job.xid]
        for fn in job.on_end:
            fn(job)

    def _account(self, job: SendMachine, end: float) -> None:
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
        if self.metrics is not None and job.source.streams:
            self.metrics.on_push_sent(job.error is None, transfer_s, exposed_s)
        logger.debug(
            "xid=%s: send %s, %d bytes, transfer %.1f ms, exposed %.1f ms",
            job.xid, "done" if job.error is None else f"failed ({job.error})",
            job.num_bytes, transfer_s * 1e3, exposed_s * 1e3,
        )  # fmt: skip

    # ---- inbox (engine thread) ----

    def _on_register_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        """Between steps, or between two layers of a running forward (``_layer``)."""
        assert isinstance(msg, KVRegister)
        self._register(Registration(msg, sender, received_at), self._layer)

    def _on_cancel_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        """A KVCancel from ``sender`` (the agent that delivered it). Only a job's receiver
        (its peer) may cancel it; anyone else's is ignored. Before the job began, the
        cancel binds only ``sender``: its own registration, and a job that goes to it."""
        assert isinstance(msg, KVCancel)
        job = self._jobs.get(msg.xid)
        if job is not None and job.peer.engine_id != sender:
            logger.warning("xid=%s: KVCancel from %s ignored: the transfer's receiver is %s",
                           msg.xid, sender, job.peer.engine_id)  # fmt: skip
            return
        logger.info("xid=%s: receiver %s cancelled: %s", msg.xid, sender, msg.reason)
        self.cancel(msg.xid, f"cancelled by the receiver: {msg.reason}", sender)

    def _on_waiting_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        """The receiver still means to register ``xid``: keep waiting for it."""
        job = self._jobs.get(msg.xid)
        if job is not None:
            self._feed(job, Waiting(sender, self.registration_wait_s, received_at))

    def _on_alive_ack_notif(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        """The receiver restarted its wait when our heartbeat sent at ``sent_at`` arrived:
        our deadline may move on (``sent_at`` is our own clock echoed back)."""
        assert isinstance(msg, KVAliveAck)
        job = self._jobs.get(msg.xid)
        if job is not None:
            self._feed(job, AliveAck(sender, msg.sent_at, received_at))

    def _tick(self, now: float) -> None:
        healthy = self.engine.is_healthy
        for job in list(self._jobs.values()):
            self._feed(job, Tick(now, healthy))
        for reg in self._early.expire(now):
            self._drop_early(reg)
        self._cancelled.expire(now)

    def _drop_early(self, reg: Registration) -> None:
        """A registration for a job that never came: refused (nothing will be written),
        and its xid remembered a while against its sender, so that a delayed copy of it
        is refused too and a job starting late under it towards that sender does not
        write into blocks the sender reused."""
        xid, sender = reg.msg.xid, reg.sender
        self._cancelled.add(xid, sender, self._tombstone_until())
        # It was acknowledged: refuse it now, or its receiver waits out its deadline.
        logger.warning("xid=%s: registration from %s but no such transfer", xid, sender)
        self.io.submit(NotifyEngine(sender, KVFailed(xid, "registration refused: no such transfer")))

    def num_jobs(self) -> int:
        return len(self._jobs)

    def tables(self) -> dict[str, int]:
        """Sizes of the sender's tables (introspection): jobs, their WRITEs that may still
        land, registrations for no job yet, and cancelled xids remembered for a while."""
        return {
            "send_jobs": len(self._jobs),
            "send_writes_unsettled": sum(j.in_flight for j in list(self._jobs.values())),
            "send_early_registrations": len(self._early),
            "send_cancelled_tombstones": len(self._cancelled),
        }

    def close(self) -> None:
        self.io.close()


@dataclass(frozen=True)
class _WriteWatch:
    """Hears, through the inbox, how one WRITE of a job ended and when it settled."""

    sender: KVSender
    job: SendMachine
    write_id: int

    def on_transfer_ended(self, h: TransferHandle) -> None:
        self.sender._on_write_done(self.job, self.write_id, h, h.reason)

    def on_transfer_settled(self, h: TransferHandle) -> None:
        ok = h.state is TransferState.DONE
        self.sender._feed(self.job, WriteSettled(self.write_id, ok, h.num_bytes, time.monotonic()))


__all__ = [
    "HEARTBEATS_PER_WAIT", "Chunk", "KVSender", "KVSenderStats", "Registration", "SendJob",
]  # fmt: skip
