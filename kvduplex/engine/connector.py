"""The seam between the engine step and KV transfer between instances.

As in vLLM's v1 KV connector, a connector has a *scheduler side*, which sees
the scheduler's requests and plans, and a *worker side*, which moves KV while
the model runs and sees only plain data (the `SchedulerOutput` and the
metadata the scheduler side built for it). The engine never knows which role
it plays::

    results = connector.get_finished()            # worker side: transfers that ended
    scheduler.apply_kv_results(results)           # the one place they change requests
    out = scheduler.schedule()
    out.kv_connector_metadata = connector.build_connector_meta(out)   # scheduler side
    connector.start_load_kv(meta)                 # worker side, before the forward
    runner.execute(..., on_layer_done=connector.layer_hook(meta))     # worker side
    connector.wait_for_save(meta)                 # worker side, after the forward
    scheduler.update(out, sampled)                # every finish: request_finished
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

from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import Request
from kvduplex.engine.scheduler import holds_blocks
from kvduplex.engine.scheduler_output import KVConnectorMetadata
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.engine.scheduler_output import SchedulerOutput


class KVConnector:
    """Base and colocated connector: every hook does nothing."""

    # ---- scheduler side ----

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata | None:
        """After `schedule()`, before the forward: plan this step's transfers (e.g. the
        blocks ``out.remote_kv_allocated`` requests expect, or this step's WRITEs); the
        result is ``out.kv_connector_metadata``, what the worker side gets."""
        return None

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
        """A callback the runner calls with a layer's index once its KV is in the pool."""
        return None

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """After the forward (every step, with or without one): what this step's layer
        hook began is posted."""

    def get_finished(self) -> list[KVTransferResult]:
        """Results of transfers that ended since the last call (received KV and its first
        token, a receive that failed, a prefill's push cancelled or ended); the step
        applies them before it schedules."""
        return []

    def has_pending_work(self) -> bool:
        """True while transfers are in flight, or results wait for `get_finished`, that
        need the engine loop to keep stepping."""
        return False
