"""Prefill's side of the layer-wise push: stream a prefill's KV into decode's blocks.

::

    router ──► P /internal/push/prefill {xid, prompt, decode_url}     (at the same time)
    router ──► D /v1/... {kv_transfer_params: {mode: push, xid, prefill_url}}
    D: admit, allocate the blocks its prefix cache lacks ──KVRegister──► P
    P: after each layer of each chunk, WRITE that layer's finished blocks
       (registration late? first WRITE everything already computed, then stream)
    P: first token sampled, every WRITE done ──KVDone{first_token}──► D

`PushSender` is a `KVSender` whose jobs are prefill requests (``expect``)
plus the engine's connector hooks: its scheduler side plans each step's
WRITEs (`build_connector_meta`: a `PushPlan` of block ids) and ends a job once
its request finished with its first token (`request_finished`); its worker
side posts the plan layer by layer from the runner (`layer_hook`) and marks it
sent after the forward (`wait_for_save`). A registration that lands between
two layers of a forward WRITEs the finished layers at once and streams the
rest. Deadlines, heartbeats and failure rules are `KVSender`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

from kvduplex.common.kv_layout import num_blocks_for_tokens
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.scheduler_output import KVConnectorMetadata
from kvduplex.engine.scheduler_output import SchedulerOutput
from kvduplex.kvflow.machines.send import FirstToken
from kvduplex.kvflow.machines.send import LayerDone
from kvduplex.kvflow.machines.send import PrefillAborted
from kvduplex.kvflow.machines.send import PrefillSource
from kvduplex.kvflow.machines.send import Reclaimed
from kvduplex.kvflow.machines.send import StepEnded
from kvduplex.kvflow.machines.send import StepPlanned
from kvduplex.kvflow.prefix_load import LayerLoad
from kvduplex.kvflow.sender import KVSender
from kvduplex.kvflow.sender import SendJob
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)


@dataclass
class PushPlan(KVConnectorMetadata):
    """One step's transfers on prefill, for the worker side: which jobs' send machines
    planned a chunk of this step (each machine holds its own plan), and the prefix loads
    its forward reads."""

    is_computing: bool
    """The step runs a forward (the transport yields the CPU meanwhile)."""
    xids: list[str] = field(default_factory=list)
    """The jobs whose prefills this step computes, in step order."""
    loads: list[LayerLoad] = field(default_factory=list)
    """The prefix loads this step's forward waits for, layer by layer (`PrefixLoads`)."""


class PushSender(KVSender):
    """Prefill's sender: jobs fed by running prefills, streamed layer by layer."""

    _step_jobs: dict[str, SendJob]
    """This step's jobs (by request id = xid): their machines plan and stream its chunk."""

    def _init_flow_state(self) -> None:
        self._step_jobs = {}

    def expect(self, xid: str, peer: PeerHandle, prompt_ids: Sequence[int]) -> None:
        """Push: a prefill named `xid` of `prompt_ids` is about to be added (its request id
        is `xid`); decode's registration must name the same ids.

        Raises ValueError for an xid in progress, one the receiver already cancelled,
        or one another request on this engine uses (its blocks are not this job's).
        """
        if self.engine.get_request(xid) is not None:
            raise ValueError(f"xid {xid!r} is in use by another request on this instance")
        num_blocks = num_blocks_for_tokens(len(prompt_ids), self.block_size)
        source = PrefillSource(self.transport.layout.num_layers)
        self._add(self._new_job(xid, peer, prompt_ids, num_blocks, source))

    def on_prefix_lost(self, xid: str, reason: str) -> None:
        """Engine thread: the prefill ``xid``'s loaded prefix did not land, so this step's
        KV of its later layers is garbage: stop its job (decode hears KVFailed once
        nothing can land, and computes the prompt itself); the prefill recomputes."""
        job = self._jobs.get(xid)
        if job is not None:
            self._feed(job, PrefillAborted(reason))

    def on_request_aborted(self, xid: str) -> None:
        """Engine thread: the prefill request `xid` was aborted (its caller left, or the
        router cancelled it): stop its job; decode hears KVFailed once nothing can land."""
        job = self._jobs.get(xid)
        if job is None:  # aborted before its job began: refuse its registration later
            self.cancel(xid, "the prefill request was aborted")
        else:
            self._feed(job, PrefillAborted())

    # ---- connector hooks (engine thread) ----

    def build_connector_meta(self, out: SchedulerOutput) -> PushPlan:
        """Scheduler side: each job whose prefill this step computes plans its chunk; when
        the pool was short, finished pushes still unregistered give their blocks back."""
        self._step_jobs.clear()
        plan = PushPlan(is_computing=bool(out.seqs))
        if not self._jobs:
            return plan
        if out.blocks_short:
            self._reclaim_unregistered()
        for seq in out.seqs:
            job = self._jobs.get(seq.request_id)
            req = self.engine.get_request(seq.request_id)
            if job is None or req is None or job.error is not None or not job.source.streams:
                continue
            self._step_jobs[job.xid] = job
            plan.xids.append(job.xid)
            end = seq.start_pos + seq.num_new_tokens
            self._feed(job, StepPlanned(seq.start_pos, end, list(req.block_ids)))
        return plan

    def _reclaim_unregistered(self) -> None:
        """Give up every finished push whose receiver has not registered yet.

        Such a prefill holds its blocks until decode makes room for the request, while
        decode may hold blocks for another request that waits for this prefill's pool:
        each side's pool waits on the other's, and without this only the transfers'
        deadlines would end the wait. Decode computes a given-up prompt itself, from the
        first token already sampled (usually just the new tokens: it holds the history).
        """
        reason = "the pool needs the blocks of this finished prefill, not registered yet"
        for job in list(self._jobs.values()):
            self._feed(job, Reclaimed(reason))

    def start_load_kv(self, plan: PushPlan) -> None:
        if plan.is_computing:
            self.transport.set_compute_busy(True)

    def layer_hook(self, plan: PushPlan) -> Callable[[int], None] | None:
        """Worker side: after each layer, the flow inbox's LAYER events are applied (a
        registration that arrived meanwhile writes the finished layers at once; a WRITE
        that failed stops its job's next ones; the rest waits for `get_finished`), then
        every planned job posts that layer's WRITEs."""
        if not plan.xids:
            return None
        jobs = [self._step_jobs[xid] for xid in plan.xids if xid in self._step_jobs]

        def on_layer_done(layer: int) -> None:
            self._layer = layer  # a registration drained now writes layers 0..layer at once
            self.inbox.drain_layer()
            now = time.monotonic()
            for job in jobs:
                if job.chunk is not None:
                    self._feed(job, LayerDone(layer, now))

        return on_layer_done

    def wait_for_save(self, plan: PushPlan) -> None:
        """Worker side, after the forward: every planned job's chunk ends."""
        self._layer = None
        self.transport.set_compute_busy(False)
        for job in self._step_jobs.values():
            self._feed(job, StepEnded())
        self._step_jobs.clear()

    def request_finished(self, req: Request, reason: FinishReason) -> None:
        """Scheduler side: an aborted request's job stops; a finished one ends once its
        WRITEs are done (its first token goes with KVDone)."""
        if reason is FinishReason.ABORT:
            self.on_request_aborted(req.request_id)
            return
        job = self._jobs.get(req.request_id)
        if job is None or not req.output_token_ids:
            return
        now = time.monotonic()
        first = FirstToken(
            req.output_token_ids[0], req.num_cached_tokens, now, req.first_token_logprobs
        )
        self._feed(job, first)


__all__ = ["PushPlan", "PushSender"]
