"""Peers that come and go are forgotten (in-process, fake transport, fake HTTP).

A cluster whose pods are rescheduled keeps naming new addresses: each instance
meets new peers all the time, and its peer tables (the directory's by URL, the
transport's with a loaded agent and a prepared descriptor list each) must hold
only the peers still in use. `Hosts` answers each peer's handshake at its own URL,
and refuses the connection (as a closed port does) once the peer left.
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.transport import TransferState
from kvduplex.transport.handshake import HANDSHAKE_PATH
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.messages import encode_handshake
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport
from tests.support.fake_transport import ManualTimers

pytestmark = pytest.mark.timeout(30)

LAYOUT = KVCacheLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)
IDLE_S = 60.0


class Hosts:
    """Fake HTTP: each URL answers the handshake of the endpoint serving there now; one
    that left refuses connections."""

    def __init__(self) -> None:
        self.serving: dict[str, InProcessTransport] = {}
        self.num_handshakes: dict[str, int] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        ep = self.serving.get(base)
        if ep is None:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        assert request.url.path == HANDSHAKE_PATH
        self.num_handshakes[base] = self.num_handshakes.get(base, 0) + 1
        return httpx.Response(200, content=encode_handshake(ep.local_metadata()))


class Rig:
    """One long-lived instance (``local``, its directory) and peers that come and go."""

    def __init__(self, timers: ManualTimers | None = None) -> None:
        self.fabric = InProcessFabric(timers)
        self.registry = CollectorRegistry()
        self.pool = allocate_kv_pool(LAYOUT)  # (L, 2, NB, BS, H, D)
        self.local = self.fabric.endpoint(self.pool, LAYOUT, metrics=TransferMetrics(self.registry))

        self.hosts = Hosts()
        client = httpx.Client(transport=httpx.MockTransport(self.hosts.handle))
        self.directory = PeerDirectory(self.local, client=client, idle_s=IDLE_S)

    def start_peer(self, url: str) -> torch.Tensor:
        """A peer serving at ``url``; its pool."""
        pool = allocate_kv_pool(LAYOUT)
        ep = self.fabric.endpoint(pool, LAYOUT, metrics=TransferMetrics(None))
        self.hosts.serving[url] = ep
        return pool

    def stop_peer(self, url: str) -> None:
        self.hosts.serving.pop(url).close()

    def write(self, url: str, xid: str) -> TransferState:
        peer = self.directory.get_peer(url)
        return self.local.transfer(TransferOp.WRITE, peer, xid, [0], [1]).wait(1)

    def forgotten(self, reason: str) -> float:
        value = self.registry.get_sample_value(
            "kvduplex_kv_peers_forgotten_total", {"reason": reason}
        )
        return value or 0.0

    def met(self) -> float:
        return self.registry.get_sample_value("kvduplex_kv_peers_met_total") or 0.0

    def gauge(self, table: str) -> float | None:
        return self.registry.get_sample_value("kvduplex_kv_peers", {"table": table})


def test_peers_that_come_and_go_leave_the_tables_bounded() -> None:
    """Waves of distinct peers, each used and then gone: one whose address refuses its
    handshake, one whose transfer fails, and one idle past the bound. The tables never
    hold more than one wave's peers, and end empty."""
    rig = Rig()
    live = 3
    sizes = []
    for wave in range(12):
        urls = [f"http://10.0.{wave}.{i}" for i in range(live)]
        for url in urls:
            rig.start_peer(url)
            assert rig.write(url, f"w{wave}-{url}") is TransferState.DONE
        for url in urls:
            rig.stop_peer(url)
        # Who notices what: a recheck of the first finds its address refusing, a transfer
        # to the second fails; the third is only never used again.
        rig.directory.recheck_s = 0.0
        rig.directory.get_peer(urls[0])  # the cached peer, its refusal noted
        rig.directory.recheck_s = None
        assert rig.write(urls[1], f"w{wave}-late") is TransferState.FAILED
        rig.directory.sweep()
        sizes.append((len(rig.directory.peers()), rig.local.num_peers(), len(rig.local.peer_usage)))
        rig.directory.sweep(time.monotonic() + IDLE_S)
    assert max(max(s) for s in sizes) <= live
    assert all(s == (1, 1, 1) for s in sizes), sizes  # the idle one waits for its bound
    assert rig.directory.peers() == {} and rig.local.num_peers() == 0
    assert len(rig.local.peer_usage) == 0
    assert (rig.forgotten("refused"), rig.forgotten("failed"), rig.forgotten("idle")) == (12, 12, 12)
    assert rig.gauge("transport") == 0 and rig.gauge("directory") == 0
    assert rig.met() == 36 and rig.directory.num_met == 36


