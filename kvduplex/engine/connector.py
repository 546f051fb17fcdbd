"""The seam between the engine step and KV transfer between instances.

As in vLLM's v1 KV connector, a connector has a *scheduler side*, which sees
the scheduler's requests and plans, and a *worker side*, which moves KV while
the model runs and sees only plain data (the `SchedulerOutput` and the
metadata the scheduler side built for it). The engine never knows which role
it plays::

    results = connector.get_finished()            # worker side: transfers that ended
    scheduler.apply_kv_results(results)           # the one place they change requests
    out = scheduler.schedule()                    # admission asks the scheduler side
                                                  # get_num_new_matched_tokens, then
                                                  # update_state_after_alloc
    out.kv_connector_metadata = connector.build_connector_meta(out)   # scheduler side
    connector.start_load_kv(meta)                 # worker side, before the forward
    runner.execute(..., on_layer_done=connector.layer_hook(meta))     # worker side
                                                  # (and load_failed, for a tier load)
    connector.wait_for_save(meta)                 # worker side, after the forward
    void = connector.get_failed_loads()           # worker side: loads that did not land
    scheduler.update(out, sampled, void)          # every finish: request_finished
    outputs of the step                           # the one output path

`KVConnector` has a no-op default for every hook: a connector overrides only
what its flow needs, and `KVConnector()` itself is the colocated instance.
All hooks run on the engine thread.

Connectors reach the engine only through `kvduplex.engine.handle.EngineHandle`: blocks through the
KV manager (the one memory API), requests by reading them (and aborting or
releasing them), other threads through `call`. A transfer's outcome for a
request never changes it from a connector: it is a `KVTransferResult` that
`get_finished` hands to the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence

from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.scheduler import holds_blocks
from kvduplex.engine.scheduler_output import KVConnectorMetadata
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.engine.scheduler_output import SchedulerOutput

LayerHook = Callable[[int], None]
"""Called with a layer's index before that layer's attention runs."""


def chain_layer_hooks(first: LayerHook | None, then: LayerHook | None) -> LayerHook | None:
    """One hook that runs `first`, then `then`, for each layer (either may be None): a wait
    for the layer's loaded KV before the push of it, which must see that KV."""
    if first is None or then is None:
        return first or then

    def on_layer(layer: int) -> None:
        first(layer)
        then(layer)

    return on_layer


class KVConnector:
    """Base and colocated connector: every hook does nothing."""

    # ---- scheduler side ----

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata | None:
        """After `schedule()`, before the forward: plan this step's transfers (e.g. the
        blocks ``out.remote_kv_allocated`` requests expect, or this step's WRITEs); the
        result is ``out.kv_connector_metadata``, what the worker side gets."""
        return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """At a new request's admission, after its local prefix hit of
        ``num_computed_tokens``: how many more prompt tokens this connector can load
        into fresh blocks during the request's first forward (a multiple of the block
        size that leaves the last prompt token to compute; 0: none). May be asked
        again at a later step if the request could not be admitted."""
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Once per admitted new request, right after its blocks were allocated:
        ``block_ids`` (the blocks after its local hit, ``num_external_tokens`` of them
        worth) are where the tokens `get_num_new_matched_tokens` named are to be loaded;
        they count as computed, and the request's first forward reads them layer by
        layer (``num_external_tokens`` 0: nothing to load, whatever was offered)."""

    def request_finished(self, request: Request, reason: FinishReason) -> bool:
        """Once for every finish: stop, length, a stop string, abort (also of a request
        that never reached the scheduler: its client left while it was queued for the
        engine), with the request in its final status. Return whether its blocks stay
        held until released (`EngineHandle.release_held`); the default holds those added
        with ``hold_blocks_on_finish`` unless aborted. Its final output is made after
        this; work that must follow the answer goes through `EngineHandle.call`."""
        return holds_blocks(request, reason)

    # ---- worker side ----

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Before the forward: e.g. register the blocks remote KV goes into, or post READs."""

    def layer_hook(self, meta: KVConnectorMetadata | None) -> Callable[[int], None] | None:
        """A callback the runner calls with a layer's index once the step's new KV of
        that layer is in the pool, before that layer's attention reads the pool: where
        a layer's WRITEs are posted, and where a layer's loaded KV is waited for (vLLM's
        ``save_kv_layer`` and ``wait_for_layer_load``)."""
        return None

    def load_failed(self, request_id: str, reason: str) -> None:
        """During the forward, before a layer's hook: a load of this step that is not the
        connector's own (a KV tier hit read layer by layer) failed for `request_id`, so
        this step's KV of that layer and later ones is garbage for it; the step is void
        (`get_failed_loads` need not name it). E.g. stop a push that streams it."""

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """After the forward (every step, with or without one): what this step's layer
        hook began is posted."""

    def get_failed_loads(self) -> set[str]:
        """After the forward (every step): the requests of this step whose loaded KV did
        not land (a READ failed or ran past its deadline). Their step is void: nothing
        sampled is kept, and they compute their prompt from their local prefix hit."""
        return set()

    def get_finished(self) -> list[KVTransferResult]:
        """Results of transfers that ended since the last call (received KV and its first
        token, a receive that failed, a prefill's push cancelled or ended); the step
        applies them before it schedules."""
        return []

    def has_pending_work(self) -> bool:
        """True while transfers are in flight, or results wait for `get_finished`, that
        need the engine loop to keep stepping."""
        return False
