"""A long KV tier hit loaded layer by layer while the request's first forward runs
(vLLM's ``start_load_kv`` / ``wait_for_layer_load``, SGLang HiCache's layer-wise load
from host), as the fetch plan's prefix load is (`kvduplex.kvflow.prefix_load`).

::

    admission   the lookup leaves a tier run of at least `min_blocks` unpromoted;
                get_num_new_matched_tokens offers it, the scheduler allocates its blocks
                with the first chunk and counts them computed; update_state_after_alloc
                pins the run's slots and plans the load
    start       one job on the loader thread: for each layer, for each load of the step,
                read that layer of every block into the pool and check its CRC; then the
                layer is done (a condition, one count per step)
    layer l     the forward waits until layer l is done, then layer l's attention reads
                the pool; a load found unusable (corrupt, cut short, unreadable, its slot
                lost) reads nothing more and its connector hears so before the layer
    after       finish: the job is stopped and joined (nothing reads or writes for it any
                more), the slots unpinned, unusable entries dropped and counted; the
                requests whose load failed are void (they compute their prompt from their
                local hit; the scheduler caches nothing of the step)

    prompt   [ pool hit | tier run: read layer by layer | new tokens (this chunk) ... ]

A load lives within one step: by its end every layer landed (the blocks are cached
with the step, as computed ones are) or the load failed (the step is void and the
blocks are freed uncached), and the loader has let go of the pool and the tier.

Threads: the engine thread plans, starts, waits and finishes; the loader thread only
reads slots into the loads' own pool blocks (``pread``, ``crc32`` and ``copy_`` release
the GIL) and sets the fields `TierLoad` marks as its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field

import torch

from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.kv_manager import KVCacheManager
from kvduplex.engine.kv_tier import Bytes
from kvduplex.engine.kv_tier import LayerSource
from kvduplex.engine.kv_tier import SlotTier
from kvduplex.engine.request import Request
from kvduplex.engine.tier_link import is_deferrable

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TierLoad:
    """One request's tier run, read into `block_ids` (block i from ``sources[i]``)."""

    request_id: str
    block_ids: list[int]
    sources: list[LayerSource]
    failed: str | None = None
    """Why the load cannot be used (set by the loader, or at planning); None: fine so far."""
    problems: dict[BlockHash, str] = field(default_factory=dict)
    """Loader: entries found unusable, by key (dropped at `TierLoads.finish`)."""
    is_reported: bool = False
    """Engine thread: its failure was passed to ``on_failed``."""
    waited_s: float = 0.0
    """How long the forward's layers waited for this step's reads (timings)."""


