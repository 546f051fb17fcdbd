"""Prefill's side of the layer-wise push: stream a prefill's KV into decode's blocks.

::

    router ──► P /internal/push/prefill {xid, prompt, decode_url}     (at the same time)
    router ──► D /v1/... {kv_transfer_params: {mode: push, xid, prefill_url}}
    D: admit, allocate the blocks its prefix cache lacks ──KVRegister──► P
    P: after each layer of each chunk, WRITE that layer's finished blocks
       (registration late? first WRITE everything already computed, then stream)
    P: first token sampled, every WRITE done ──KVDone{first_token}──► D

`PushSender` is a `KVSender` whose jobs are prefill requests (``expect``)
plus the engine hooks that plan each step's WRITEs (`on_scheduled`), post
them layer by layer from the runner (`layer_hook`), and end a job once its
first token is sampled (`on_step_done`). A registration that lands between
two layers of a forward WRITEs the finished layers at once and streams the
rest. Deadlines, heartbeats and failure rules are `KVSender`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvduplex.engine.kv_cache import num_blocks_for_tokens
from kvduplex.engine.request import Request
from kvduplex.engine.scheduler_output import SchedulerOutput
from kvduplex.kvflow.machines.send import FirstToken
from kvduplex.kvflow.machines.send import LayerDone
from kvduplex.kvflow.machines.send import PrefillAborted
from kvduplex.kvflow.machines.send import PrefillSource
from kvduplex.kvflow.machines.send import StepEnded
from kvduplex.kvflow.machines.send import StepPlanned
from kvduplex.kvflow.sender import KVSender
from kvduplex.kvflow.sender import SendJob
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)


class PushSender(KVSender):
    """Prefill's sender: jobs fed by running prefills, streamed layer by layer."""

    _step_jobs: dict[str, SendJob]
    """This step's jobs (by request id = xid): their machines plan and stream its chunk."""

    def _init_flow_state(self) -> None:
        self._step_jobs = {}

    def expect(self, xid: str, peer: PeerHandle, num_prompt_tokens: int) -> None:
        """Push: a prefill named `xid` is about to be added (its request id is `xid`).

        Raises ValueError for an xid in progress, one the receiver already cancelled,
        or one another request on this engine uses (its blocks are not this job's).
        """
        if self.engine.get_request(xid) is not None:
            raise ValueError(f"xid {xid!r} is in use by another request on this instance")
        num_blocks = num_blocks_for_tokens(num_prompt_tokens, self.block_size)
        source = PrefillSource(self.transport.layout.num_layers)
        self._add(self._new_job(xid, peer, num_prompt_tokens, num_blocks, source))

    def on_request_aborted(self, xid: str) -> None:
        """Engine thread: the prefill request `xid` was aborted (its caller left, or the
        router cancelled it): stop its job; decode hears KVFailed once nothing can land."""
        job = self._jobs.get(xid)
        if job is None:  # aborted before its job began: refuse its registration later
            self.cancel(xid, "the prefill request was aborted")
        else:
            self._feed(job, PrefillAborted())

    # ---- engine hooks (engine thread) ----

    def on_scheduled(self, out: SchedulerOutput) -> None:
        self._step_jobs.clear()
        if out.seqs:
            self.transport.set_compute_busy(True)
        if not self._jobs:
            return
        for seq in out.seqs:
            job = self._jobs.get(seq.request.request_id)
            if job is None or job.error is not None or not job.source.streams:
                continue
            self._step_jobs[job.xid] = job
            end = seq.start_pos + seq.num_new_tokens
            self._feed(job, StepPlanned(seq.start_pos, end, list(seq.request.block_ids)))

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        if not self._step_jobs:
            return None

        def on_layer_done(layer: int) -> None:
            self._drain_registrations(layer)
            now = time.monotonic()
            for job in self._step_jobs.values():
                if job.chunk is not None:
                    self._feed(job, LayerDone(layer, now))

        return on_layer_done

    def on_step_done(
        self, out: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> None:
        self.transport.set_compute_busy(False)
        for job in self._step_jobs.values():
            self._feed(job, StepEnded())
        self._step_jobs.clear()
        now = time.monotonic()
        for req in finished:
            done = self._jobs.get(req.request_id)
            if done is None or not req.output_token_ids:
                continue
            self._feed(done, FirstToken(req.output_token_ids[0], req.num_cached_tokens, now))


__all__ = ["PushSender"]
