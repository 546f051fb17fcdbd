"""The waiting queue: requests not yet admitted (WAITING) or preempted (PREEMPTED), and
their admission, first come first served, while seats, token budget and blocks last.

A request admitted to compute here takes its prefix-cache hit and its first chunk
and joins the running requests; one with ``remote_kv`` (never admitted before)
gets blocks for its whole prompt and waits for its KV instead, costing no budget.
Admission stops at the first request that does not fit, so none overtakes it.
"""

from __future__ import annotations

import logging
from collections import deque

from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.engine.scheduler_output import StepBuilder
from kvduplex.engine.scheduler_remote import RemoteKVWaits
from kvduplex.engine.scheduler_running import RunningRequests
from kvduplex.engine.scheduler_running import chunk_size

logger = logging.getLogger(__name__)


class WaitingQueue:
    """The requests of one scheduler waiting for admission, in order; sized.

    Single-threaded, as its scheduler.
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
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
                    return
                self._queue.popleft()
                continue
            if step.budget_left == 0:
                return
            hit = self.kv.find_prefix_hit(req)
            n = chunk_size(self.config, req.num_tokens - hit.num_tokens, step)
            if n == 0 or self.kv.try_allocate_slots(req, n, hit) is None:
                return
            self._queue.popleft()
            req.num_computed_tokens = hit.num_tokens
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            running.insert(req)
            step.add(req, n)
            logger.debug(
                "request %s admitted: %d tokens cached, %d to compute",
                req.request_id,
                hit.num_tokens,
                req.num_tokens - hit.num_tokens,
            )
