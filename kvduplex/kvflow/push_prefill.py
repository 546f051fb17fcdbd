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
from dataclasses import dataclass
from dataclasses import field

from kvduplex.engine.kv_cache import num_blocks_for_tokens
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.scheduler_output import KVConnectorMetadata
from kvduplex.engine.scheduler_output import SchedulerOutput
from kvduplex.kvflow.sender import Chunk
from kvduplex.kvflow.sender import KVSender
from kvduplex.kvflow.sender import SendJob
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)


@dataclass
class PushPlan(KVConnectorMetadata):
    """One step's WRITEs on prefill, for the worker side (plain data)."""

    is_computing: bool
    """The step runs a forward (the transport yields the CPU meanwhile)."""
    chunks: dict[str, Chunk] = field(default_factory=dict)
    """WRITE plans by xid; a registration that lands mid-forward adds its own."""


class PushSender(KVSender):
    """Prefill's sender: jobs fed by running prefills, streamed layer by layer."""

    _chunks: dict[str, Chunk]
    """This step's WRITE plans, by request id (= xid): the current `PushPlan`'s."""
    _step_seqs: dict[str, tuple[int, int]]
    """This step's jobs: xid -> (start, end) of the scheduled chunk."""

    def _init_flow_state(self) -> None:
        self._chunks = {}
        self._step_seqs = {}

    def expect(self, xid: str, peer: PeerHandle, num_prompt_tokens: int) -> None:
        """Push: a prefill named `xid` is about to be added (its request id is `xid`).

        Raises ValueError for an xid in progress, one the receiver already cancelled,
        or one another request on this engine uses (its blocks are not this job's).
        """
        if self.engine.get_request(xid) is not None:
            raise ValueError(f"xid {xid!r} is in use by another request on this instance")
        job = SendJob(
            xid, peer, num_prompt_tokens, num_blocks_for_tokens(num_prompt_tokens, self.block_size),
            expires_at=time.monotonic() + self.registration_wait_s, needs_first_token=True,
        )  # fmt: skip
        self._add(job)

    def on_request_aborted(self, xid: str) -> None:
        """Engine thread: the prefill request `xid` was aborted (its caller left, or the
        router cancelled it): stop its job; decode hears KVFailed once nothing can land."""
        job = self._jobs.get(xid)
        if job is None:  # aborted before its job began: refuse its registration later
            self.cancel(xid, "the prefill request was aborted")
        elif not job.ended and job.error is None:
            logger.info("xid=%s: prefill request aborted; cancelling its push", xid)
            self._fail(job, "the prefill request was aborted")

    def _register_request_job(self, job: SendJob, layer: int | None) -> None:
        """Registration after prefill began: write what is computed at once (mid-forward:
        this chunk's layers 0..layer at once, the later ones as they finish)."""
        req = self.engine.get_request(job.xid)
        if req is None:
            return
        step = self._step_seqs.get(job.xid)
        if step is None or layer is None:
            self._catch_up(job, req, self._blocks_done(job, req.num_computed_tokens))
            return
        start, end = step
        self._catch_up(job, req, self._blocks_done(job, start))
        hi = self._blocks_done(job, end)
        if hi > job.sent:
            chunk = self._plan(job, req, hi)
            chunk.num_pending = self.transport.layout.num_layers - layer
            chunk.from_layer = layer + 1
            self._chunks[job.xid] = chunk
            self._post(job, chunk, layers=list(range(layer + 1)))

    # ---- connector hooks (engine thread) ----

    def build_connector_meta(self, out: SchedulerOutput) -> PushPlan:
        """Scheduler side: plan this step's WRITEs of registered jobs."""
        plan = PushPlan(is_computing=bool(out.seqs))
        self._chunks = plan.chunks
        self._step_seqs = {}
        if not self._jobs:
            return plan
        for seq in out.seqs:
            job = self._jobs.get(seq.request_id)
            if job is None or job.error is not None or job.src_blocks is not None:
                continue
            end = seq.start_pos + seq.num_new_tokens
            self._step_seqs[job.xid] = (seq.start_pos, end)
            if job.reg is None:
                continue
            hi = self._blocks_done(job, end)
            if hi > job.sent:
                chunk = self._plan(job, self.engine.get_request(seq.request_id), hi)
                chunk.num_pending = self.transport.layout.num_layers
                plan.chunks[job.xid] = chunk
        return plan

    def request_finished(self, req: Request, reason: FinishReason) -> None:
        """Scheduler side: an aborted request's job stops; a finished one ends once its
        WRITEs are done (its first token goes with KVDone)."""
        if reason is FinishReason.ABORT:
            self.on_request_aborted(req.request_id)
            return
        job = self._jobs.get(req.request_id)
        if job is None or job.src_blocks is not None or not req.output_token_ids:
            return
        job.first_token = req.output_token_ids[0]
        job.num_cached_tokens = req.num_cached_tokens
        job.compute_done_at = time.monotonic()
        self._maybe_end(job)

    def start_load_kv(self, plan: PushPlan) -> None:
        if plan.is_computing:
            self.transport.set_compute_busy(True)

    def layer_hook(self, plan: PushPlan) -> Callable[[int], None] | None:
        if not self._step_seqs:
            return None

        def on_layer_done(layer: int) -> None:
            self._drain_registrations(layer)
            for xid, chunk in plan.chunks.items():
                if chunk.from_layer <= layer:
                    self._post(self._jobs[xid], chunk, layers=[layer])

        return on_layer_done

    def wait_for_save(self, plan: PushPlan) -> None:
        """Worker side, after the forward: every layer of the plan is posted."""
        self.transport.set_compute_busy(False)
        for xid, chunk in plan.chunks.items():
            self._jobs[xid].sent = chunk.hi
        self._chunks = {}
        self._step_seqs.clear()


__all__ = ["PushPlan", "PushSender"]
