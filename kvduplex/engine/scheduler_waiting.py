"""The waiting queue: requests not yet admitted (WAITING) or preempted (PREEMPTED), and
their admission, first come first served, while seats, token budget and blocks last.

A request admitted to compute here takes its prefix-cache hit and its first chunk
and joins the running requests; a new one may also take tokens loaded during its
first forward (`ExternalPrefix`: a long KV tier run its lookup left in the tier, then
what its connector fetches; blocks allocated with the chunk's, counted computed,
loaded layer by layer)::

    prompt   [ local hit | loaded (external) | chunk ...... | rest ]
             0           hit           num_computed      +n

and one one with ``remote_kv`` (never admitted before)
gets blocks for its whole prompt and waits for its KV instead, costing no budget.
Admission stops at the first request that does not fit, so none overtakes it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.engine.scheduler_output import StepBuilder
from kvduplex.engine.scheduler_remote import RemoteKVWaits
from kvduplex.engine.scheduler_running import RunningRequests
from kvduplex.engine.scheduler_running import chunk_size

logger = logging.getLogger(__name__)


class ExternalPrefix(Protocol):
    """What admission asks of the engine's connector (`KVConnector` has both)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int: ...

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None: ...


class _NoExternal:
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        pass


class WaitingQueue:
    """The requests of one scheduler waiting for admission, in order; sized.

    Single-threaded, as its scheduler.
    """

    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager,
        external: ExternalPrefix | None = None,
    ) -> None:  # fmt: skip
        """``external``: tokens a connector loads for a new request (default: none)."""
        self.config = config
        self.kv = kv_manager
        self.external: ExternalPrefix = external if external is not None else _NoExternal()
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def append(self, req: Request) -> None:
        """Queue a new request, last."""
        self._queue.append(req)

    def push_front(self, req: Request) -> None:
        """Queue a preempted request first: it is admitted again before any other."""
        self._queue.appendleft(req)

    def remove(self, req: Request) -> None:
        """Take `req` out of the queue (it finishes before its admission)."""
        self._queue.remove(req)

    def admit(self, step: StepBuilder, running: RunningRequests, remote: RemoteKVWaits) -> None:
        """Admit waiting requests in order while seats, budget and blocks last."""
        while self._queue:
            if len(running) + len(remote) >= self.config.max_num_seqs:
                return
            req = self._queue[0]
            if req.remote_kv is not None and req.status is RequestStatus.WAITING:
                if not remote.try_admit(req, step):
                    step.blocks_short = True
                    return
                self._queue.popleft()
                continue
            if step.budget_left == 0:
                return
            is_new = req.status is RequestStatus.WAITING
            hit = self.kv.find_prefix_hit(req, defer_tier_run=is_new)  # the rest: external
            num_external = (
                self.external.get_num_new_matched_tokens(req, hit.num_tokens) if is_new else 0
            )
            num_computed = hit.num_tokens + num_external
            assert num_external % self.kv.block_size == 0 and num_computed < req.num_tokens, (
                f"request {req.request_id}: {num_external} tokens to load after {hit.num_tokens}"
            )
            n = chunk_size(self.config, req.num_tokens - num_computed, step)
            if n == 0:
                return
            if self.kv.try_allocate_slots(req, num_external + n, hit) is None:
                step.blocks_short = True
                return
            self._queue.popleft()
            req.num_computed_tokens = num_computed
            if is_new:
                req.num_cached_tokens = num_computed
                first = len(hit.block_ids)
                loaded = req.block_ids[first : first + num_external // self.kv.block_size]
                self.external.update_state_after_alloc(req, loaded, num_external)
            req.status = RequestStatus.RUNNING
            running.insert(req)
            step.add(req, n)
            logger.debug(
                "request %s admitted: %d tokens cached, %d loaded, %d to compute",
                req.request_id, hit.num_tokens, num_external, req.num_tokens - num_computed,
            )  # fmt: skip
