"""NixlTransport between this process and peer processes on 127.0.0.1.

Peers (``peer_server.py``) own their pools; we compare bytes through their
``/test/dump`` endpoint. The fault tests pin UCX to TCP on both sides
(``UCX_TLS=tcp``): there every READ needs the target to answer, so a stopped
peer deterministically stalls it. Over shared memory (cma) a one-sided WRITE or
READ can complete even into a stopped process.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.kv_layout import KVKind
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.kvflow.messages import KVDone
from kvduplex.transport import FailureKind
from kvduplex.transport import IncompatibleLayoutError
from kvduplex.transport import MessageCodec
from kvduplex.transport import TransferHandle
from kvduplex.transport import TransferState
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.handshake import fetch_handshake
from kvduplex.transport.messages import encode_handshake
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.nixl import NixlTransport
from kvduplex.transport.protocol import TransferOp
from tests.skips import skip_module_without_nixl
from tests.transfer.peer_procs import PeerLauncher
from tests.transfer.peer_procs import PeerProcess
from tests.transfer.peer_server import fill_blocks
from tests.transfer.peer_server import regions_bytes

skip_module_without_nixl()

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# Peers get more blocks than we have, so local and remote indices differ.
LOCAL = KVCacheLayout(num_layers=3, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=32)
PEER_FLAGS = {
    "num_layers": 3,
    "num_blocks": 96,
    "block_size": 16,
    "num_kv_heads": 2,
    "head_dim": 32,
}
TCP = {"UCX_TLS": "tcp"}


class Local:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.pool = allocate_kv_pool(LOCAL)
        fill_blocks(self.pool, list(range(LOCAL.num_blocks)), seed=1234)
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})  # UCX reads its configuration when the agent is created
        try:
            self.t = NixlTransport(self.pool, LOCAL, metrics=TransferMetrics(self.registry))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    loc = Local()
    yield loc
    loc.t.close()


@pytest.fixture(scope="module")
def local_tcp() -> Iterator[Local]:
    loc = Local(TCP)
    yield loc
    loc.t.close()


@dataclass
class Fleet:
    """The peers of this module, started in parallel (startup dominates the run time)."""

    main: PeerProcess
    incompatible: PeerProcess
    stopped: PeerProcess
    doomed: PeerProcess
    survivor: PeerProcess
    restarting: PeerProcess


@pytest.fixture(scope="module")
def fleet(peers: PeerLauncher) -> Fleet:
    pending = {
        "main": peers.launch(seed=7, **PEER_FLAGS),
        "incompatible": peers.launch(**{**PEER_FLAGS, "head_dim": 64}),
        "stopped": peers.launch(env=TCP, **PEER_FLAGS),
        "doomed": peers.launch(env=TCP, **PEER_FLAGS),
        "survivor": peers.launch(env=TCP, **PEER_FLAGS),
        "restarting": peers.launch(**PEER_FLAGS),
    }
    return Fleet(**{name: p.wait() for name, p in pending.items()})


@pytest.fixture(scope="module")
def peer(fleet: Fleet) -> PeerProcess:
    return fleet.main


def dump(p: PeerProcess, blocks: list[int], layers: list[int] | None = None) -> bytes:
    resp = httpx.post(f"{p.url}/test/dump", json={"blocks": blocks, "layers": layers}, timeout=10)
    resp.raise_for_status()
    return resp.content


def pick(rng: np.random.Generator, n: int, num_blocks: int) -> list[int]:
    return [int(b) for b in rng.choice(num_blocks, size=n, replace=False)]


def test_write_and_read_random_blocks_bytes_match(local: Local, peer: PeerProcess) -> None:
    t = local.t
    handle = t.connect(fetch_handshake(peer.url))
    rng = np.random.default_rng(0)

    # 1. WRITE all layers, random local -> random remote blocks.
    src, dst = pick(rng, 12, LOCAL.num_blocks), pick(rng, 12, 96)
    assert t.transfer(TransferOp.WRITE, handle, "w-all", src, dst).wait(10) is TransferState.DONE
    assert dump(peer, dst) == regions_bytes(local.pool, LOCAL, src, None)

    # 2. WRITE one layer: the other layers of those remote blocks keep their bytes.
    src2 = pick(rng, 5, LOCAL.num_blocks)
    before = {layer: dump(peer, dst[:5], [layer]) for layer in (0, 2)}
    assert t.transfer(TransferOp.WRITE, handle, "w-l1", src2, dst[:5], layers=[1]).wait(10) is TransferState.DONE
    assert dump(peer, dst[:5], [1]) == regions_bytes(local.pool, LOCAL, src2, [1])
    assert {layer: dump(peer, dst[:5], [layer]) for layer in (0, 2)} == before

    # 3. READ all layers of random remote blocks (the peer's own seeded data).
    remote, into = pick(rng, 10, 96), pick(rng, 10, LOCAL.num_blocks)
    assert t.transfer(TransferOp.READ, handle, "r-all", into, remote).wait(10) is TransferState.DONE
    assert regions_bytes(local.pool, LOCAL, into, None) == dump(peer, remote)

    # 4. READ two layers, V only.
    remote, into = pick(rng, 4, 96), pick(rng, 4, LOCAL.num_blocks)
    h = t.transfer(TransferOp.READ, handle, "r-v", into, remote, layers=[0, 2], kinds=[KVKind.V])
    assert h.wait(10) is TransferState.DONE and h.num_descriptors == 8
    got = local.pool[[0, 2]][:, 1][:, into].contiguous()
    want = torch.frombuffer(bytearray(dump(peer, remote, [0, 2])), dtype=torch.float32)
    assert torch.equal(got.flatten(), want.view(2, 2, -1)[:, 1].flatten())

    assert local.sample("kvduplex_kv_transfer_bytes_total", direction="write") == (
        (12 * 3 + 5) * 2 * LOCAL.block_bytes
    )
    assert local.sample("kvduplex_kv_transfer_descriptors_total", direction="read") == 60 + 8


def test_concurrent_writes_deliver_each_notification_once(local: Local, peer: PeerProcess) -> None:
    t = local.t
    handle = t.connect(fetch_handshake(peer.url))
    # The peer hears only agents it connected to itself.
    httpx.post(f"{peer.url}/test/connect", content=encode_handshake(t.local_metadata()))
    codec = MessageCodec()
    num = 48
    handles: list[TransferHandle] = [None] * num  # type: ignore[list-item]

    def post(worker: int) -> None:
        for i in range(worker, num, 4):
            msg = KVDone(xid=f"c{i}", num_tokens=i)
            handles[i] = t.transfer(TransferOp.WRITE, handle, f"c{i}", [i], [i + 32], notif=codec.encode(msg))

    threads = [threading.Thread(target=post, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert [h.wait(10) for h in handles] == [TransferState.DONE] * num

    resp = httpx.get(f"{peer.url}/test/notifs", params={"timeout": 10, "min": num}, timeout=20)
    notifs = resp.json()
    assert sorted(n["xid"] for n in notifs) == sorted(f"c{i}" for i in range(num))
    for n in notifs:
        msg = codec.decode(base64.b64decode(n["payload"]))
        assert (
            isinstance(msg, KVDone) and msg.xid == n["xid"] and n["peer_engine_id"] == t.engine_id
        )
    # Nothing is delivered twice: a notification sent after all of them is the next to arrive.
    t.send_notif(handle, b"last", xid="after-all")
    later = httpx.get(f"{peer.url}/test/notifs", params={"timeout": 10, "min": 1}, timeout=20)
    assert [n["xid"] for n in later.json()] == ["after-all"]
    # Every notification followed its data.
    assert dump(peer, list(range(32, 32 + num))) == regions_bytes(
        local.pool, LOCAL, list(range(num)), None
    )


def test_peer_notification_reaches_us(local: Local, peer: PeerProcess) -> None:
    local.t.connect(fetch_handshake(peer.url))  # we hear peers we connected to
    httpx.post(f"{peer.url}/test/connect", content=encode_handshake(local.t.local_metadata()))
    payload = base64.b64encode(b"to-you").decode()
    httpx.post(
        f"{peer.url}/test/notify",
        json={"engine_id": local.t.engine_id, "xid": "n1", "payload": payload},
    )
    got = local.t.poll_notifs(timeout=10)
    assert [(n.peer_engine_id, n.xid, n.payload) for n in got] == [
        (peer.engine_id, "n1", b"to-you")
    ]


def test_forged_and_unknown_senders_are_refused(local: Local, peer: PeerProcess) -> None:
    """The sender is the NIXL agent that delivered a notification: a peer's envelope
    naming another engine is refused, and so is an agent we never connected to."""
    t = local.t
    t.connect(fetch_handshake(peer.url))
    httpx.post(f"{peer.url}/test/connect", content=encode_handshake(t.local_metadata()))
    refused = "kvduplex_kv_notifications_refused_total"
    forged = local.sample(refused, reason="forged_sender")
    unknown = local.sample(refused, reason="unknown_agent")

    def notify(xid: str, claim: str | None = None) -> None:
        body = {"engine_id": t.engine_id, "xid": xid, "payload": base64.b64encode(b"p").decode()}
        resp = httpx.post(f"{peer.url}/test/notify", json={**body, "claim": claim}, timeout=10)
        resp.raise_for_status()

    notify("forged-1", claim="someone-else")
    notify("honest-1")  # delivered after the forged one: once it is here, that one was seen
    got = t.poll_notifs(timeout=10)
    assert [(n.peer_engine_id, n.xid) for n in got] == [(peer.engine_id, "honest-1")]
    assert local.sample(refused, reason="forged_sender") == forged + 1

    stranger = Local()  # another agent that holds our handshake; we never connect to it
    grace = t.unknown_agent_grace_s
    t.unknown_agent_grace_s = 0.2
    try:
        to_us = stranger.t.connect(t.local_metadata())
        stranger.t.send_notif(to_us, b"from-a-stranger", xid="stranger-1")
        end = time.monotonic() + 10
        while local.sample(refused, reason="unknown_agent") < unknown + 1:
            assert time.monotonic() < end, "the stranger's notification was not refused"
            assert t.poll_notifs(timeout=0.05) == []
    finally:
        t.unknown_agent_grace_s = grace
        stranger.t.close()


def test_incompatible_layout_is_refused(local: Local, fleet: Fleet) -> None:
    other = fleet.incompatible
    with pytest.raises(IncompatibleLayoutError, match=r"head_dim: 32 here vs 64 there"):
        local.t.connect(fetch_handshake(other.url))
    with pytest.raises(IncompatibleLayoutError, match="same model, dtype and block size"):
        PeerDirectory(local.t).get_peer(other.url)


def test_deadline_expires_when_peer_is_stopped(local_tcp: Local, fleet: Fleet) -> None:
    p = fleet.stopped
    t = local_tcp.t
    handle = t.connect(fetch_handshake(p.url))
    assert t.transfer(TransferOp.READ, handle, "warm", [0], [0]).wait(10) is TransferState.DONE

    p.signal(signal.SIGSTOP)
    h = t.transfer(TransferOp.READ, handle, "stalled", [1, 2], [1, 2], deadline_s=1.0)
    assert h.wait(10) is TransferState.FAILED
    assert h.failure is FailureKind.DEADLINE and h.reason == "deadline exceeded after 1 s"
    assert h.duration_s is not None and h.duration_s >= 1.0  # not before its deadline
    assert (
        local_tcp.sample("kvduplex_kv_transfer_failures_total", direction="read", cause="deadline")
        == 1
    )

    # Resumed, the same connection works again.
    p.signal(signal.SIGCONT)
    assert t.transfer(TransferOp.READ, handle, "resumed", [3], [3]).wait(10) is TransferState.DONE
    assert regions_bytes(local_tcp.pool, LOCAL, [3], None) == dump(p, [3])


def test_peer_killed_mid_transfer_fails_fast_and_others_keep_working(
    local_tcp: Local, fleet: Fleet
) -> None:
    t = local_tcp.t
    doomed, survivor = fleet.doomed, fleet.survivor
    to_doomed = t.connect(fetch_handshake(doomed.url))
    to_survivor = t.connect(fetch_handshake(survivor.url))
    assert t.transfer(TransferOp.READ, to_doomed, "warm", [0], [0]).wait(10) is TransferState.DONE

    returned: list[str] = []  # the owner of the blocks gets them back through the callback
    doomed.signal(signal.SIGSTOP)
    h = t.transfer(TransferOp.READ, to_doomed, "mid", list(range(32)), list(range(32)), deadline_s=20)
    h.add_done_callback(lambda hd: returned.append(hd.xid))
    assert h.state is TransferState.PENDING  # the target cannot answer while stopped
    doomed.kill()
    assert h.wait(20) is TransferState.FAILED
    # The transport noticed the dead peer: the 20 s deadline is not what ended it.
    assert h.failure is FailureKind.PEER and "transport error" in (h.reason or "")
    assert returned == ["mid"]

    # A new transfer to the dead peer fails at once instead of raising.
    assert t.transfer(TransferOp.WRITE, to_doomed, "late", [0], [0]).wait(10) is TransferState.FAILED
    t.disconnect(to_doomed)
    # The same transport keeps serving the other peer.
    assert t.transfer(TransferOp.WRITE, to_survivor, "ok", [5, 6], [7, 8], notif=b"x").wait(10) is TransferState.DONE
    assert dump(survivor, [7, 8]) == regions_bytes(local_tcp.pool, LOCAL, [5, 6], None)


def test_restart_on_same_port_is_detected_and_rehandshaked(
    local: Local, fleet: Fleet, peers: PeerLauncher
) -> None:
    t = local.t
    first = fleet.restarting
    directory = PeerDirectory(t)
    old = directory.get_peer(first.url)
    assert t.transfer(TransferOp.WRITE, old, "before", [1], [1]).wait(10) is TransferState.DONE

    first.kill()
    second = peers.spawn(port=first.port, **PEER_FLAGS)
    assert second.engine_id != first.engine_id
    # The cached connection points at the dead engine: transfers fail, nothing hangs.
    assert directory.get_peer(first.url) is old
    assert t.transfer(TransferOp.WRITE, old, "stale", [1], [1], deadline_s=5).wait(10) is TransferState.FAILED
    # After a failure the caller refreshes: new engine id at that URL -> re-handshake.
    new = directory.refresh(first.url)
    assert new.engine_id == second.engine_id
    assert directory.get_peer(first.url, engine_id=second.engine_id) is new
    assert t.transfer(TransferOp.WRITE, new, "after", [2, 3], [4, 5]).wait(10) is TransferState.DONE
    assert dump(second, [4, 5]) == regions_bytes(local.pool, LOCAL, [2, 3], None)
