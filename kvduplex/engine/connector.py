"""The seam between the engine step and KV transfer between instances.

As in vLLM's v1 KV connector, a connector has a *scheduler side* (what to
transfer, and when a request may go on) and a *worker side* (moving KV while
the model runs), and the engine never knows which role it plays::

    out = scheduler.schedule()
    connector.on_scheduled(out)                       # scheduler side
    runner.execute(..., on_layer_done=connector.layer_hook(out))   # worker side
    finished = scheduler.update(out, sampled)
    connector.on_step_done(out, sampled, finished)    # scheduler side

`KVConnector` has a no-op default for every hook: a connector overrides only
what its flow needs, and `KVConnector()` itself is the colocated instance.
All hooks run on the engine thread.

Connectors reach the engine only through `EngineHandle`: blocks through the
KV manager (the one memory API), requests through the scheduler's remote-KV
transitions, and other threads through `call`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING
from typing import Any

from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.request import Request
from kvduplex.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from kvduplex.engine.async_engine import AsyncEngine
    from kvduplex.engine.engine import LLMEngine


class KVConnector:
    """Base and colocated connector: every hook does nothing."""

    # ---- scheduler side ----

    def on_scheduled(self, out: SchedulerOutput) -> None:
        """After `schedule()`, before the forward: e.g. register the blocks that
        ``out.remote_kv_allocated`` requests expect, or plan this step's WRITEs."""

    def on_step_done(
        self, out: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> None:
        """After `update()`: e.g. end pushes whose first token was sampled."""

    def on_finished(self, finished: list[Request]) -> None:
        """Requests that finished (not aborted), once their final outputs were made, however
        they finished (the step's `update()`, a stop string, a first token that came with
        remote KV). One added with ``hold_blocks_on_finish`` still holds its blocks: e.g.
        offer a finished turn."""

    def on_aborted(self, request: Request) -> None:
        """A request was aborted (by its client, or by a flow), whether or not it was
        ever admitted, even if it never reached the scheduler (its client left while
        it was queued for the engine). Its blocks are freed already, save those the
        connector holds itself: e.g. cancel its transfers and drop its flow state."""

    def take_updated_requests(self) -> list[Request]:
        """Requests the connector changed outside the step (e.g. remote KV arrived
        with a first token); the engine reports their new output."""
        return []

    def has_pending_work(self) -> bool:
        """True while transfers are in flight that need the engine loop to keep stepping."""
        return False

    # ---- worker side ----

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """A callback the runner calls with a layer's index once its KV is in the pool."""
        return None


class EngineHandle:
    """What a connector may do to its engine. Engine thread only, except `call`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._async = engine
        self._engine: LLMEngine = engine.core

    # ---- threads ----

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn()`` on the engine thread between steps (from any thread). An error it
        raises is logged under its name (and set on the Future); with the engine loop
        ended, the Future has already failed with EngineDeadError."""
        from kvduplex.engine.async_engine import describe_call

        return self._async.call(lambda _e: fn(), label=describe_call(fn))

    @property
    def is_healthy(self) -> bool:
        """The engine loop runs and makes progress (heartbeats stop when it does not: a
        crashed, stopped or wedged engine)."""
        return self._async.is_healthy

    # ---- layout ----

    @property
    def block_size(self) -> int:
        return self._engine.kv_manager.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._engine.kv_manager.pool.num_blocks

    @property
    def identity(self) -> bytes:
        """Model and dtype identity that enters every block key."""
        return self._engine.kv_manager.identity

    # ---- blocks ----

    def acquire_blocks(self, block_ids: Sequence[int]) -> None:
        self._engine.kv_manager.acquire_blocks(block_ids)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        self._engine.kv_manager.release_blocks(block_ids)

    def num_cached_prefix(self, keys: Sequence[BlockHash]) -> int:
        return self._engine.kv_manager.num_cached_prefix(keys)

    def try_allocate_blocks(self, num_blocks: int) -> list[int] | None:
        return self._engine.kv_manager.try_allocate_blocks(num_blocks)

    def cache_blocks(self, block_ids: Sequence[int], keys: Sequence[BlockHash]) -> int:
        return self._engine.kv_manager.cache_blocks(block_ids, keys)

    # ---- requests ----

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished or held request."""
        return self._engine.scheduler.get_request(request_id)

    def abort(self, request_id: str) -> bool:
        return self._engine.abort_request(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free a finished request's held blocks; False if none are held."""
        return self._engine.scheduler.release_held(request_id)

    def resume_with_first_token(self, request_id: str, first_token: int) -> Request:
        """Remote KV and the first token arrived: decode on. KeyError if not waiting."""
        return self._engine.resume_with_first_token(request_id, first_token)

    def resume_after_read(self, request_id: str) -> None:
        """Remote KV arrived without a first token: recompute the last prompt token.
        KeyError if not waiting."""
        self._engine.scheduler.on_remote_kv_done(request_id, None)

    def compute_locally(self, request_id: str, *, discard_blocks: bool) -> None:
        """Remote KV will not come: prefill here (into fresh blocks with `discard_blocks`,
        when a late WRITE could still land in the registered ones). KeyError if not waiting."""
        self._engine.scheduler.on_remote_kv_failed(request_id, discard_blocks=discard_blocks)
