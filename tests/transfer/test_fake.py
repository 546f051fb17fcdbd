"""Transport semantics on the in-process fake (two endpoints, one process)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.kv_layout import KVKind
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.kvflow.messages import KVDone
from kvduplex.transport import IncompatibleLayoutError
from kvduplex.transport import MessageCodec
from kvduplex.transport import Region
from kvduplex.transport import TransferFailed
from kvduplex.transport import TransferHandle
from kvduplex.transport import TransferState
from kvduplex.transport import Transport
from kvduplex.transport import block_region_indices
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import PeerUnavailableError
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport

pytestmark = pytest.mark.timeout(30)

LAYOUT_P = KVCacheLayout(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
LAYOUT_D = KVCacheLayout(num_layers=3, num_blocks=24, block_size=4, num_kv_heads=2, head_dim=8)


class Pair:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        metrics = TransferMetrics(self.registry)
        self.fabric = InProcessFabric()
        self.pool_p = allocate_kv_pool(LAYOUT_P)
        self.pool_d = allocate_kv_pool(LAYOUT_D)
        gen = torch.Generator().manual_seed(0)
        self.pool_p.copy_(torch.randn(self.pool_p.shape, generator=gen))
        self.p = self.fabric.endpoint(self.pool_p, LAYOUT_P, metrics=metrics, default_deadline_s=5)
        self.d = self.fabric.endpoint(self.pool_d, LAYOUT_D, metrics=metrics, default_deadline_s=5)
        self.to_d = self.p.connect(self.d.local_metadata())
        self.to_p = self.d.connect(self.p.local_metadata())

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def pair() -> Iterator[Pair]:
    pr = Pair()
    yield pr
    pr.p.close()
    pr.d.close()


def test_endpoints_satisfy_the_protocol(pair: Pair) -> None:
    assert isinstance(pair.p, Transport)
    assert pair.p.engine_id != pair.d.engine_id
    assert pair.to_d.layout == LAYOUT_D


def test_region_indices_match_the_pool_layout() -> None:
    idx = block_region_indices(LAYOUT_D, [3, 7], layers=[0, 2])
    expected = [
        LAYOUT_D.region_index(layer, kv, block)
        for layer in (0, 2)
        for kv in (KVKind.K, KVKind.V)
        for block in (3, 7)
    ]
    assert idx.tolist() == expected
    assert idx.dtype == np.int32


def test_write_all_layers_copies_exactly_those_blocks(pair: Pair) -> None:
    before = pair.pool_d.clone()
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "x1", [1, 2, 5], [20, 0, 9])
    assert h.wait(1) is TransferState.DONE
    for src, dst in ((1, 20), (2, 0), (5, 9)):
        assert torch.equal(pair.pool_d[:, :, dst], pair.pool_p[:, :, src])
    untouched = [b for b in range(LAYOUT_D.num_blocks) if b not in (20, 0, 9)]
    assert torch.equal(pair.pool_d[:, :, untouched], before[:, :, untouched])
    assert h.num_descriptors == 3 * 2 * 3
    assert pair.sample("kvduplex_kv_transfer_bytes_total", direction="write") == (
        18 * LAYOUT_P.block_bytes
    )


def test_read_selected_layers_and_kinds(pair: Pair) -> None:
    pair.pool_d[:, :, 4] = 7.0
    h = pair.p.transfer(TransferOp.READ, pair.to_d, "r1", [3], [4], layers=[1], kinds=[KVKind.V])
    assert h.wait(1) is TransferState.DONE
    assert torch.all(pair.pool_p[1, 1, 3] == 7.0)
    assert not torch.any(pair.pool_p[1, 0, 3] == 7.0)  # K of layer 1 untouched
    assert not torch.any(pair.pool_p[0, :, 3] == 7.0)  # other layers untouched
    assert pair.sample("kvduplex_kv_transfers_total", direction="read") == 1


def test_regions_form_moves_arbitrary_regions(pair: Pair) -> None:
    local = [Region(2, KVKind.V, 3), Region(0, KVKind.K, 0)]
    remote = [Region(0, KVKind.K, 23), Region(1, KVKind.V, 1)]
    assert pair.p.transfer_regions(TransferOp.WRITE, pair.to_d, "g1", local, remote).wait(1) is TransferState.DONE
    assert torch.equal(pair.pool_d[0, 0, 23], pair.pool_p[2, 1, 3])
    assert torch.equal(pair.pool_d[1, 1, 1], pair.pool_p[0, 0, 0])


def test_write_notification_is_delivered_once_with_its_xid(pair: Pair) -> None:
    codec = MessageCodec()
    msg = KVDone(xid="x7", num_tokens=12, first_token=42)
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "x7", [0], [0], notif=codec.encode(msg))
    assert h.wait(1) is TransferState.DONE
    got = pair.d.poll_notifs(timeout=1)
    assert [(n.peer_engine_id, n.xid) for n in got] == [(pair.p.engine_id, "x7")]
    assert codec.decode(got[0].payload) == msg
    assert pair.d.poll_notifs() == []


def test_poll_notifs_waits_for_a_notification(pair: Pair) -> None:
    t = threading.Timer(0.05, pair.d.send_notif, args=(pair.to_p, b"hello"), kwargs={"xid": "n1"})
    t.start()
    got = pair.p.poll_notifs(timeout=5)
    t.join()
    assert [(n.xid, n.payload) for n in got] == [("n1", b"hello")]


def test_failed_transfer_carries_xid_and_reason(pair: Pair) -> None:
    before = pair.pool_d.clone()
    seen: list[TransferHandle] = []
    pair.p.fail_next("link down")
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "bad1", [1], [1], notif=b"never")
    h.add_done_callback(seen.append)
    assert h.state is TransferState.FAILED
    assert seen == [h]
    with pytest.raises(TransferFailed) as info:
        h.result(0)
    assert info.value.xid == "bad1" and info.value.reason == "link down"
    assert torch.equal(pair.pool_d, before)
    assert (
        pair.sample("kvduplex_kv_transfer_failures_total", direction="write", cause="injected") == 1
    )
    # The next transfer is unaffected, and its notification is the only one to arrive.
    assert pair.p.transfer(TransferOp.WRITE, pair.to_d, "ok1", [1], [1], notif=b"ok").wait(1) is TransferState.DONE
    assert [(n.xid, n.payload) for n in pair.d.poll_notifs(timeout=1)] == [("ok1", b"ok")]


def test_hung_transfer_fails_at_its_deadline(pair: Pair) -> None:
    done = threading.Event()
    pair.p.hang_next()
    h = pair.p.transfer(TransferOp.READ, pair.to_d, "hang1", [2], [2], deadline_s=0.2)
    h.add_done_callback(lambda _: done.set())
    assert h.state is TransferState.PENDING
    assert done.wait(5)
    assert h.state is TransferState.FAILED
    assert h.failure is FailureKind.DEADLINE
    assert h.reason == "deadline exceeded after 0.2 s"
    assert h.duration_s is not None and h.duration_s >= 0.19  # not before its deadline
    assert (
        pair.sample("kvduplex_kv_transfer_failures_total", direction="read", cause="deadline") == 1
    )


def test_peer_closing_fails_transfers_in_flight(pair: Pair) -> None:
    pair.p.hang_next()
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "inflight", [0], [0], deadline_s=30)
    pair.d.close()
    assert h.wait(1) is TransferState.FAILED
    assert h.reason == "peer closed"
    # Posting to a gone peer fails the transfer; it does not raise.
    h2 = pair.p.transfer(TransferOp.WRITE, pair.to_d, "after", [0], [0])
    assert h2.state is TransferState.FAILED and h2.failure is FailureKind.PEER
    with pytest.raises(PeerUnavailableError):
        pair.p.send_notif(pair.to_d, b"x")


def test_disconnected_peer_fails_on_post(pair: Pair) -> None:
    pair.p.disconnect(pair.to_d)
    h = pair.p.transfer(TransferOp.WRITE, pair.to_d, "x", [0], [0])
    assert h.state is TransferState.FAILED and h.failure is FailureKind.POST
    assert "not connected" in (h.reason or "")


def test_incompatible_layout_is_refused_clearly(pair: Pair) -> None:
    other = KVCacheLayout(num_layers=3, num_blocks=8, block_size=8, num_kv_heads=2, head_dim=8)
    ep = pair.fabric.endpoint(allocate_kv_pool(other), other, metrics=TransferMetrics(None))
    with pytest.raises(IncompatibleLayoutError, match=r"block_size: 4 here vs 8 there"):
        pair.p.connect(ep.local_metadata())
    with pytest.raises(IncompatibleLayoutError, match="itself"):
        pair.p.connect(pair.p.local_metadata())
    ep.close()


def test_bad_requests_raise_value_error(pair: Pair) -> None:
    with pytest.raises(ValueError, match=r"block id 16 out of range \[0, 16\)"):
        pair.p.transfer(TransferOp.WRITE, pair.to_d, "x", [16], [0])
    with pytest.raises(ValueError, match="same length"):
        pair.p.transfer(TransferOp.WRITE, pair.to_d, "x", [1, 2], [0])
    with pytest.raises(ValueError, match="layer 3 out of range"):
        pair.p.transfer(TransferOp.READ, pair.to_d, "x", [1], [1], layers=[3])
    with pytest.raises(ValueError, match="deadline_s"):
        pair.p.transfer(TransferOp.READ, pair.to_d, "x", [1], [1], deadline_s=0)
    with pytest.raises(ValueError, match="only a WRITE carries a notification"):
        pair.p.transfer(TransferOp.READ, pair.to_d, "x", [1], [1], notif=b"n")


def test_connect_is_idempotent_per_engine(pair: Pair) -> None:
    again = pair.p.connect(pair.d.local_metadata())
    assert again == pair.to_d
    assert isinstance(again, PeerHandle)


# Run in a child process: a ControlMessage subclass joins the union of every codec built
# after it for as long as it lives, and msgspec's union cache keeps it alive for good, so
# defining one in this process would change what every later MessageCodec() decodes.
_EXTENSION_CHECK = """
import msgspec
from kvduplex.kvflow.messages import KVDone
from kvduplex.transport import ControlMessage, MessageCodec

class OfferBlocks(ControlMessage, tag="test_offer", frozen=True):
    block_keys: list[int] = msgspec.field(default_factory=list)

codec = MessageCodec()
assert OfferBlocks in codec.types and KVDone in codec.types, codec.types
msg = OfferBlocks(xid="o1", block_keys=[1, 2])
assert codec.decode(codec.encode(msg)) == msg
try:
    MessageCodec([KVDone]).decode(codec.encode(msg))
except msgspec.ValidationError:
    pass
else:
    raise AssertionError("a codec built without OfferBlocks decoded it")
"""


def test_message_union_is_extensible() -> None:
    root = Path(__file__).resolve().parents[2]  # `-c` puts the working directory first on sys.path
    proc = subprocess.run(
        [sys.executable, "-c", _EXTENSION_CHECK],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_endpoint_rejects_a_pool_of_the_wrong_shape() -> None:
    fabric = InProcessFabric()
    with pytest.raises(ValueError, match="does not match layout"):
        InProcessTransport(fabric, torch.zeros(3), LAYOUT_P, None, 1.0, TransferMetrics(None))
