"""Handshake endpoint, client and the peer directory's restart detection (in-process)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi import Request
from fastapi import Response
from fastapi.testclient import TestClient

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.transport import IncompatibleLayoutError
from kvduplex.transport import PeerUnavailableError
from kvduplex.transport import TransferState
from kvduplex.transport.handshake import HANDSHAKE_PATH
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.handshake import fetch_handshake
from kvduplex.transport.handshake import make_handshake_router
from kvduplex.transport.messages import decode_handshake
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport

pytestmark = pytest.mark.timeout(30)

LAYOUT = KVCacheLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)
URL = "http://testserver"


def endpoint(fabric: InProcessFabric, layout: KVCacheLayout = LAYOUT) -> InProcessTransport:
    return fabric.endpoint(allocate_kv_pool(layout), layout, metrics=TransferMetrics(None))


class Switchboard:
    """An ASGI app forwarding to whichever instance "listens" at the URL now."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None

    def serve(self, transport: InProcessTransport) -> None:
        self.app = FastAPI()
        self.app.include_router(make_handshake_router(transport))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert self.app is not None
        await self.app(scope, receive, send)


def test_endpoint_serves_json_with_base64_metadata() -> None:
    fabric = InProcessFabric()
    ep = endpoint(fabric)
    sb = Switchboard()
    sb.serve(ep)
    resp = TestClient(sb).get(HANDSHAKE_PATH)
    assert resp.status_code == 200
    body = resp.json()
    assert body["engine_id"] == ep.engine_id
    assert body["layout"] == LAYOUT.to_dict()
    assert base64.b64decode(body["agent_metadata"]) == ep.local_metadata().agent_metadata
    assert decode_handshake(resp.content) == ep.local_metadata()


def test_fetch_handshake_errors_say_why() -> None:
    app = FastAPI()
    with pytest.raises(PeerUnavailableError, match="HTTP 404"):
        fetch_handshake(URL, client=TestClient(app))
    with pytest.raises(PeerUnavailableError, match=r"handshake with http://127\.0\.0\.1:9 failed"):
        fetch_handshake("http://127.0.0.1:9", timeout=0.5)  # discard port: refused


def _directory_of_one_peer(
    recheck_s: float | None = None,
) -> tuple[InProcessFabric, InProcessTransport, InProcessTransport, Switchboard, PeerDirectory]:
    """A fabric, a local endpoint, a peer endpoint served at `URL` by a switchboard, and
    the local endpoint's directory (`recheck_s` if given) that reaches it."""
    fabric = InProcessFabric()
    local = endpoint(fabric)
    first = endpoint(fabric)
    sb = Switchboard()
    sb.serve(first)
    directory = PeerDirectory(local, client=TestClient(sb), recheck_s=recheck_s)
    return fabric, local, first, sb, directory


def test_directory_reconnects_after_restart_at_the_same_url() -> None:
    fabric, local, first, sb, directory = _directory_of_one_peer()

    peer = directory.get_peer(URL)
    assert peer.engine_id == first.engine_id
    assert directory.get_peer(URL) is peer  # cached, no new handshake needed
    assert directory.url_of(first.engine_id) == URL

    # The instance restarts: a new engine answers at the same URL.
    first.close()
    second = endpoint(fabric)
    sb.serve(second)
    assert local.transfer(TransferOp.WRITE, peer, "stale", [0], [0]).state is TransferState.FAILED
    # Told by a message that the engine there is now `second`: re-handshake.
    new_peer = directory.get_peer(URL, engine_id=second.engine_id)
    assert new_peer.engine_id == second.engine_id
    assert local.transfer(TransferOp.WRITE, new_peer, "fresh", [0], [0]).wait(1) is TransferState.DONE
    assert directory.refresh(URL) is new_peer  # unchanged engine: same handle
    directory.forget(URL)
    assert directory.peers() == {}


def test_directory_refuses_incompatible_peer() -> None:
    fabric = InProcessFabric()
    local = endpoint(fabric)
    other_layout = KVCacheLayout(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=16
    )
    sb = Switchboard()
    sb.serve(endpoint(fabric, other_layout))
    directory = PeerDirectory(local, client=TestClient(sb))
    with pytest.raises(IncompatibleLayoutError, match=r"head_dim: 8 here vs 16 there"):
        directory.get_peer(URL)
    assert directory.peers() == {}


