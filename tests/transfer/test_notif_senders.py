"""Who sent a notification, on the in-process fake: the agent that delivered it, checked
against the peers the receiving transport connected to; never the envelope's claim."""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.protocol import Notification
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport

pytestmark = pytest.mark.timeout(30)

LAYOUT = KVCacheLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
REFUSED = "kvduplex_kv_notifications_refused_total"
RECEIVED = "kvduplex_kv_notifications_total"


class Trio:
    """P and D connected both ways; S (a stranger) connected to P, P never to S."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        fabric = InProcessFabric()
        gen = torch.Generator().manual_seed(0)

        def endpoint(metrics: TransferMetrics | None = None) -> InProcessTransport:
            pool = allocate_kv_pool(LAYOUT)
            pool.copy_(torch.randn(pool.shape, generator=gen))
            return fabric.endpoint(pool, LAYOUT, metrics=metrics or TransferMetrics(None))

        self.p = endpoint(TransferMetrics(self.registry))
        self.d, self.s = endpoint(), endpoint()
        self.p_to_d = self.p.connect(self.d.local_metadata())
        self.d_to_p = self.d.connect(self.p.local_metadata())
        self.s_to_p = self.s.connect(self.p.local_metadata())

    def refused(self, reason: str) -> float:
        return self.registry.get_sample_value(REFUSED, {"reason": reason}) or 0.0

    def received(self) -> float:
        value = self.registry.get_sample_value(RECEIVED, {"direction": "received"})
        return value or 0.0

    def close(self) -> None:
        for t in (self.p, self.d, self.s):
            t.close()


@pytest.fixture
def trio() -> Iterator[Trio]:
    t = Trio()
    yield t
    t.close()


def _poll_until(
    t: InProcessTransport, cond: Callable[[], bool], timeout_s: float = 5.0
) -> list[Notification]:
    """Poll ``t`` until ``cond()`` holds (a refusal counted, say); the notifications seen."""
    got: list[Notification] = []
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        got.extend(t.poll_notifs(timeout=0.01))
    return got


def test_a_forged_sender_is_refused_and_counted(trio: Trio) -> None:
    # D's envelope claims the stranger's engine id: P refuses it, it is not D's either.
    trio.d.forge_next_sender(trio.s.engine_id)
    trio.d.send_notif(trio.d_to_p, b"forged", "x-forged")
    assert trio.p.poll_notifs() == []
    assert trio.refused("forged_sender") == 1 and trio.received() == 0
    # The same on a WRITE's notification: the data lands (one-sided), the notification not.
    trio.d.forge_next_sender(trio.s.engine_id)
    h = trio.d.transfer(TransferOp.WRITE, trio.d_to_p, "x-w", [1], [2], notif=b"forged-write")
    assert h.state is TransferState.DONE
    assert trio.p.poll_notifs() == []
    assert trio.refused("forged_sender") == 2
    # D's own next notification names D and passes.
    trio.d.send_notif(trio.d_to_p, b"honest", "x-ok")
    assert trio.p.poll_notifs() == [Notification(trio.d.engine_id, "x-ok", b"honest")]
    assert trio.received() == 1


def test_an_unknown_agent_is_held_until_connected(trio: Trio) -> None:
    """A peer that notifies before we connect to it (two handshakes racing) is heard once
    we connect; one whose envelope then names another engine is still refused."""
    trio.s.send_notif(trio.s_to_p, b"early", "x-early")
    trio.s.forge_next_sender(trio.d.engine_id)
    trio.s.send_notif(trio.s_to_p, b"early-forged", "x-early-forged")
    assert trio.p.poll_notifs(timeout=0.05) == []
    trio.p.connect(trio.s.local_metadata())
    assert trio.p.poll_notifs() == [Notification(trio.s.engine_id, "x-early", b"early")]
    assert trio.refused("forged_sender") == 1 and trio.refused("unknown_agent") == 0


def test_an_unknown_agent_is_refused_after_the_grace(trio: Trio) -> None:
    trio.p.unknown_agent_grace_s = 0.2
    t0 = time.monotonic()
    trio.s.send_notif(trio.s_to_p, b"stranger", "x-stranger")
    got = _poll_until(trio.p, lambda: trio.refused("unknown_agent") == 1)
    assert got == [] and time.monotonic() - t0 >= 0.2
    trio.p.connect(trio.s.local_metadata())  # too late: nothing is delivered now
    assert trio.p.poll_notifs(timeout=0.05) == []
    # A stranger flooding us is refused beyond the bound, oldest first.
    trio.p.unknown_agent_grace_s, trio.p.max_held_notifs = 10.0, 3
    stranger = trio.d  # P connected to D; make D a stranger again
    trio.p.disconnect(trio.p_to_d)
    for i in range(5):
        stranger.send_notif(trio.d_to_p, b"flood", f"x-flood-{i}")
    assert trio.refused("unknown_agent") == 3  # 1 before, then the 2 oldest of 5
    assert trio.p.poll_notifs() == []


def test_a_disconnected_peers_agent_is_a_stranger_again(trio: Trio) -> None:
    trio.p.unknown_agent_grace_s = 0.0  # refuse at once
    trio.p.disconnect(trio.p_to_d)
    trio.d.send_notif(trio.d_to_p, b"after", "x-after")
    assert trio.p.poll_notifs() == []
    assert trio.refused("unknown_agent") == 1
    trio.p.connect(trio.d.local_metadata())
    trio.d.send_notif(trio.d_to_p, b"again", "x-again")
    assert trio.p.poll_notifs() == [Notification(trio.d.engine_id, "x-again", b"again")]


def test_a_dropped_notification_never_arrives(trio: Trio) -> None:
    trio.d.drop_next_notif(lambda payload: payload == b"b")
    for payload in (b"a", b"b", b"c"):
        trio.d.send_notif(trio.d_to_p, payload, "x")
    assert [n.payload for n in trio.p.poll_notifs()] == [b"a", b"c"]
    assert trio.d.num_notifs_dropped == 1
