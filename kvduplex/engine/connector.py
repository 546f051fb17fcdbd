"""The seam between the engine step and KV transfer between instances.

Like vLLM's KV connector, the engine calls a connector at fixed points of its
step and never knows which role it plays. All calls come from the engine
thread. `NullConnector` is the colocated instance: it does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvduplex.engine.request import Request
from kvduplex.engine.scheduler import SchedulerOutput


class KVConnector(Protocol):
    def on_scheduled(self, out: SchedulerOutput) -> None:
        """After `schedule()`, before the forward: e.g. tell a sender which blocks
        `out.remote_kv_allocated` requests expect, or plan this step's pushes."""

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """A callback the runner calls after each layer's KV is in the pool, or None."""

    def on_step_done(
        self, out: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> None:
        """After `update()`: e.g. finish pushes, start leases, move arrived KV into requests."""

    def take_updated_requests(self) -> list[Request]:
        """Requests the connector changed outside the step (e.g. remote KV arrived
        with a first token); the engine reports their new output."""

    def has_pending_work(self) -> bool:
        """True while transfers are in flight, so the engine loop keeps stepping."""


class NullConnector:
    """A colocated instance: no transfers."""

    def on_scheduled(self, out: SchedulerOutput) -> None:
        return None

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        return None

    def on_step_done(
        self, out: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> None:
        return None

    def take_updated_requests(self) -> list[Request]:
        return []

    def has_pending_work(self) -> bool:
        return False
