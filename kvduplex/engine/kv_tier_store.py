"""The KV tier that instances share: a distributed KV store (Mooncake's) below every pool,
so a block one instance demoted is loaded by another (prefill loads what decode demoted,
a second prefill what the first stored). Entries::

    key     kvduplex/<layout id, hex>/<block key, hex>
    value   [ header (128 B) | payload: bytes_per_block ]      (a slot of kv_tier.py, unpadded)

The layout id (model identity, shapes, dtype) keeps two models from ever sharing an
entry, and a load checks the header and CRC-32 as the other tiers do: an entry that
fails is counted, removed from the store and recomputed, never used.

Threads and deadlines::

    engine thread ──put, queued──────────────────────► writer thread ──► store
                  ──exists / get, waited ≤ timeout_s──► reader thread ──► store

A demoted block is copied into one of a few staging buffers on the engine thread and
put by the writer; until that put is done, the block is found and loaded from its
buffer. When every buffer's put is in flight, a demotion waits for the oldest one,
``timeout_s`` at most over a burst of demotions, then drops. A prefix lookup
(`find_run`: one batched existence check) waits at most ``timeout_s``, and the loads of
its run ``timeout_s`` in all: a slow store shortens the run, the rest is computed.

A call that fails or outlives ``timeout_s`` marks the store down (`StoreHealth`): for
``retry_s`` (doubling while it keeps failing) lookups answer none, loads miss and
demoted blocks are dropped, each counted in `TierStats.num_unavailable`; then the store
is tried again, unless a late call still holds the reader. A store that dies or hangs
thus costs the engine a deadline or two per retry at most, and its prompts are computed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any
from typing import TypeVar

import numpy as np
import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.kv_store_client import StoreClient
from kvduplex.engine.kv_store_client import StoreError
from kvduplex.engine.kv_store_client import StoreHealth
from kvduplex.engine.kv_store_client import StoreWorker
from kvduplex.engine.kv_store_client import exist_flags
from kvduplex.engine.kv_store_client import wait_at_most
from kvduplex.engine.kv_tier import TierStats
from kvduplex.engine.kv_tier_format import HEADER_BYTES
from kvduplex.engine.kv_tier_format import HEADER_FIELDS_BYTES
from kvduplex.engine.kv_tier_format import entry_header
from kvduplex.engine.kv_tier_format import entry_problem
from kvduplex.engine.kv_tier_format import layout_id_of
from kvduplex.model.dtypes import dtype_from_name

logger = logging.getLogger(__name__)

T = TypeVar("T")

STAGING_BUFFERS = 16
"""Demoted blocks whose put may be in flight at once. Past that, a demotion waits for the
oldest put, `StoreTier.timeout_s` at most over a burst, and is dropped if it is still in
flight."""


@dataclass
class _Staged:
    buffer: int
    write: Future[None]
    since: float
    is_late: bool = False


class StoreTier:
    """A `KVTier` over a shared store. Engine thread only (its writer thread aside)."""

    def __init__(
        self,
        layout: KVCacheLayout,
        identity: bytes,
        num_slots: int,
        connect: Callable[[], StoreClient],
        *,
        timeout_s: float = 1.0,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        make_worker: Callable[[str], StoreWorker] = StoreWorker,
    ) -> None:
        """`connect` makes the client; it runs on the reader thread (it may block long
        while the store is unreachable) at once and again after failures. `num_slots`:
        the share of the store this instance counts on (the router's horizon).
        `make_worker(name)`: the reader's and the writer's thread (tests pass workers that
        tell when their calls end)."""
        if num_slots < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        self.layout = layout
        self.block_shape = layout.shape[:2] + layout.shape[3:]  # (L, 2, BS, H, D)
        self.payload_bytes = layout.bytes_per_block
        self.entry_bytes = HEADER_BYTES + self.payload_bytes
        self.dtype = dtype_from_name(layout.dtype)
        self.layout_id = layout_id_of(layout, identity)
        self.stats = TierStats()
        self.timeout_s = timeout_s
        self.health = StoreHealth(retry_s, clock)
        self._clock = clock
        self._num_slots = num_slots
        self._prefix = f"kvduplex/{self.layout_id.hex()}/"
        self._buffers = [
            torch.zeros(self.entry_bytes, dtype=torch.uint8) for _ in range(STAGING_BUFFERS)
        ]
        self._buffer_writes: list[Future[None] | None] = [None] * STAGING_BUFFERS
        self._read_buffer = torch.empty(self.entry_bytes, dtype=torch.uint8)
        self._staged: dict[BlockHash, _Staged] = {}
        self._written: OrderedDict[BlockHash, None] = OrderedDict()
        """Keys this instance put, most recent last, at most `num_slots` (`num_used`)."""
        self._repair: set[BlockHash] = set()
        """Keys whose entry failed its check: their next put replaces it."""
        self._connect = connect
        self._client: StoreClient | None = None
        self._reader = make_worker("kvduplex-kv-store-read")
        self._writer = make_worker("kvduplex-kv-store-write")
        self._connecting: Future[None] | None = None
        self._is_closed = False
        self._stuck: Future[Any] | None = None
        """A reader call past its deadline, until it returns."""
        self._stuck_what = ""
        self._stuck_since = 0.0
        self._stuck_is_late = False
        self._run: set[BlockHash] = set()
        """The keys the last lookup found in the store: their loads share a budget."""
        self._run_loads_end = 0.0
        """When that budget ends (`time.monotonic`)."""
        self._num_waited_s = 0.0
        """Seconds demotions of the current burst waited for a staging buffer."""
        self._try_connect()

    # ---- KVTier ----

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_used(self) -> int:
        return len(self._written)

    def store_key(self, key: BlockHash) -> str:
        """The store's key of the entry of block `key`."""
        return self._prefix + key.hex()

    def contains(self, key: BlockHash) -> bool:
        return self.find_run([key]) == 1

    def touch(self, key: BlockHash) -> None:
        pass  # the store keeps its own recency

    def find_run(self, keys: Sequence[BlockHash]) -> int:
        """Also starts the budget of the loads of the run: together they wait for the store
        `timeout_s` at most."""
        self._reap()
        ask = [key for key in keys if key not in self._staged]
        held: set[BlockHash] = set()
        if ask:
            names = [self.store_key(key) for key in ask]
            found = self._call("a lookup", lambda client: exist_flags(client, names))
            held = {key for key, is_held in zip(ask, found or (), strict=False) if is_held}
        self._run_loads_end = time.monotonic() + self.timeout_s
        self._run = held
        num_held = 0
        for key in keys:
            if key not in self._staged and key not in held:
                break
            num_held += 1
        return num_held

    def store(self, key: BlockHash, block: torch.Tensor) -> None:
        self._reap()
        if key in self._staged:
            return
        client = self._client
        index = None
        if client is not None and self.health.can_try():
            index = self._free_buffer()
            if index is None:
                index = self._wait_for_buffer()
            else:
                self._num_waited_s = 0.0  # the burst, if any, is over
        if client is None or index is None:
            self.stats.num_unavailable += 1  # down, or a put is late
            self._try_connect()
            return
        buffer = self._buffers[index]
        buffer[HEADER_BYTES:].view(self.dtype).view(self.block_shape).copy_(block)
        replace = key in self._repair
        self._repair.discard(key)
        write = self._writer.submit(lambda: self._put(client, key, buffer, replace))
        self._buffer_writes[index] = write
        self._staged[key] = _Staged(index, write, self._clock())
        self.stats.num_stored_blocks += 1

    def load(self, key: BlockHash, out: torch.Tensor) -> bool:
        self._reap()
        staged = self._staged.get(key)
        if staged is not None:  # its put is in flight: the buffer holds the block
            payload = self._buffers[staged.buffer][HEADER_BYTES:]
            out.copy_(payload.view(self.dtype).view(self.block_shape))
            self.stats.num_loaded_blocks += 1
            return True
        name = self.store_key(key)
        budget_s = self._run_loads_end - time.monotonic() if key in self._run else None
        data = self._call("a load", lambda client: client.get(name), budget_s)
        if not data:  # unavailable, or absent (the store answers an empty value)
            return False
        if len(data) != self.entry_bytes:
            return self._corrupt(key, f"{len(data)} bytes, not {self.entry_bytes}")
        entry = self._read_buffer
        entry.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        header = entry[:HEADER_FIELDS_BYTES].numpy().tobytes()
        payload = entry[HEADER_BYTES:]
        problem = entry_problem(
            key, self.layout_id, self.payload_bytes, header, payload.numpy().data
        )
        if problem is not None:
            return self._corrupt(key, problem)
        out.copy_(payload.view(self.dtype).view(self.block_shape))
        self.stats.num_loaded_blocks += 1
        self.stats.num_read_bytes += self.entry_bytes
        return True

    def joined(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for the join in progress; whether the store is joined."""
        if self._connecting is not None:
            wait_at_most(self._connecting, timeout_s)
        return self._client is not None

    def flush(self) -> None:
        """Wait for the puts in flight, each at most `timeout_s`."""
        for staged in list(self._staged.values()):
            wait_at_most(staged.write, self.timeout_s)
        self._reap()

    def close(self) -> None:
        """Finish the puts in flight and leave the store, waiting a few deadlines at most
        (a hung store is left to its threads, which never hold up the process's exit)."""
        self.flush()
        self._is_closed = True
        client, self._client = self._client, None
        if client is not None:
            wait_at_most(self._reader.submit(client.close), self.timeout_s)
        self._reader.stop()
        self._writer.stop()

    # ---- internals ----

    def _try_connect(self) -> None:
        """Start connecting on the reader thread, unless connected, connecting, or waiting
        to retry."""
        if self._client is not None or self._is_closed or not self.health.can_try():
            return
        if self._connecting is not None and not self._connecting.done():
            return
        self._connecting = self._reader.submit(self._join)

    def _join(self) -> None:
        """Reader thread: make the client."""
        try:
            client = self._connect()
        except Exception as exc:
            self.health.failed(f"cannot join the store ({exc})")
            return
        if self._is_closed:  # closed while joining
            client.close()
            return
        self._client = client
        self.health.succeeded("joined the store")

    def _call(
        self, what: str, call: Callable[[StoreClient], T], budget_s: float | None = None
    ) -> T | None:
        """`call` run on the reader, waited for at most `timeout_s` (and `budget_s`, what
        is left of a prefix lookup's); None, counted, if the store is down, the call
        failed, or it is late: past `timeout_s` the store is marked down; past the budget
        alone the call is only left to finish (no call goes out until it has)."""
        client = self._client
        self._check_stuck()
        wait_s = self.timeout_s if budget_s is None else min(self.timeout_s, budget_s)
        if client is None or self._stuck is not None or wait_s <= 0 or not self.health.can_try():
            self.stats.num_unavailable += 1
            self._try_connect()
            return None
        future = self._reader.submit(lambda: call(client))
        try:
            result = future.result(timeout=wait_s)
        except TimeoutError:
            self._stuck, self._stuck_what, self._stuck_is_late = future, what, False
            self._stuck_since = time.monotonic() - wait_s
            self._check_stuck()
        except Exception as exc:
            self.health.failed(f"{what} failed: {exc}")
        else:
            self.health.succeeded()
            return result
        self.stats.num_unavailable += 1
        return None

    def _check_stuck(self) -> None:
        """Forget the late reader call if it has returned; mark the store down once if it
        has run past `timeout_s` (a call cut short by a lookup's budget may not have)."""
        stuck = self._stuck
        if stuck is None:
            return
        if stuck.done():
            self._stuck = None
        elif not self._stuck_is_late and time.monotonic() - self._stuck_since >= self.timeout_s:
            self._stuck_is_late = True
            self.health.failed(f"{self._stuck_what} took longer than {self.timeout_s} s")

    def _put(
        self, client: StoreClient, key: BlockHash, buffer: torch.Tensor, replace: bool
    ) -> None:
        """Writer thread: checksum a staged block and put it (replacing a bad entry)."""
        try:
            header = entry_header(key, self.layout_id, buffer[HEADER_BYTES:].numpy().data)
            buffer.numpy()[: len(header)] = np.frombuffer(header, dtype=np.uint8)
            put = client.upsert if replace else client.put
            code = put(self.store_key(key), buffer.numpy().data)
            if code != 0:
                raise StoreError(f"put returned {code}")
        except Exception as exc:
            self.stats.num_write_failures += 1
            self.health.failed(f"a write failed: {exc}")
            raise
        self.stats.num_written_bytes += self.entry_bytes
        self.health.succeeded()

    def _reap(self) -> None:
        """Forget the staged blocks whose put is done; a put past its deadline marks the
        store down (once)."""
        now = self._clock()
        for key, staged in list(self._staged.items()):
            if staged.write.done():
                del self._staged[key]
                if staged.write.exception() is None:
                    self._written[key] = None
                    self._written.move_to_end(key)
                    if len(self._written) > self._num_slots:
                        self._written.popitem(last=False)
            elif not staged.is_late and now - staged.since > self.timeout_s:
                staged.is_late = True
                self.health.failed(f"a write took longer than {self.timeout_s} s")

    def _wait_for_buffer(self) -> int | None:
        """Every staging buffer's put is in flight: wait for the oldest, `timeout_s` at
        most over a burst of demotions (a put that takes longer marks the store down); a
        free buffer, if any."""
        oldest = min(self._staged.values(), key=lambda staged: staged.since)
        wait_s = self.timeout_s - self._num_waited_s
        if wait_s <= 0:
            return None
        started = time.monotonic()
        wait_at_most(oldest.write, wait_s)
        self._num_waited_s += time.monotonic() - started
        self._reap()
        index = self._free_buffer()
        if index is None and not oldest.is_late and wait_s >= self.timeout_s:
            oldest.is_late = True
            self.health.failed(f"a write took longer than {self.timeout_s} s")
        return index

    def _free_buffer(self) -> int | None:
        """A staging buffer no staged block uses (a block whose put ended after `_reap`
        still does: loads read it from there)."""
        used = {staged.buffer for staged in self._staged.values()}
        for index, write in enumerate(self._buffer_writes):
            if index not in used and (write is None or write.done()):
                return index
        return None

    def _corrupt(self, key: BlockHash, problem: str) -> bool:
        self.stats.num_corrupt_blocks += 1
        logger.warning(
            "KV store: the entry of block %s is corrupt (%s); removed, its tokens are "
            "recomputed", key.hex()[:12], problem,
        )  # fmt: skip
        self._repair.add(key)
        client, name = self._client, self.store_key(key)
        if client is not None:
            self._writer.submit(lambda: client.remove(name, True))
        return False


__all__ = ["STAGING_BUFFERS", "StoreTier"]
