"""Continuous batching with chunked prefill, preemption by recompute and remote-KV waits.

One engine step::

    out = scheduler.schedule()                # which tokens of which requests
    sampled = engine._execute(out)            # forward over out.seqs (runner.execute), then
                                              # sampling: {request_id: token} for needs_sample
    finished = scheduler.update(out, sampled)

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

When a running request cannot get blocks, the most recently arrived running
request is preempted (blocks freed, to the front of the waiting queue) until it
can, or it was itself the victim. Its output tokens are kept and recomputed as
part of its prefix on re-admission (often straight from the prefix cache).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable
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
from kvduplex.engine.scheduler_output import RemoteKVAllocation
from kvduplex.engine.scheduler_output import ScheduledSeq
from kvduplex.engine.scheduler_output import SchedulerOutput
from kvduplex.engine.scheduler_output import StepBuilder
from kvduplex.engine.scheduler_output import check_stop

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
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.request_finished = request_finished
        """The finish hook (the engine sets its connector's)."""
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()  # WAITING / PREEMPTED, FCFS
        self._running: list[Request] = []  # RUNNING, by arrival_time
        self._remote_waiting: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self._held: dict[str, Request] = {}  # finished, blocks kept for a reader
        self.tables = BlockTableTracker()  # what the runner holds of each block table

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
        self._schedule_running(step, decodes=True)
        cap = self.config.max_prefill_tokens_with_decodes
        if cap > 0 and step.seqs:  # decodes run: prefill chunks share at most `cap` tokens
            step.token_budget = min(step.token_budget, len(step.seqs) + cap)
        self._schedule_running(step, decodes=False)
        if not step.preempted_ids:
            self._admit_waiting(step)
        return step.build(self.tables)

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Apply a step's results; return the requests that finished in it.

        `sampled` holds one token per seq with ``needs_sample``. Seqs whose
        request was aborted or finished since `schedule` are skipped.
        """
        finished: list[Request] = []
        for seq in output.seqs:
            req = self._requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
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
        req = self._pop_remote_waiting(request_id)
        if first_token is None:
            self._resume_locally(req, req.num_prompt_tokens - 1)
        else:
            req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_full_blocks(req)
        req.status = RequestStatus.RUNNING
        self._insert_running(req)
        logger.debug("request %s: remote KV done (first token %s)", request_id, first_token)
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
        req = self._pop_remote_waiting(request_id)
        if discard_blocks:
            self.tables.forget(request_id)
            self.kv.drop_tail(req, req.num_cached_tokens // self.kv.block_size)
        self._resume_locally(req, min(req.num_cached_tokens, req.num_prompt_tokens - 1))
        req.status = RequestStatus.RUNNING
        self._insert_running(req)
        logger.warning(
            "request %s: remote KV failed (transfer %s); prefilling %d tokens locally",
            request_id,
            req.remote_kv.transfer_id if req.remote_kv else "?",
            req.num_prompt_tokens - req.num_computed_tokens,
        )

    def _pop_remote_waiting(self, request_id: str) -> Request:
        req = self._remote_waiting.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return req

    def _resume_locally(self, req: Request, num_computed: int) -> None:
        """Compute from `num_computed` on, never writing into an acquired prefix-hit block.

        A hit may cover the whole prompt (remote KV allows it); backing off to
        recompute the last token would then write into a shared block, so
        that block is dropped and its tokens recomputed into a fresh one.
        """
        num_hit_blocks = req.num_cached_tokens // self.kv.block_size
        if num_computed < num_hit_blocks * self.kv.block_size:
            num_kept = num_computed // self.kv.block_size
            self.tables.forget(req.request_id)
            self.kv.drop_tail(req, num_kept)
            num_computed = num_kept * self.kv.block_size
            req.num_cached_tokens = num_computed
        req.num_computed_tokens = num_computed

    # ---- parts of schedule() ----

    def _chunk_size(self, num_remaining: int, step: StepBuilder) -> int:
        """Tokens of a request to compute this step (0: not this step)."""
        budget = step.budget_left
        if not self.config.enable_chunked_prefill:
            if num_remaining <= budget:
                return num_remaining
            # Larger than the whole budget: it runs alone, in one piece.
            return num_remaining if not step.seqs else 0
        n = num_remaining
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _schedule_running(self, step: StepBuilder, *, decodes: bool) -> None:
        """Give running requests their next token (decodes) or next chunk (prefills)."""
        for req in list(self._running):
            if req.status is not RequestStatus.RUNNING or req.request_id in step.seqs:
                continue  # preempted earlier in this step, or already scheduled
            num_remaining = req.num_tokens - req.num_computed_tokens
            assert num_remaining >= 1, f"running request {req.request_id} has nothing to compute"
            if (num_remaining == 1) != decodes:
                continue
            n = self._chunk_size(num_remaining, step)
            if n == 0:
                continue
            if self._allocate_or_preempt(req, n, step):
                step.add(req, n)

    def _allocate_or_preempt(self, req: Request, num_new_tokens: int, step: StepBuilder) -> bool:
        """Allocate slots for a running request, preempting the latest arrivals as needed.

        Returns False if `req` itself was preempted.
        """
        while self.kv.try_allocate_slots(req, num_new_tokens) is None:
            victim = max(self._running, key=lambda r: r.arrival_time)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, step: StepBuilder) -> None:
        """Admit waiting requests in order while seats, budget and blocks last."""
        while self._waiting:
            if len(self._running) + len(self._remote_waiting) >= self.config.max_num_seqs:
                return
            req = self._waiting[0]
            if req.remote_kv is not None and req.status is RequestStatus.WAITING:
                if not self._admit_remote(req, step):
                    return
                continue
            if step.budget_left == 0:
                return
            hit = self.kv.find_prefix_hit(req)
            n = self._chunk_size(req.num_tokens - hit.num_tokens, step)
            if n == 0 or self.kv.try_allocate_slots(req, n, hit) is None:
                return
            self._waiting.popleft()
            req.num_computed_tokens = hit.num_tokens
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self._insert_running(req)
            step.add(req, n)
            logger.debug(
                "request %s admitted: %d tokens cached, %d to compute",
                req.request_id,
                hit.num_tokens,
                req.num_tokens - hit.num_tokens,
            )

    def _admit_remote(self, req: Request, step: StepBuilder) -> bool:
        """Allocate blocks for the whole prompt and wait for the sender to fill them."""
        assert req.remote_kv is not None
        hit = self.kv.find_prefix_hit(req, allow_full_hit=True)
        if self.kv.try_allocate_slots(req, req.num_prompt_tokens - hit.num_tokens, hit) is None:
            return False
        self._waiting.popleft()
        req.num_computed_tokens = hit.num_tokens
        req.num_cached_tokens = hit.num_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._remote_waiting[req.request_id] = req
        step.remote_kv_allocated.append(
            RemoteKVAllocation(
                req.request_id,
                req.remote_kv.transfer_id,
                tuple(req.block_ids),
                req.num_cached_tokens,
                req.num_prompt_tokens,
            )
        )
        logger.debug(
            "request %s: %d blocks allocated for remote KV (transfer %s, %d tokens cached)",
            req.request_id,
            len(req.block_ids),
            req.remote_kv.transfer_id,
            hit.num_tokens,
        )
        return True

    def _preempt(self, req: Request, step: StepBuilder) -> None:
        self._running.remove(req)
        step.drop(req)
        self.tables.forget(req.request_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._waiting.appendleft(req)
        step.preempted_ids.append(req.request_id)
        logger.info(
            "request %s preempted (out of KV blocks; %d tokens to recompute)",
            req.request_id,
            req.num_tokens,
        )

    def _insert_running(self, req: Request) -> None:
        bisect.insort(self._running, req, key=lambda r: r.arrival_time)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Move a request to its final status and free (or hold) its blocks."""
        status = req.status
        if status is RequestStatus.RUNNING:
            self._running.remove(req)
        elif status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self._remote_waiting[req.request_id]
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
