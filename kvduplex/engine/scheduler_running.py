"""The running requests: each step's decodes and prefill chunks, and preemption by recompute.

A running request with one token left to compute decodes (one token a step); one
with more prefills its next chunk (`chunk_size`). When a running request cannot
get blocks, the most recently arrived running request is preempted (blocks freed,
handed to `on_preempted`: the front of the waiting queue) until it can, or it was
itself the victim. Its output tokens are kept and recomputed as part of its prefix
on re-admission (often straight from the prefix cache).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from collections.abc import Iterator

from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.engine.scheduler_output import BlockTableTracker
from kvduplex.engine.scheduler_output import StepBuilder

logger = logging.getLogger(__name__)


def chunk_size(config: SchedulerConfig, num_remaining: int, step: StepBuilder) -> int:
    """Tokens of a request to compute this step (0: not this step)."""
    budget = step.budget_left
    if not config.enable_chunked_prefill:
        if num_remaining <= budget:
            return num_remaining
        # Larger than the whole budget: it runs alone, in one piece.
        return num_remaining if not step.seqs else 0
    n = num_remaining
    if config.long_prefill_token_threshold > 0:
        n = min(n, config.long_prefill_token_threshold)
    return min(n, budget)


class RunningRequests:
    """The RUNNING requests of one scheduler, by arrival time; iterable, sized.

    Single-threaded, as its scheduler.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        tables: BlockTableTracker,
        on_preempted: Callable[[Request], None],
    ) -> None:
        """`on_preempted`: takes each preempted request (already PREEMPTED, its blocks
        freed), in the order they are preempted."""
        self.config = config
        self.kv = kv_manager
        self.tables = tables
        self._on_preempted = on_preempted
        self._requests: list[Request] = []  # by arrival_time

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def insert(self, req: Request) -> None:
        bisect.insort(self._requests, req, key=lambda r: r.arrival_time)

    def remove(self, req: Request) -> None:
        self._requests.remove(req)

    def schedule_decodes(self, step: StepBuilder) -> None:
        """Give running decodes their next token."""
        self._schedule(step, decodes=True)

    def schedule_prefills(self, step: StepBuilder) -> None:
        """Give running prefills their next chunk."""
        self._schedule(step, decodes=False)

    def _schedule(self, step: StepBuilder, *, decodes: bool) -> None:
        """Give running requests their next token (decodes) or next chunk (prefills)."""
        for req in list(self._requests):
            if req.status is not RequestStatus.RUNNING or req.request_id in step.seqs:
                continue  # preempted earlier in this step, or already scheduled
            num_remaining = req.num_tokens - req.num_computed_tokens
            assert num_remaining >= 1, f"running request {req.request_id} has nothing to compute"
            if (num_remaining == 1) != decodes:
                continue
            n = chunk_size(self.config, num_remaining, step)
            if n == 0:
                continue
            if self._allocate_or_preempt(req, n, step):
                step.add(req, n)

    def _allocate_or_preempt(self, req: Request, num_new_tokens: int, step: StepBuilder) -> bool:
        """Allocate slots for a running request, preempting the latest arrivals as needed.

        Returns False if `req` itself was preempted.
        """
        while self.kv.try_allocate_slots(req, num_new_tokens) is None:
            victim = max(self._requests, key=lambda r: r.arrival_time)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, step: StepBuilder) -> None:
        self._requests.remove(req)
        step.drop(req)
        self.tables.forget(req.request_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._on_preempted(req)
        step.preempted_ids.append(req.request_id)
        logger.info(
            "request %s preempted (out of KV blocks; %d tokens to recompute)",
            req.request_id,
            req.num_tokens,
        )
