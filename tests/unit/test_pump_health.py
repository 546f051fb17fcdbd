"""/health and /ready when the KV notification pump died: 503 with the reason, since the
instance no longer hears its peers' registrations and ends of transfers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.instance.server import watch_pump
from kvduplex.kvflow.messages import KVCancel
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.notify import NotificationPump
from tests.support.fake_transport import InProcessFabric
from tests.support.faults import Faults
from tests.unit.conftest import tiny_instance

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVCacheLayout(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)


def test_health_is_503_once_the_notification_pump_died() -> None:
    inst = tiny_instance()
    fabric = InProcessFabric()
    ours, theirs = (
        fabric.endpoint(allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None))
        for _ in range(2)
    )
    to_us = theirs.connect(ours.local_metadata())
    ours.connect(theirs.local_metadata())
    faults = Faults(break_pump_on=frozenset({"kv_cancel"}))
    pump = NotificationPump(ours, accept=faults.parts("tiny").message_filter)
    watch_pump(inst.state, pump)
    pump.start()
    try:
        with TestClient(inst.app) as c:
            assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
            theirs.send_notif(to_us, MessageCodec().encode(KVCancel("x1", "bye")), "x1")
            assert pump.wait_stopped(10), "the injected fault did not stop the pump"
            for path in ("/health", "/ready"):
                r = c.get(path)
                assert r.status_code == 503, r.text
                body = r.json()
                assert body["status"] == "unavailable"
                assert "KV notification pump stopped" in body["reason"]
                assert "PumpBroken" in body["reason"] and "kv_cancel" in body["reason"]
    finally:
        pump.close()
        inst.async_engine.shutdown()


def test_a_pump_closed_on_purpose_is_no_problem() -> None:
    fabric = InProcessFabric()
    ours = fabric.endpoint(allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None))
    pump = NotificationPump(ours)
    assert pump.problem() is None  # not started yet
    pump.start()
    assert pump.problem() is None
    pump.close()
    assert pump.wait_stopped(5) and pump.problem() is None