@dataclass(eq=False)
class TierJob:
    """One step's loads, read by the loader thread layer by layer."""

    loads: list[TierLoad]
    num_layers_done: int = 0
    is_ended: bool = False
    is_cancelled: bool = False
    started_at: float = 0.0
    layer_done_at: list[float] = field(default_factory=list)
    """When each layer was read for every load (monotonic; timings)."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    future: Future[None] | None = None


class TierLoads:
    """The layer-wise loads of tier hits: what admission offers, and each step's loads.

    Engine thread only, but for the loader thread it owns."""

    def __init__(
        self, tier: SlotTier, kv_pool: torch.Tensor, kv: KVCacheManager, min_blocks: int
    ) -> None:
        """`kv_pool`: (num_layers, 2, num_blocks, block_size, heads, dim); `min_blocks`: the
        shortest run loaded layer by layer (the lookup promotes shorter ones before)."""
        if min_blocks < 1:
            raise ValueError(f"a layer-wise tier load needs at least one block, got {min_blocks}")
        self.tier = tier
        self.kv_pool = kv_pool
        self.kv = kv
        self.min_blocks = min_blocks
        self.num_layers = kv_pool.shape[0]
        # A host pool is read into in place, through its bytes (numpy views cost the loader
        # far less than tensor views); a device pool through one host layer and a side
        # stream.
        self._pool_bytes: Bytes | None = None
        self._staging: Bytes | None = None
        self._stream: torch.cuda.Stream | None = None
        if kv_pool.device.type == "cpu":
            self._pool_bytes = kv_pool.view(torch.uint8).numpy()
        else:
            self._staging = torch.empty(tier.layer_bytes, dtype=torch.uint8).numpy()
            self._stream = torch.cuda.Stream(kv_pool.device)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvduplex-tier-load")
        self._offered: dict[str, int] = {}
        self._planned: list[TierLoad] = []
        self.num_loaded_blocks = 0
        self.num_failed = 0
        self.last: TierJob | None = None
        """The last job started (tests, timings)."""
        self.is_closed = False

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int:
        """The tier's run right after the local hit (the prompt's last token left out), if
        the lookup left it for a layer-wise load (`is_deferrable`); 0 otherwise."""
        bs = self.kv.block_size
        first = num_computed_tokens // bs
        keys = req.block_hashes[first : (req.num_tokens - 1) // bs]
        num_run = self.tier.find_run(keys) if keys and not self.is_closed else 0
        if not is_deferrable(keys[:num_run], keys, self.kv.pool, self.min_blocks):
            return 0
        self._offered[req.request_id] = num_run * bs
        return num_run * bs

    def offered(self, req: Request) -> int:
        """The tokens offered to `req` at this step's admission (0: none)."""
        return self._offered.get(req.request_id, 0)

    def update_state_after_alloc(
        self, req: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """`block_ids` (after the local hit) take the offered run: pin its slots, plan it."""
        self._offered.pop(req.request_id, None)
        if num_external_tokens == 0 or not block_ids:
            return
        first = req.block_ids.index(block_ids[0])
        keys = req.block_hashes[first : first + len(block_ids)]
        load = TierLoad(req.request_id, list(block_ids), self.tier.pin(keys))
        if len(load.sources) < len(block_ids):  # evicted by the allocation just made
            load.failed = "its entries left the tier before the load"
        self._planned.append(load)

    def take_planned(self) -> list[TierLoad]:
        """The loads this step's forward reads (planned at its admissions)."""
        planned, self._planned = self._planned, []
        self._offered.clear()
        return planned

    # ---- worker side ----

    def start(self, loads: list[TierLoad]) -> TierJob | None:
        """Before the forward: hand this step's loads to the loader thread, layer 0 first."""
        if not loads:
            return None
        job = TierJob(loads, started_at=time.monotonic())
        self.last = job
        if self.is_closed:
            for load in loads:
                load.failed = load.failed or "the tier is closed"
            job.is_ended = True
            return job
        try:
            job.future = self._loader.submit(self._run, job)
        except RuntimeError:  # closed meanwhile (from another thread)
            for load in loads:
                load.failed = load.failed or "the tier is closed"
            job.is_ended = True
        return job

    def layer_wait(
        self, job: TierJob | None, on_failed: Callable[[str, str], None]
    ) -> Callable[[int], None] | None:
        """The layer hook's part: before layer l's attention, wait until layer l of every
        load of `job` was read; then tell ``on_failed(request_id, reason)`` of each load
        found unusable so far (once)."""
        if job is None:
            return None

        def wait_for_layer_load(layer: int) -> None:
            t0 = time.monotonic()
            with job.cond:
                job.cond.wait_for(lambda: job.num_layers_done > layer or job.is_ended)
            waited = time.monotonic() - t0
            for load in job.loads:
                load.waited_s += waited
                if load.failed is None and job.num_layers_done <= layer:
                    load.failed = "the load stopped before this layer"
                if load.failed is not None and not load.is_reported:
                    load.is_reported = True
                    on_failed(load.request_id, load.failed)

        return wait_for_layer_load

    def finish(self, job: TierJob | None, *, is_forward_done: bool = True) -> set[str]:
        """After the forward (also one that raised: not `is_forward_done`): stop and join the
        loader, unpin, drop the unusable entries; the requests whose load failed (their
        step is void). Only loads of a forward that ended count as loaded."""
        if job is None:
            return set()
        with job.cond:
            job.is_cancelled = True
            job.cond.notify_all()
        if job.future is not None:
            job.future.result()  # `_run` catches everything: this only joins
        failed: set[str] = set()
        for load in job.loads:
            if load.failed is None and job.num_layers_done < self.num_layers:
                load.failed = "the forward ended before the load"
            if load.failed is None and not is_forward_done:
                load.failed = "the forward failed"
            self.tier.unpin(load.sources, load.problems)
            if load.failed is not None:
                failed.add(load.request_id)
                self.num_failed += 1
                logger.warning(
                    "request %s: its %d-block tier load failed (%s); computing it",
                    load.request_id, len(load.block_ids), load.failed,
                )  # fmt: skip
                continue
            self.num_loaded_blocks += len(load.block_ids)
            self.tier.count_loaded(len(load.block_ids))
            self.kv.count_loaded(len(load.block_ids), HitSource.TIER)
        return failed

    def close(self) -> None:
        """Stop the loader thread (a job under way, or queued, stops at its next block and
        ends, so no forward waits for it in vain)."""
        self.is_closed = True
        self._loader.shutdown(wait=True)

    # ---- loader thread ----

    def _run(self, job: TierJob) -> None:
        try:
            for layer in range(self.num_layers):
                for load in job.loads:
                    self._read(job, load, layer)
                if job.is_cancelled or self.is_closed:  # a layer cut short is not done
                    break
                with job.cond:
                    job.num_layers_done = layer + 1
                    job.layer_done_at.append(time.monotonic())
                    job.cond.notify_all()
        except Exception as exc:  # never leave the forward waiting
            logger.exception("KV tier: the layer-wise load failed")
            for load in job.loads:
                load.failed = load.failed or f"the loader failed: {exc}"
        finally:
            with job.cond:
                job.is_ended = True
                job.cond.notify_all()

    def _read(self, job: TierJob, load: TierLoad, layer: int) -> None:
        """One layer of every block of `load` into the pool (nothing once it failed)."""
        for block_id, source in zip(load.block_ids, load.sources, strict=False):
            if load.failed is not None:
                return
            if job.is_cancelled or self.is_closed:
                load.failed = "stopped before its last layer"
                return
            pool = self._pool_bytes
            if pool is not None:
                problem = self.tier.read_layer(
                    source, layer, (pool[layer, 0, block_id], pool[layer, 1, block_id])
                )
            else:
                problem = self._read_to_device(source, layer, block_id)
            if problem is not None:
                load.problems[source.key] = problem
                load.failed = f"slot of block {source.key.hex()[:12]}, layer {layer}: {problem}"

    def _read_to_device(self, source: LayerSource, layer: int, block_id: int) -> str | None:
        """One layer of one block into a device pool: read and checked in host memory, then
        copied on the loader's own stream (waited for: the forward reads it next)."""
        assert self._staging is not None and self._stream is not None
        problem = self.tier.read_layer(source, layer, (self._staging,))
        if problem is None:
            out = self.kv_pool[layer, :, block_id]  # (2, block_size, heads, dim)
            data = torch.from_numpy(self._staging).view(out.dtype).view(out.shape)
            with torch.cuda.stream(self._stream):
                out.copy_(data)
            self._stream.synchronize()
        return problem


__all__ = ["TierJob", "TierLoad", "TierLoads"]
