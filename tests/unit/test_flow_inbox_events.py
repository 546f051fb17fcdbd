"""The flow inbox's two drains and its ticks: between two layers of a forward only the
events a push must see there are applied (a registration, a WRITE's end), the rest wait
for the step's `drain` in their order; ticks coalesce into one pending tick at the
latest time."""

from __future__ import annotations

from typing import Any
from typing import cast

import pytest

from kvduplex.kvflow.inbox import FlowInbox
from kvduplex.kvflow.inbox import Granularity
from kvduplex.kvflow.inbox import Heard
from kvduplex.kvflow.inbox import TransferEnded
from kvduplex.kvflow.inbox import TransferSettled
from kvduplex.kvflow.messages import KVCancel
from kvduplex.kvflow.messages import KVRegister
from kvduplex.kvflow.messages import ids_digest
from kvduplex.kvflow.push_prefill import PushPlan
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.protocol import TransferHandle
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

HANDLE = cast(TransferHandle, object())


class _Log:
    """Records, in order, what the inbox applied."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def handler(self, msg: ControlMessage, sender: str, received_at: float) -> None:
        self.seen.append(f"{type(msg).__name__}:{msg.xid}")

    def tick(self, now: float) -> None:
        self.seen.append(f"tick:{now:g}")


class _Watcher:
    def __init__(self, log: _Log, name: str) -> None:
        self.log, self.name = log, name

    def on_transfer_ended(self, handle: Any) -> None:
        self.log.seen.append(f"ended:{self.name}")

    def on_transfer_settled(self, handle: Any) -> None:
        self.log.seen.append(f"settled:{self.name}")


def _inbox(log: _Log) -> FlowInbox:
    inbox = FlowInbox()
    inbox.on(KVRegister, log.handler, at=Granularity.LAYER)
    inbox.on(KVCancel, log.handler)
    inbox.every_tick(log.tick)
    return inbox


def _register(xid: str) -> KVRegister:
    return KVRegister(xid, [1, 2], 0, 8, 5.0, 5.0, ids_digest(range(8)))


def test_the_layer_drain_applies_only_registrations_and_write_ends() -> None:
    log = _Log()
    inbox = _inbox(log)
    write, read = _Watcher(log, "write"), _Watcher(log, "read")
    inbox.put(Heard(KVCancel("a", "gave up"), "d", 0.0))
    inbox.tick(1.0)
    inbox.put(TransferEnded(HANDLE, read))
    inbox.put(Heard(_register("b"), "d", 0.0))
    inbox.put(TransferEnded(HANDLE, write, Granularity.LAYER))
    inbox.put(TransferSettled(HANDLE, write, Granularity.LAYER))

    assert inbox.drain_layer() == 3
    assert log.seen == ["KVRegister:b", "ended:write", "settled:write"]
    assert inbox.has_events, "what the layer drain left waits for the step's drain"

    log.seen.clear()
    inbox.put(Heard(KVCancel("c", "gave up"), "d", 0.0))
    assert inbox.drain() == 4
    assert log.seen == ["KVCancel:a", "tick:1", "ended:read", "KVCancel:c"], (
        "the deferred events come first, in their order"
    )
    assert not inbox.has_events


def test_a_layer_drain_keeps_deferring_in_order_across_layers() -> None:
    log = _Log()
    inbox = _inbox(log)
    inbox.put(Heard(KVCancel("a", "x"), "d", 0.0))
    inbox.drain_layer()
    inbox.put(Heard(KVCancel("b", "x"), "d", 0.0))
    inbox.put(Heard(_register("c"), "d", 0.0))
    inbox.drain_layer()
    assert log.seen == ["KVRegister:c"]
    inbox.drain()
    assert log.seen == ["KVRegister:c", "KVCancel:a", "KVCancel:b"]


def test_the_granularity_of_each_event_kind() -> None:
    inbox = _inbox(_Log())
    watcher = _Watcher(_Log(), "w")
    assert inbox.granularity(Heard(_register("x"), "d", 0.0)) is Granularity.LAYER
    assert inbox.granularity(Heard(KVCancel("x", "r"), "d", 0.0)) is Granularity.STEP
    assert inbox.granularity(TransferEnded(HANDLE, watcher)) is Granularity.STEP
    layer_end = TransferSettled(HANDLE, watcher, Granularity.LAYER)
    assert inbox.granularity(layer_end) is Granularity.LAYER


def test_ticks_coalesce_into_one_at_the_latest_time() -> None:
    """A busy engine that drains late applies one tick, not one per pump tick; its time
    is the latest given, so a deadline any of them passed is passed."""
    log = _Log()
    inbox = _inbox(log)
    for now in (1.0, 3.0, 2.0):
        inbox.tick(now)
    assert inbox.drain() == 1
    assert log.seen == ["tick:3"]
    inbox.tick(4.0)
    assert inbox.drain() == 1
    assert log.seen == ["tick:3", "tick:4"], "a tick after the drain is queued afresh"


def test_a_tick_deferred_by_a_layer_drain_takes_later_ticks_in() -> None:
    log = _Log()
    inbox = _inbox(log)
    inbox.tick(5.0)
    inbox.drain_layer()
    inbox.tick(6.0)
    inbox.tick(7.0)
    assert inbox.drain() == 1
    assert log.seen == ["tick:7"]


def test_prefills_layer_hook_applies_a_registration_but_not_a_cancel(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D registers and then cancels while P runs a forward: between two layers P takes
    the registration (it is written from the finished layers at once), while the cancel
    and the tick wait for the step's end, where they end the job; D computes its
    prompt itself and answers right."""
    sim = Sim(tiny, monkeypatch)
    sim.push("x1")
    sim.d.step()  # D admits the request and registers its blocks with P
    assert sim.deliver() == 1
    d_id = sim.td.engine_id
    sim.pf.inbox.heard(KVCancel("x1", "gave up"), d_id)
    ticks: list[float] = []
    sim.pf.inbox.every_tick(ticks.append)
    sim.pf.inbox.tick(sim.clock.now)
    job = sim.pf.sender._jobs["x1"]

    plan = PushPlan(is_computing=True, xids=["x1"])
    hook = sim.pf.sender.layer_hook(plan)
    assert hook is not None
    hook(0)
    sim.pf.sender.wait_for_save(plan)
    assert job.reg is not None, "the registration landed between two layers"
    assert job.error is None and ticks == [], "the cancel and the tick wait for the step"

    sim.pf.connector.get_finished()
    assert job.error is not None and ticks == [sim.clock.now]
    sim.run(lambda: sim.finished("d-x1"))
    assert sim.outputs["d-x1"] == _reference(tiny)
    assert sim.df.push.stats.num_fallbacks == 1
    sim.assert_clean()
