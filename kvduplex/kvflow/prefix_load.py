"""Prefill's layer-wise load of a fetched prefix: decode's blocks are READ layer by
layer while the prefill of the new tokens computes (vLLM's ``start_load_kv`` /
``wait_for_layer_load``, as push's WRITEs stream on the other side).

::

    route       Request(connector_meta=PrefixLoadSpec)          nothing posted yet
    admission   get_num_new_matched_tokens: the spec's blocks after the local hit whose
                keys are the prompt's (the last prompt token left out); the scheduler
                allocates them with the first chunk and counts them computed;
                update_state_after_alloc: the load is planned for this step
    start       one READ per layer into those blocks, in layer order
    layer l     wait (applying the inbox's LAYER events) until layer l's READ ended, then
                layer l's attention reads the blocks; a READ that failed, or did not end
                by its deadline, fails the load: no later wait, the request's push stops
    after       get_failed_loads: the requests whose step is void (they compute their
                prompt from their local hit; the scheduler caches nothing of the step)
    settled     once every READ settled (nothing can land any more): our references on
                the blocks go and ``on_settled`` runs (decode's lease is released)

    prompt   [ local hit | loaded: READ layer by layer | new tokens (this chunk) ... ]

The first forward of the request waits for every layer, so by its end the load
has landed (its blocks are cached with the step, as computed ones are) or
failed (the step is void). Engine thread only: the READs' ends come through
the flow inbox.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import field
from functools import partial

from kvduplex.engine.handle import EngineHandle
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.request import Request
from kvduplex.kvflow.flow_events import Granularity
from kvduplex.kvflow.flow_io import FlowIO
from kvduplex.kvflow.half import ReadRunner
from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.machines.read import Outcome
from kvduplex.kvflow.metrics import KVFlowMetrics
from kvduplex.transport.base import Transport
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import TransferHandle

logger = logging.getLogger(__name__)

WAIT_GRACE_S = 0.1
"""A layer's wait lasts this much past its READ's deadline (for the transport's own
failure to come through) before the load is taken as failed."""


@dataclass(eq=False)
class PrefixLoadSpec:
    """A prefill request's prefix to load from decode (its ``connector_meta``).

    Made by the route; the engine thread owns it once the request is added:
    ``done`` gets the tokens loaded (0: none, or the load failed) as soon as that is
    known, and ``on_settled()`` runs exactly once, on the engine thread, when nothing
    of it can read decode's blocks any more (never posted, or every READ settled).
    Remote block ``i`` holds the prompt's block ``i``.
    """

    peer: PeerHandle
    remote_block_ids: list[int]
    keys: list[str]
    """Hex block keys of ``remote_block_ids``, as decode computed them."""
    ends_at: float | None
    """Monotonic time by which every READ must end (decode's lease, less a margin)."""
    on_settled: Callable[[], None]
    done: Future[int] = field(default_factory=Future)
    is_used: bool = False
    """Admission took it (loaded or not): a request computed again does not load it."""
    is_released: bool = False

    def resolve(self, num_tokens: int) -> None:
        """The tokens loaded are known (the first word counts)."""
        if not self.done.done():
            self.done.set_result(num_tokens)

    def release(self) -> None:
        """Nothing of it reads decode's blocks any more: ``on_settled``, once."""
        if not self.is_released:
            self.is_released = True
            self.on_settled()


class LayerState(enum.Enum):
    PENDING = "pending"
    LANDED = "landed"
    FAILED = "failed"


class LayerLoad:
    """One request's load: a READ per layer of ``remote`` into ``block_ids``."""

    def __init__(
        self, request_id: str, spec: PrefixLoadSpec, block_ids: Sequence[int],
        remote: Sequence[int], num_layers: int,
    ) -> None:  # fmt: skip
        self.request_id = request_id
        self.spec = spec
        self.block_ids = list(block_ids)
        self.remote = list(remote)
        self.layers = [LayerState.PENDING] * num_layers
        self.failed: str | None = None
        self.wait_until = 0.0
        self.num_settled = 0
        self.landed_at: list[float | None] = [None] * num_layers
        """When each layer's READ landed, as its transport saw it (monotonic; timings)."""
        self.posted_at = 0.0
        self.waited_s = 0.0
        """How long the forward's layers waited for the READs (timings)."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class PrefixLoads:
    """Prefill's layer-wise prefix loads: the connector's part for them (engine thread)."""

    def __init__(
        self, transport: Transport, engine: EngineHandle, inbox: FlowInbox, io: FlowIO,
        deadline_s: float, on_failed: Callable[[str, str], None],
        metrics: KVFlowMetrics | None = None,
    ) -> None:  # fmt: skip
        """``deadline_s``: one READ's deadline at most; ``on_failed(request_id, reason)``:
        a load failed (the push of that request stops: its step's KV is garbage)."""
        self.transport = transport
        self.engine = engine
        self.inbox = inbox
        self.io = io
        self.deadline_s = deadline_s
        self.on_failed = on_failed
        self.metrics = metrics
        self.num_layers = transport.layout.num_layers
        self._planned: dict[str, LayerLoad] = {}
        self._loads: dict[str, LayerLoad] = {}
        """Started, until every READ settled."""
        self._failed: set[str] = set()
        self.num_loaded_blocks = 0
        self.num_failed = 0
        self.last: LayerLoad | None = None
        """The last load started (tests, timings)."""

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int:
        """The spec's tokens after the local hit whose keys are the prompt's (the prompt's
        last token left out), if its READs can still end in time."""
        spec = req.connector_meta
        if not isinstance(spec, PrefixLoadSpec) or spec.is_used:
            return 0
        if spec.ends_at is not None and spec.ends_at <= time.monotonic():
            return 0
        bs = self.engine.block_size
        num_blocks = min(len(spec.keys), len(spec.remote_block_ids), (req.num_tokens - 1) // bs)
        hashes = req.block_hashes  # up to date: admission just looked the prefix up
        num_match = 0
        for i in range(min(num_blocks, len(hashes))):
            if bytes(hashes[i]).hex() != spec.keys[i]:
                break
            num_match += 1
        return max(0, num_match * bs - num_computed_tokens)

    def update_state_after_alloc(
        self, req: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        spec = req.connector_meta
        if not isinstance(spec, PrefixLoadSpec) or spec.is_used:
            return
        spec.is_used = True
        if num_external_tokens == 0:
            spec.resolve(0)
            spec.release()
            return
        first = req.block_ids.index(block_ids[0])  # the loaded blocks follow the local hit
        remote = spec.remote_block_ids[first : first + len(block_ids)]
        self._planned[req.request_id] = LayerLoad(
            req.request_id, spec, block_ids, remote, self.num_layers
        )

    def take_planned(self) -> list[LayerLoad]:
        """The loads this step's forward reads (planned at its admissions)."""
        planned = list(self._planned.values())
        self._planned.clear()
        return planned

    def request_finished(self, req: Request) -> None:
        """A request that never posted its load gives the spec up (the lease goes now)."""
        spec = req.connector_meta
        if isinstance(spec, PrefixLoadSpec) and req.request_id not in self._loads:
            self._planned.pop(req.request_id, None)
            spec.is_used = True
            spec.resolve(0)
            spec.release()

    # ---- worker side ----

    def start(self, loads: list[LayerLoad]) -> None:
        """Before the forward: post each load's READs, one per layer, layer 0 first."""
        now = time.monotonic()
        for load in loads:
            self.last = load
            deadline_s = self.deadline_s
            if load.spec.ends_at is not None:
                deadline_s = min(deadline_s, load.spec.ends_at - now)
            if deadline_s <= 0:
                self._fail(load, "decode's lease ran out before the READ")
                load.spec.release()
                continue
            self._loads[load.request_id] = load
            load.posted_at = now
            load.wait_until = now + deadline_s + WAIT_GRACE_S
            for layer in range(self.num_layers):
                self._post(load, layer, deadline_s)

    def _post(self, load: LayerLoad, layer: int, deadline_s: float) -> None:
        def on_outcome(o: Outcome, handle: TransferHandle | None) -> None:  # engine thread
            if o.ok and handle is not None:
                load.layers[layer] = LayerState.LANDED
                load.landed_at[layer] = handle.finished_at or time.monotonic()
                if all(s is LayerState.LANDED for s in load.layers):
                    load.spec.resolve(load.num_blocks * self.engine.block_size)
            else:
                load.layers[layer] = LayerState.FAILED
                self._fail(load, f"READ of layer {layer} failed: {o.reason}")

        runner = ReadRunner(
            self.transport, self.engine, self.inbox, self.io, load.spec.peer,
            f"{load.request_id}-load-l{layer}", load.block_ids, load.remote, deadline_s,
            self.deadline_s, on_outcome, lambda: self._settled(load),
            layers=(layer,), at=Granularity.LAYER,
        )  # fmt: skip
        runner.start(acquire=True)  # our own references: the request's may go first

    def layer_wait(self, loads: list[LayerLoad]) -> Callable[[int], None] | None:
        """The layer hook's part (vLLM's ``wait_for_layer_load``): before layer l's
        attention, wait for layer l of each load of this step that has not failed; one
        not landed by its deadline fails."""
        if not loads:
            return None

        def wait_for_layer_load(layer: int) -> None:
            for load in loads:
                if load.failed is not None or _has_ended(load, layer):
                    continue
                t0 = time.monotonic()
                ready = self.inbox.wait_layer(partial(_has_ended, load, layer), load.wait_until)
                load.waited_s += time.monotonic() - t0
                if not ready:
                    self._fail(load, f"READ of layer {layer} did not end by its deadline")

        return wait_for_layer_load

    def get_failed_loads(self) -> set[str]:
        """After the forward: the requests whose load failed during it (their step is void)."""
        failed, self._failed = self._failed, set()
        return failed

    # ---- ending ----

    def _fail(self, load: LayerLoad, reason: str) -> None:
        if load.failed is not None:
            return
        load.failed = reason
        self.num_failed += 1
        self._failed.add(load.request_id)
        logger.warning("request %s: prefix load failed (%s); computing it", load.request_id, reason)
        load.spec.resolve(0)
        self.on_failed(load.request_id, f"its fetched prefix did not land ({reason})")

    def _settled(self, load: LayerLoad) -> None:
        """One READ settled; once every one has, decode's blocks may go."""
        load.num_settled += 1
        if load.num_settled < self.num_layers:
            return
        self._loads.pop(load.request_id, None)
        if load.failed is None:
            self.num_loaded_blocks += load.num_blocks
            self.engine.count_loaded(load.num_blocks, HitSource.DECODE)
            if self.metrics is not None:
                num_bytes = load.num_blocks * self.transport.layout.bytes_per_block
                self.metrics.received_bytes.labels("decode").inc(num_bytes)
        load.spec.release()

    def num_in_flight(self) -> int:
        """Loads whose READs are not all settled (a flow table)."""
        return len(self._loads)


def _has_ended(load: LayerLoad, layer: int) -> bool:
    return load.layers[layer] is not LayerState.PENDING


__all__ = ["LayerLoad", "LayerState", "PrefixLoadSpec", "PrefixLoads"]
