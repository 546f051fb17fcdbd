"""`EngineHandle`: what a KV connector may do to its engine (see `connector`)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.commands import describe_call
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.eviction import ReleaseTag
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.request import Request


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

    def release_blocks(self, block_ids: Sequence[int], tag: ReleaseTag | None = None) -> None:
        """`tag`: the class the blocks take on (`ReleaseTag.returned` for a duplex
        return's; None: a transfer's reference, which changes no block's class)."""
        self._engine.kv_manager.release_blocks(block_ids, tag)

    def num_cached_prefix(self, keys: Sequence[BlockHash]) -> int:
        return self._engine.kv_manager.num_cached_prefix(keys)

    def num_held_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading `keys` the pool holds or a lookup would promote from the KV
        tier (`KVCacheManager.num_held_prefix`); nothing loaded."""
        return self._engine.kv_manager.num_held_prefix(keys)

    def cached_prefix(self, keys: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of `keys` (promoted from the KV tier if
        need be); no references taken."""
        return self._engine.kv_manager.cached_prefix(keys)

    def try_allocate_blocks(self, num_blocks: int) -> list[int] | None:
        return self._engine.kv_manager.try_allocate_blocks(num_blocks)

    def cache_blocks(
        self, block_ids: Sequence[int], keys: Sequence[BlockHash], origin: HitSource | None = None
    ) -> int:
        """`origin`: where the blocks' KV came from (`KVCacheManager.cache_blocks`)."""
        return self._engine.kv_manager.cache_blocks(block_ids, keys, origin)

    def count_loaded(self, num_blocks: int, source: HitSource) -> None:
        """Prompt blocks loaded from `source` instead of computed (`KVCacheManager`)."""
        self._engine.kv_manager.count_loaded(num_blocks, source)

    # ---- requests ----

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished or held request, to read (the scheduler alone changes it)."""
        return self._engine.scheduler.get_request(request_id)

    def abort(self, request_id: str) -> bool:
        return self._engine.abort_request(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free a finished request's held blocks; False if none are held."""
        return self._engine.scheduler.release_held(request_id)