def test_a_peer_with_a_transfer_in_flight_is_kept_until_it_settles() -> None:
    """A WRITE that failed at its deadline may still land: however idle or refused, its
    peer is torn down only once the WRITE settled; then it is forgotten."""
    timers = ManualTimers()
    rig = Rig(timers)
    url = "http://10.1.0.1"
    rig.start_peer(url)
    peer = rig.directory.get_peer(url)
    rig.local.land_late_next(None)
    handle = rig.local.transfer(TransferOp.WRITE, peer, "slow", [0], [1], deadline_s=1.0)
    timers.advance_to(1.0)
    assert handle.state is TransferState.FAILED and handle.may_still_land
    later = time.monotonic() + 10 * IDLE_S
    assert rig.directory.sweep(later) == 0
    assert rig.local.is_connected(peer.engine_id) and rig.local.peer_usage.get(peer.engine_id)
    assert rig.local.land_late() == 1 and handle.settled
    assert rig.directory.sweep(later) == 1
    assert not rig.local.is_connected(peer.engine_id) and rig.directory.peers() == {}
    assert rig.forgotten("idle") == 1


def test_a_pending_transfer_keeps_a_refused_peer_until_its_deadline() -> None:
    timers = ManualTimers()
    rig = Rig(timers)
    url = "http://10.1.0.2"
    rig.start_peer(url)
    peer = rig.directory.get_peer(url)
    rig.local.hang_next()
    handle = rig.local.transfer(TransferOp.WRITE, peer, "hung", [0], [1], deadline_s=2.0)
    rig.hosts.serving.pop(url)  # the address refuses from now on; the endpoint lingers
    rig.directory.recheck_s = 0.0
    assert rig.directory.get_peer(url) is peer  # a check without an answer keeps it
    assert rig.directory.sweep() == 0 and handle.state is TransferState.PENDING
    timers.advance_to(2.0)
    assert handle.settled
    assert rig.directory.sweep() == 1 and rig.forgotten("refused") == 1
    assert rig.local.num_peers() == 0


def test_a_forgotten_peer_that_comes_back_is_handshaken_afresh_and_works() -> None:
    rig = Rig()
    url = "http://10.2.0.1"
    pool = rig.start_peer(url)
    first = rig.directory.get_peer(url)
    engine_id = first.engine_id
    assert rig.directory.sweep(time.monotonic() + IDLE_S) == 1
    assert not rig.local.is_connected(engine_id)
    # A flow still holding its engine id reconnects by it (a handshake at its old URL).
    again = rig.directory.reconnect(engine_id)
    assert again is not None and again.engine_id == engine_id and again is not first
    assert rig.hosts.num_handshakes[url] == 2
    rig.pool[:, :, 0].fill_(7.0)  # block 0 of every layer, K and V: what the peer must get
    assert rig.write(url, "back") is TransferState.DONE
    assert bool((pool[:, :, 1] == 7.0).all())
    assert rig.gauge("directory") == 1 and rig.gauge("transport") == 1
    assert rig.met() == 1  # the same peer, met again


def test_a_peer_a_flow_tore_down_leaves_the_directory_too() -> None:
    rig = Rig()
    url = "http://10.3.0.1"
    rig.start_peer(url)
    peer = rig.directory.get_peer(url)
    rig.local.disconnect(peer)  # as a flow's TearDownEndpoint does
    assert rig.directory.sweep() == 1 and rig.forgotten("torn_down") == 1
    assert rig.directory.peers() == {}


def test_without_an_idle_bound_a_used_peer_stays() -> None:
    rig = Rig()
    rig.directory.idle_s = None
    url = "http://10.4.0.1"
    rig.start_peer(url)
    assert rig.write(url, "x") is TransferState.DONE
    assert rig.directory.sweep(time.monotonic() + 100 * IDLE_S) == 0
    assert len(rig.directory.peers()) == 1
