"""An idle transport and notification pump wake rarely, and wake at once when traffic comes."""

from __future__ import annotations

import threading
import time

import pytest

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.kvflow.messages import KVDone
from kvduplex.transport import ControlMessage
from kvduplex.transport import MessageCodec
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.notify import NotificationPump
from tests.skips import nixl_installed
from tests.support.fake_transport import InProcessFabric

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVCacheLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)


def test_pump_ticks_fast_while_active_then_backs_off_and_still_wakes_on_a_message() -> None:
    fabric = InProcessFabric()
    a = fabric.endpoint(allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None))
    b = fabric.endpoint(allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None))
    to_b = a.connect(b.local_metadata())
    b.connect(a.local_metadata())  # b hears only the peers it connected to
    pump = NotificationPump(b, tick_s=0.01, idle_tick_s=0.5, hot_s=0.3)
    ticks: list[float] = []
    got = threading.Event()

    def on_done(msg: ControlMessage, sender: str) -> None:
        got.set()

    pump.every_tick(ticks.append)
    pump.on(KVDone, on_done)
    pump.start()
    try:
        # 1. Active (the endpoint was just created): ticks every 10 ms.
        time.sleep(0.2)
        assert len(ticks) >= 5
        # 2. Quiet for longer than hot_s: one tick per idle_tick_s at most.
        time.sleep(0.4)
        n = len(ticks)
        time.sleep(1.2)
        assert len(ticks) - n <= 4, f"{len(ticks) - n} ticks in 1.2 s while idle"
        # 3. A message is still dispatched at once, and ticks speed up again.
        t0 = time.monotonic()
        a.send_notif(to_b, MessageCodec().encode(KVDone("x")), "x")
        assert got.wait(2.0) and time.monotonic() - t0 < 0.2
        n = len(ticks)
        time.sleep(0.15)  # active again (the message): ticks 10 ms apart for hot_s
        assert len(ticks) - n >= 5
    finally:
        pump.close()
        a.close()
        b.close()


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed")
def test_idle_nixl_progress_thread_backs_off_and_a_forward_wakes_it() -> None:
    from kvduplex.transport.nixl import NixlTransport

    t = NixlTransport(
        allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None),
        warm_s=0.3, deep_idle_poll_interval_s=0.1,
    )  # fmt: skip
    try:
        time.sleep(0.2)
        warm = t._progress.num_passes
        assert warm > 20, "warm: polling every millisecond or so"
        time.sleep(0.6)  # past warm_s: deep idle
        n = t._progress.num_passes
        time.sleep(1.0)
        assert t._progress.num_passes - n <= 15, "deep idle: about ten passes a second"
        n = t._progress.num_passes
        t.set_compute_busy(True)  # a forward starts: one pass at once, then busy polling
        time.sleep(0.05)
        assert t._progress.num_passes > n
        t.set_compute_busy(False)
    finally:
        t.close()


def test_idle_pump_cost_is_counted() -> None:
    fabric = InProcessFabric()
    a = fabric.endpoint(allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None))
    pump = NotificationPump(a, tick_s=0.05, idle_tick_s=0.5, hot_s=0.0)
    pump.start()
    try:
        time.sleep(1.1)
        assert pump.num_wakeups <= 4, f"{pump.num_wakeups} wake-ups in 1.1 s idle"
    finally:
        pump.close()
        a.close()
