"""Running the send machines: feed a job an event, carry its actions out.

`SendRunner` is the part of `kvduplex.kvflow.sender.KVSender` that performs
what a job's `SendMachine` asks, in order, on the engine thread::

    _feed(job, event) ──► job.handle(event) ──► actions, in order:
        PostWrite ──────► transport.transfer(WRITE); its end and settling come back
                          through the flow inbox (between two layers too)
        Tell / Refuse ──► the flow I/O thread (connecting afresh if need be)
        Acquire/ReleaseBlocks ─► the engine's block references
        TearDown ───────► the flow I/O thread
        AbortPrefill / ReleasePrefill ─► results for the engine's next step
        Tombstone / Count / Log ─► recorded here
        Ended ──────────► accounted; the job is forgotten after the actions that follow

Its clock is the sender's (``clock``): it never reads the time itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.scheduler_output import KVSendCancelled
from kvduplex.engine.scheduler_output import KVSendEnded
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.flow_io import Notify
from kvduplex.kvflow.flow_io import TearDownEndpoint
from kvduplex.kvflow.half import FlowHalf
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.inbox import Granularity
from kvduplex.kvflow.machines.actions import AcquireBlocks
from kvduplex.kvflow.machines.actions import Log
from kvduplex.kvflow.machines.actions import ReleaseBlocks
from kvduplex.kvflow.machines.actions import TearDown
from kvduplex.kvflow.machines.actions import Tell
from kvduplex.kvflow.machines.send import AbortPrefill
from kvduplex.kvflow.machines.send import Count
from kvduplex.kvflow.machines.send import Ended
from kvduplex.kvflow.machines.send import PostWrite
from kvduplex.kvflow.machines.send import Refuse
from kvduplex.kvflow.machines.send import ReleasePrefill
from kvduplex.kvflow.machines.send import SendAction
from kvduplex.kvflow.machines.send import SendCounter
from kvduplex.kvflow.machines.send import SendEvent
from kvduplex.kvflow.machines.send import SendMachine
from kvduplex.kvflow.machines.send import Source
from kvduplex.kvflow.machines.send import Tombstone
from kvduplex.kvflow.machines.send import WriteEnded
from kvduplex.kvflow.machines.send import WriteSettled
from kvduplex.kvflow.messages import KVFailed
from kvduplex.kvflow.messages import ids_digest
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.kvflow.send_early import Tombstones
from kvduplex.kvflow.send_stats import KVSenderStats
from kvduplex.kvflow.send_stats import account
from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState

logger = logging.getLogger(__name__)

SendJob = SendMachine
"""One transfer this instance sends: its machine (the adapter keeps no other state)."""


class SendRunner(FlowHalf):
    """Runs send machines' actions; `KVSender` adds the jobs' protocol around them."""

    TELL_FAILURE_LEVEL = logging.WARNING

    def __init__(
        self, transport: Transport, engine: EngineHandle, inbox: FlowInbox, io: FlowIO, *,
        registration_wait_s: float, deadline_s: float, metrics: KVFlowMetrics | None,
        peer_of: Callable[[str], PeerHandle | None] | None, clock: Callable[[], float],
    ) -> None:  # fmt: skip
        """``peer_of(engine_id)`` finds a connected peer (to answer registrations of
        jobs that no longer exist); ``clock()``: monotonic seconds."""
        super().__init__(transport, engine, inbox, io)
        self.block_size = engine.block_size
        self.peer_of = peer_of
        self.registration_wait_s = registration_wait_s
        self.deadline_s = deadline_s
        self.metrics = metrics
        self.clock = clock
        self.stats = KVSenderStats()
        self._jobs: dict[str, SendMachine] = {}
        self._cancelled = Tombstones()
        self._finished: list[KVTransferResult] = []  # prefills' sends that ended

    def _new_job(
        self, xid: str, peer: PeerHandle, ids: Sequence[int], num_blocks: int, source: Source,
        on_end: Callable[[SendJob], None] | None = None,
    ) -> SendMachine:  # fmt: skip
        """A job sending the KV of token `ids` (their count and digest check registrations)."""
        return SendMachine(
            xid, peer, len(ids), ids_digest(ids), num_blocks, self.block_size, self.deadline_s,
            source,
            expires_at=self.clock() + self.registration_wait_s,
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
                account(self.stats, job, self.clock(), self.metrics)
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
                if a.counter is SendCounter.PROMPT_MISMATCHES and self.metrics is not None:
                    flow = "push" if job.source.streams else "return"
                    self.metrics.prompt_mismatches.labels(flow).inc()
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

    def _tombstone_until(self) -> float:
        return self.clock() + 2 * self.registration_wait_s

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
            self._feed(job, WriteSettled(a.write_id, False, 0, self.clock()))
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
        self._feed(job, WriteEnded(write_id, ok, may_still_land, reason, self.clock()))
        if not ok:
            logger.warning("xid=%s: WRITE to %s failed: %s", job.xid, job.peer.engine_id, reason)

    def _forget(self, job: SendMachine) -> None:
        """Drop an ended job (its source's release was among its last actions)."""
        if self._jobs.get(job.xid) is job:
            del self._jobs[job.xid]
        for fn in job.on_end:
            fn(job)


@dataclass(frozen=True)
class _WriteWatch:
    """Hears, through the inbox, how one WRITE of a job ended and when it settled."""

    runner: SendRunner
    job: SendMachine
    write_id: int

    def on_transfer_ended(self, h: TransferHandle) -> None:
        self.runner._on_write_done(self.job, self.write_id, h, h.reason)

    def on_transfer_settled(self, h: TransferHandle) -> None:
        ok = h.state is TransferState.DONE
        settled = WriteSettled(self.write_id, ok, h.num_bytes, self.runner.clock())
        self.runner._feed(self.job, settled)


__all__ = ["SendJob", "SendRunner"]