def test_directory_rechecks_a_cached_peer_after_recheck_s() -> None:
    """Nobody tells the directory of the restart: its periodic check finds the new engine,
    and transfers still addressed to the old one fail instead of reaching the new one."""
    fabric, local, first, sb, directory = _directory_of_one_peer(recheck_s=3600.0)
    old = directory.get_peer(URL)
    assert directory.get_peer(URL) is old  # checked just now: no new handshake
    first.close()
    second = endpoint(fabric)
    sb.serve(second)
    assert directory.get_peer(URL) is old  # not due yet
    directory.recheck_s = 0.0
    new = directory.get_peer(URL)
    assert new.engine_id == second.engine_id
    assert local.transfer(TransferOp.WRITE, old, "stale", [0], [0]).state is TransferState.FAILED
    assert local.transfer(TransferOp.WRITE, new, "fresh", [0], [0]).wait(1) is TransferState.DONE
    assert directory.get_peer(URL) is new  # same engine there: same handle
    sb.app = FastAPI()  # answers 404: a check that fails keeps the peer it has
    assert directory.get_peer(URL) is new
    with pytest.raises(PeerUnavailableError):
        directory.refresh(URL)  # an explicit refresh says why it failed


def test_a_named_engine_id_spares_the_check_and_a_new_one_reconnects() -> None:
    """Told which engine is at the address (the router names it), the directory uses its
    connection without asking the address, however long ago it last checked; told another
    engine, it handshakes afresh."""
    fabric, _, first, sb, directory = _directory_of_one_peer(recheck_s=0.0)  # always due
    old = directory.get_peer(URL, first.engine_id)
    sb.app = FastAPI()  # any handshake from here on would fail (404)
    assert directory.get_peer(URL, first.engine_id) is old
    second = endpoint(fabric)
    sb.serve(second)
    new = directory.get_peer(URL, second.engine_id)
    assert new.engine_id == second.engine_id and directory.peers() == {URL: new}


@pytest.mark.parametrize("told", [True, False], ids=["told-by-name", "after-teardown"])
def test_an_engine_replaced_at_its_url_is_gone(told: bool) -> None:
    """Once the directory found another engine at a peer's URL (told its engine id, or
    connecting afresh after a flow tore the endpoint down), the old engine is gone:
    a receiver holding blocks it may still have written into lets them go."""
    fabric, local, first, sb, directory = _directory_of_one_peer()
    peer = directory.get_peer(URL)
    first.close()
    second = endpoint(fabric)
    sb.serve(second)
    if told:
        directory.get_peer(URL, engine_id=second.engine_id)
    else:
        local.disconnect(peer)
        directory.get_peer(URL)
    assert directory.url_of(first.engine_id) is None
    assert directory.is_gone(first.engine_id)
    assert directory.reconnect(first.engine_id) is None


def test_fetch_handshake_sends_the_secret_and_says_when_it_is_refused() -> None:
    app = FastAPI()
    seen: list[str | None] = []

    @app.get(HANDSHAKE_PATH)
    def handshake(request: Request) -> Response:
        seen.append(request.headers.get(SECRET_HEADER))
        return Response(status_code=401)

    with pytest.raises(PeerUnavailableError, match="same cluster secret"):
        fetch_handshake(URL, client=TestClient(app), secret="a-cluster-secret-0123")
    with pytest.raises(PeerUnavailableError):
        fetch_handshake(URL, client=TestClient(app))
    assert seen == ["a-cluster-secret-0123", None]


def test_whether_a_forgotten_engine_is_gone_is_asked_through_the_directorys_client() -> None:
    """The question a receiver asks about a sender it forgot goes through the instance's
    one client for its peers, like every other call to a peer (a one-off client costs
    tens of milliseconds and leaves memory in the calling thread's malloc arena)."""
    fabric, _, first, sb, directory = _directory_of_one_peer()
    directory.get_peer(URL)
    directory.forget(URL)
    assert directory.url_of(first.engine_id, forgotten=True) == URL
    assert not directory.is_gone(first.engine_id)  # the same engine still answers there
    first.close()
    sb.serve(endpoint(fabric))  # another process took its address
    assert directory.is_gone(first.engine_id)
