"""Continuous batching with chunked prefill, preemption by recompute and remote-KV waits.

One engine step::

    out = scheduler.schedule()                # which tokens of which requests
    sampled = engine._execute(out)            # forward over out.seqs (runner.execute), then
                                              # sampling: {request_id: token} for needs_sample
    finished = scheduler.update(out, sampled)

The scheduler is composed of parts, each owning its requests (the scheduler
owns the table of all, and their finish):

    WaitingQueue     (scheduler_waiting.py)   WAITING / PREEMPTED, FCFS, and admission
    RunningRequests  (scheduler_running.py)   RUNNING: decodes, prefill chunks, preemption
    RemoteKVWaits    (scheduler_remote.py)    WAITING_FOR_REMOTE_KV, until the KV arrives or fails

`schedule` fills the token budget (``max_num_batched_tokens``) in this order:

1. running decodes (one token each); with ``max_prefill_tokens_with_decodes``
   set and decodes scheduled, the step's budget shrinks to the decodes plus
   that many prefill tokens, so that a burst of arrivals cannot stretch the
   steps that running requests wait on,
2. running prefills that continue (the next chunk),
3. admission of waiting requests, FCFS, while seats (``max_num_seqs``),
   budget and blocks last; a request with ``remote_kv`` gets blocks for its
   whole prompt and parks in WAITING_FOR_REMOTE_KV, costing no budget.

A chunk of a request (``start_pos`` = num_computed_tokens before the step)::

    all_token_ids  [ ..... computed ..... | chunk ...... | rest ... ]
                   0                  start_pos     +num_new_tokens
    needs_sample = (start_pos + num_new_tokens == num_tokens)

When a running request cannot get blocks, the latest arrivals are preempted
(see `scheduler_running.py`); no request is admitted in a step that preempted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field

from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.engine.scheduler_output import BlockTableTracker
from kvduplex.engine.scheduler_output import KVFirstToken
from kvduplex.engine.scheduler_output import KVReceived
from kvduplex.engine.scheduler_output import KVReceiveFailed
from kvduplex.engine.scheduler_output import KVSendCancelled
from kvduplex.engine.scheduler_output import KVSendEnded
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.engine.scheduler_output import ScheduledSeq
from kvduplex.engine.scheduler_output import SchedulerOutput
from kvduplex.engine.scheduler_output import StepBuilder
from kvduplex.engine.scheduler_output import check_stop
from kvduplex.engine.scheduler_remote import RemoteKVWaits
from kvduplex.engine.scheduler_running import RunningRequests
from kvduplex.engine.scheduler_waiting import ExternalPrefix
from kvduplex.engine.scheduler_waiting import WaitingQueue

logger = logging.getLogger(__name__)


@dataclass
class KVApplied:
    """What applying a step's transfer results changed, for the engine's outputs."""

    resumed: list[Request] = field(default_factory=list)
    """Got their first token with their remote KV (finished already, some of them)."""
    stopped: list[Request] = field(default_factory=list)
    """Prefills aborted because the push of their KV failed or was cancelled."""


RequestFinished = Callable[[Request, FinishReason], bool]
"""Called once per finish with the request (already in its final status); returns
whether its blocks stay held until `Scheduler.release_held`."""


def holds_blocks(request: Request, reason: FinishReason) -> bool:
    """The default `RequestFinished`: hold what was added with ``hold_blocks_on_finish``,
    unless aborted."""
    return request.hold_blocks_on_finish and reason is not FinishReason.ABORT


class Scheduler:
    """Decides each step's batch; owns every unfinished request of one engine.

    Single-threaded: call all methods from the engine loop.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        request_finished: RequestFinished = holds_blocks,
        external: ExternalPrefix | None = None,
    ) -> None:
        """``external``: what a connector loads for new requests at admission (see
        `ExternalPrefix`; default: nothing)."""
        self.config = config
        self.kv = kv_manager
        self.request_finished = request_finished
        """The finish hook (the engine sets its connector's)."""
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._held: dict[str, Request] = {}  # finished, blocks kept for a reader
        self.tables = BlockTableTracker()  # what the runner holds of each block table
        self._waiting = WaitingQueue(config, kv_manager, external)
        self._running = RunningRequests(config, kv_manager, self.tables, self._waiting.push_front)
        self._remote_waiting = RemoteKVWaits(kv_manager, self.tables, self._running)

    # ---- queries ----

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (WAITING or PREEMPTED)."""
        return len(self._waiting)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return len(self._remote_waiting)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished or held request, else None."""
        return self._requests.get(request_id) or self._held.get(request_id)

    # ---- lifecycle ----

    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises ValueError for a duplicate id or a prompt that can never fit."""
        if req.request_id in self._requests or req.request_id in self._held:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.status is not RequestStatus.WAITING:
            raise ValueError(f"request {req.request_id} must be new (status {req.status.name})")
        num_blocks = self.kv.num_blocks_needed(req.num_prompt_tokens)
        if num_blocks > self.kv.pool.num_blocks:
            raise ValueError(
                f"request {req.request_id}: its prompt of {req.num_prompt_tokens} tokens needs "
                f"{num_blocks} KV blocks but the pool has only {self.kv.pool.num_blocks} "
                f"(at most {self.kv.max_num_tokens} tokens); shorten the prompt or grow the KV cache"
            )
        self._requests[req.request_id] = req
        self._waiting.append(req)
        logger.debug("request %s queued: %d prompt tokens", req.request_id, req.num_prompt_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Finish the request as aborted and free its blocks, whatever its state.

        A held request just releases its blocks. Returns False for an unknown id.
        """
        if request_id in self._held:
            return self.release_held(request_id)
        if request_id not in self._requests:
            return False
        self._finish(self._requests[request_id], FinishReason.ABORT)
        return True

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """Finish an unfinished request now (the engine's stop strings); False if not unfinished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, reason)
        return True

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished request kept (``hold_blocks_on_finish``); False if none held."""
        req = self._held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        logger.debug("request %s: held blocks released", request_id)
        return True

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch and allocate its slots (see the module docstring)."""
        step = StepBuilder(self.config.max_num_batched_tokens)
        self._running.schedule_decodes(step)
        cap = self.config.max_prefill_tokens_with_decodes
        if cap > 0 and step.seqs:  # decodes run: prefill chunks share at most `cap` tokens
            step.token_budget = min(step.token_budget, len(step.seqs) + cap)
        self._running.schedule_prefills(step)
        if not step.preempted_ids:
            self._waiting.admit(step, self._running, self._remote_waiting)
        return step.build(self.tables)

    def update(
        self, output: SchedulerOutput, sampled: Mapping[str, int], void: Collection[str] = ()
    ) -> list[Request]:
        """Apply a step's results; return the requests that finished in it.

        `sampled` holds one token per seq with ``needs_sample``. Seqs whose
        request was aborted or finished since `schedule` are skipped. The requests
        in `void` (their loaded KV did not land: the step computed them over
        garbage) keep nothing of the step: they go back to waiting, first, as new,
        and compute their prompt from their local prefix hit.
        """
        finished: list[Request] = []
        for seq in output.seqs:
            req = self._requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if req.request_id in void:
                self._recompute(req)
                continue
            assert req.num_computed_tokens == seq.start_pos, (
                f"request {req.request_id} moved mid-step"
            )
            req.num_computed_tokens += seq.num_new_tokens
            if seq.needs_sample:
                if req.request_id not in sampled:
                    raise ValueError(
                        f"request {req.request_id} needed a sampled token but got none"
                    )
                token = sampled[req.request_id]
                if req.num_output_tokens == 0 and req.forced_first_token is not None:
                    token = req.forced_first_token  # sampled elsewhere, sent already
                req.append_output_token(token)
            self.kv.cache_full_blocks(req)
            if seq.needs_sample:
                reason = check_stop(req, self.kv.max_num_tokens)
                if reason is not None:
                    self._finish(req, reason)
                    finished.append(req)
        return finished

    def _recompute(self, req: Request) -> None:
        """A step of `req` is void: free its blocks (a READ that may still land into some
        holds its own references) without caching any, and queue it first, as new."""
        assert req.num_output_tokens == 0, f"request {req.request_id}: a load after its first token"
        self._running.remove(req)
        self.tables.forget(req.request_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.status = RequestStatus.WAITING
        self._waiting.push_front(req)
        logger.info("request %s: its loaded KV did not land; computing its prompt", req.request_id)

    # ---- remote KV ----

    def apply_kv_results(self, results: Iterable[KVTransferResult]) -> KVApplied:
        """Apply what the connector reported about transfers since the last step (the
        only place transfers change requests). A result for a request that is no longer
        waiting (aborted meanwhile) is dropped."""
        applied = KVApplied()
        for res in results:
            rid = res.request_id
            if isinstance(res, KVFirstToken):
                req = self._requests.get(rid)
                if req is not None and req.num_output_tokens == 0:
                    req.forced_first_token = res.token
                continue
            if isinstance(res, KVSendCancelled | KVSendEnded):
                self._apply_send_result(res, applied)
                continue
            req = self._remote_waiting.get(rid)
            if req is None:
                logger.info("request %s: gone before its KV arrived", rid)
                continue
            if isinstance(res, KVReceiveFailed):
                self.on_remote_kv_failed(rid, discard_blocks=res.discard_blocks)
                continue
            assert isinstance(res, KVReceived)
            req.num_remote_cached_tokens = res.num_remote_cached_tokens
            req.num_remote_kv_bytes = res.num_remote_kv_bytes
            if res.first_token_logprobs is not None:
                req.first_token_logprobs = res.first_token_logprobs
            self.on_remote_kv_done(rid, res.first_token)
            if res.first_token is not None:
                applied.resumed.append(req)
        return applied

    def _apply_send_result(self, res: KVSendCancelled | KVSendEnded, applied: KVApplied) -> None:
        """A push from this prefill was cancelled or can land no more: the prefill stops
        if it still computes; once nothing can land, its held blocks are freed."""
        rid = res.request_id
        if isinstance(res, KVSendEnded) and self.release_held(rid):
            return
        req = self._requests.get(rid)
        if req is not None:
            self._finish(req, FinishReason.ABORT)
            applied.stopped.append(req)

    def on_remote_kv_done(self, request_id: str, first_token: int | None) -> bool:
        """The sender filled the prompt's blocks; start decoding. Returns True if it finished.

        With `first_token` (sampled by the sender) the request decodes from it.
        Without, the last prompt token is recomputed here to get logits.
        Raises KeyError if the request is not waiting for remote KV.
        """
        req = self._remote_waiting.kv_arrived(request_id, first_token)
        if first_token is None:
            return False
        req.append_output_token(first_token)
        reason = check_stop(req, self.kv.max_num_tokens)
        if reason is not None:
            self._finish(req, reason)
            return True
        return False

    def on_remote_kv_failed(self, request_id: str, *, discard_blocks: bool = False) -> None:
        """The remote KV will not come: prefill the uncached part here.

        By default the request keeps its blocks: call so only once no write
        into them can still land. With ``discard_blocks`` (a sender that may
        still write late) the blocks beyond the local prefix hit are released
        and the prompt is computed into fresh ones; whoever might still be
        written into must hold its own reference on the released blocks.
        Raises KeyError if the request is not waiting for remote KV.
        """
        self._remote_waiting.kv_failed(request_id, discard_blocks=discard_blocks)

    # ---- finish ----

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Move a request to its final status and free (or hold) its blocks."""
        status = req.status
        if status is RequestStatus.RUNNING:
            self._running.remove(req)
        elif status is RequestStatus.WAITING_FOR_REMOTE_KV:
            self._remote_waiting.remove(req)
        else:
            self._waiting.remove(req)
        del self._requests[req.request_id]
        self.tables.forget(req.request_id)
        req.status = reason.status
        req.finish_reason = reason
        try:
            hold = self.request_finished(req, reason)
        except Exception:  # the request is finished either way; its blocks must not leak
            logger.exception("request %s: the finish hook failed; blocks freed", req.request_id)
            hold = False
        if hold:
            self._held[req.request_id] = req
        else:
            self.kv.free(req)
        logger.debug(
            "request %s finished (%s): %d prompt + %d output tokens, %d cached, %d preemptions",
            req.request_id,
            reason.value,
            req.num_prompt_tokens,
            req.num_output_tokens,
            req.num_cached_tokens,
            req.num_preemptions,
        )


__all__ = [
    "KVApplied",
    "RequestFinished",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
    "check_stop",
    "holds_blocks",
]
