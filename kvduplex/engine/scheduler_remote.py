"""Requests waiting for their prompt's KV from another instance (WAITING_FOR_REMOTE_KV).

On admission a request with ``remote_kv`` gets blocks for its whole prompt (past
its local prefix hit) and parks here, costing no token budget, until the
connector reports on its transfer: the KV arrived (it decodes on from the
sender's first token, or recomputes its last prompt token here), or it will not
come (it prefills the uncached part here). Either way it joins the running
requests.
"""

from __future__ import annotations

import logging

from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.engine.scheduler_output import BlockTableTracker
from kvduplex.engine.scheduler_output import RemoteKVAllocation
from kvduplex.engine.scheduler_output import StepBuilder
from kvduplex.engine.scheduler_running import RunningRequests

logger = logging.getLogger(__name__)


class RemoteKVWaits:
    """The requests of one scheduler that wait for remote KV, by id; sized.

    Single-threaded, as its scheduler.
    """

    def __init__(
        self, kv_manager: KVCacheManager, tables: BlockTableTracker, running: RunningRequests
    ) -> None:
        self.kv = kv_manager
        self.tables = tables
        self._running = running
        self._requests: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def remove(self, req: Request) -> None:
        """Stop waiting for `req` (it finishes)."""
        del self._requests[req.request_id]

    def try_admit(self, req: Request, step: StepBuilder) -> bool:
        """Allocate blocks for the whole prompt and wait for the sender to fill them; False
        if the blocks are not there now (the caller keeps it queued)."""
        assert req.remote_kv is not None
        hit = self.kv.find_prefix_hit(req, allow_full_hit=True)
        if self.kv.try_allocate_slots(req, req.num_prompt_tokens - hit.num_tokens, hit) is None:
            return False
        req.num_computed_tokens = hit.num_tokens
        req.num_cached_tokens = hit.num_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._requests[req.request_id] = req
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

    def kv_arrived(self, request_id: str, first_token: int | None) -> Request:
        """The sender filled the prompt's blocks: the request runs, from `first_token`
        (appended by the caller) or, without one, recomputing its last prompt token.
        Raises KeyError if the request is not waiting for remote KV."""
        req = self._pop(request_id)
        if first_token is None:
            self._resume_locally(req, req.num_prompt_tokens - 1)
        else:
            req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_full_blocks(req)
        req.status = RequestStatus.RUNNING
        self._running.insert(req)
        logger.debug("request %s: remote KV done (first token %s)", request_id, first_token)
        return req

    def kv_failed(self, request_id: str, *, discard_blocks: bool) -> None:
        """The remote KV will not come: the request runs, prefilling the uncached part
        (into fresh blocks with `discard_blocks`; see `Scheduler.on_remote_kv_failed`).
        Raises KeyError if the request is not waiting for remote KV."""
        req = self._pop(request_id)
        if discard_blocks:
            self.tables.forget(request_id)
            self.kv.drop_tail(req, req.num_cached_tokens // self.kv.block_size)
        self._resume_locally(req, min(req.num_cached_tokens, req.num_prompt_tokens - 1))
        req.status = RequestStatus.RUNNING
        self._running.insert(req)
        logger.warning(
            "request %s: remote KV failed (transfer %s); prefilling %d tokens locally",
            request_id,
            req.remote_kv.transfer_id if req.remote_kv else "?",
            req.num_prompt_tokens - req.num_computed_tokens,
        )

    def _pop(self, request_id: str) -> Request:
        req = self._requests.pop(request_id, None)
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
