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
(messages, ticks, WRITEs that ended or settled), and its base
`kvduplex.kvflow.send_runner.SendRunner` carries the actions out after it.
What it keeps of xids with no job (registrations that came first, cancelled
xids) is `kvduplex.kvflow.send_early`'s. Everything runs on the engine
thread; messages go out from the flow I/O thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence

from kvduplex.engine.handle import EngineHandle
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import NotifyEngine
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.inbox import Granularity
from kvduplex.kvflow.machines.send import HEARTBEATS_PER_WAIT
from kvduplex.kvflow.machines.send import AliveAck
from kvduplex.kvflow.machines.send import Begin
from kvduplex.kvflow.machines.send import Cancelled
from kvduplex.kvflow.machines.send import Chunk
from kvduplex.kvflow.machines.send import Declined
from kvduplex.kvflow.machines.send import HeldSource
from kvduplex.kvflow.machines.send import PrefillProgress
from kvduplex.kvflow.machines.send import Registered
from kvduplex.kvflow.machines.send import Tick
from kvduplex.kvflow.machines.send import Waiting
from kvduplex.kvflow.messages import KVAliveAck
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import KVRegistered
from kvduplex.kvflow.messages import KVWaiting
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.kvflow.send_early import EarlyRegistrations
from kvduplex.kvflow.send_early import Registration
from kvduplex.kvflow.send_runner import SendJob
from kvduplex.kvflow.send_runner import SendRunner
from kvduplex.kvflow.send_stats import KVSenderStats
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)

class KVSender(SendRunner):
    """Runs send machines: streams jobs' KV into peers' registered blocks; the push
    part is a connector (`kvduplex.kvflow.push_prefill.PushSender`). Carrying the
    machines' actions out is `SendRunner`'s."""

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
        super().__init__(
            transport, engine, inbox, io, registration_wait_s=registration_wait_s,
            deadline_s=deadline_s, metrics=metrics, peer_of=peer_of, clock=_monotonic,
        )  # fmt: skip
        self.reconnect = reconnect
        """``reconnect(engine_id)``: connect afresh to a peer whose endpoint was torn down
        (blocking; the flow I/O thread's), so that its KVFailed still reaches it."""
        self._early = EarlyRegistrations()
        self._layer: int | None = None
        """The last layer a running forward computed (None between steps, and before the
        first layer's hook): a registration drained mid-forward writes the layers up to
        it at once, and the step's chunk from the next one."""
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

    # ---- jobs ----

    def offer(
        self,
        xid: str,
        peer: PeerHandle,
        src_blocks: list[int],
        token_ids: Sequence[int],
        on_end: Callable[[SendJob], None] | None = None,
    ) -> SendJob:
        """Return: send computed `src_blocks`, the KV of `token_ids`, once the peer
        registers destinations for those same ids.

        Takes a reference on each block until the job ends. Raises ValueError for
        an xid in progress.
        """
        job = self._new_job(
            xid, peer, token_ids, len(src_blocks), HeldSource(tuple(src_blocks)), on_end
        )
        self._run(job, job.handle(Begin(self.clock())))  # nobody else sees it yet
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
            job, Registered(reg.msg, reg.sender, reg.received_at, self.clock(), progress)
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
        self._early.keep(reg, self.clock() + self.registration_wait_s)
        if peer is not None:
            self._tell(peer, KVRegistered(xid))

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


def _monotonic() -> float:
    """This module's clock, read at each call (a test steps the flows on its own clock by
    replacing this module's ``time``)."""
    return time.monotonic()


__all__ = [
    "HEARTBEATS_PER_WAIT", "Chunk", "KVSender", "KVSenderStats", "Registration", "SendJob",
]  # fmt: skip
