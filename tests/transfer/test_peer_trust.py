"""An instance sends its cluster secret to a peer the router named (a KV handshake, a pull's
release) only once the peer proved it holds the secret too (`PeerVerifier`), against an
in-process member (the instance's own proof routes) and impostors that record every
request they get."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi import Request
from fastapi import Response
from fastapi.testclient import TestClient

from kvduplex.common.challenge import CHALLENGE_PATH
from kvduplex.common.challenge import Responder
from kvduplex.instance.auth_routes import make_auth_router
from kvduplex.kvflow.pull import http_release
from kvduplex.transport import PeerUnavailableError
from kvduplex.transport.handshake import HANDSHAKE_PATH
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.handshake import make_handshake_router
from kvduplex.transport.peer_trust import PeerVerifier
from tests.support.fake_transport import InProcessFabric
from tests.transfer.test_handshake import URL
from tests.transfer.test_handshake import endpoint

pytestmark = pytest.mark.timeout(30)

SECRET = "peer-trust-secret-" + "p" * 20


class Recorder:
    """ASGI app in front of `app` that records each request's path and headers."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.requests: list[tuple[str, dict[str, str]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.requests.append((scope["path"], headers))
        await self.app(scope, receive, send)

    def secrets_received(self) -> list[str]:
        return [path for path, headers in self.requests if SECRET in headers.values()]

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


def _peer(fabric: InProcessFabric, responder: Responder | None) -> Recorder:
    """An instance's app: its handshake, and its proof routes answered by `responder`
    (None: an impostor without them)."""
    app = FastAPI()
    app.include_router(make_handshake_router(endpoint(fabric)))
    if responder is not None:
        app.include_router(make_auth_router(responder))
    return Recorder(app)


def test_a_member_proves_itself_before_the_handshake_and_once_per_ttl() -> None:
    fabric = InProcessFabric()
    peer = _peer(fabric, Responder(SECRET, "decode"))
    directory = PeerDirectory(endpoint(fabric), client=TestClient(peer), secret=SECRET)
    directory.get_peer(URL)
    assert peer.paths() == [CHALLENGE_PATH, "/internal/auth/proof", HANDSHAKE_PATH]
    assert peer.secrets_received() == [HANDSHAKE_PATH]  # the handshake alone carries it
    directory.refresh(URL)  # the proof holds: the handshake again, no new proof
    assert peer.paths()[3:] == [HANDSHAKE_PATH]


@pytest.mark.parametrize("impostor", ["no-proof-routes", "another-secret", "no-secret"])
def test_an_impostor_named_as_a_peer_is_never_sent_the_secret(impostor: str) -> None:
    fabric = InProcessFabric()
    responder = {
        "no-proof-routes": None,
        "another-secret": Responder("another-secret-" + "q" * 20, "decode"),
        "no-secret": None,
    }[impostor]
    peer = _peer(fabric, responder)
    if impostor == "no-secret":  # an instance without a secret: 409 from its routes
        peer.app.include_router(make_auth_router(None))
    directory = PeerDirectory(endpoint(fabric), client=TestClient(peer), secret=SECRET)
    with pytest.raises(PeerUnavailableError, match="did not prove the cluster secret"):
        directory.get_peer(URL)
    assert HANDSHAKE_PATH not in peer.paths() and peer.secrets_received() == []
    assert directory.peers() == {}


def test_a_pull_release_goes_only_to_a_prefill_that_proved_itself() -> None:
    """(That a member's release arrives with the secret: the pull of
    tests/integration/test_trust.py, whose prefill ends with no lease held.)"""
    released: list[str | None] = []
    app = FastAPI()

    @app.post("/internal/release")
    async def release(raw: Request) -> Response:
        released.append(raw.headers.get("x-kvduplex-cluster-secret"))
        return Response(status_code=200)

    stranger = PeerVerifier(SECRET, client=TestClient(Recorder(app)))
    http_release(URL, "xid-1", SECRET, verify=stranger.ensure)  # no proof routes there
    assert released == []
    unreachable = PeerVerifier(SECRET, timeout_s=0.5)
    http_release("http://127.0.0.1:9", "xid-2", SECRET, verify=unreachable.ensure)  # refused
    assert released == []


def test_a_release_goes_through_the_instances_client_with_the_secret() -> None:
    """A member that proved itself gets the release, with the secret, through the one
    client the instance keeps for its peers (not a one-off client per call)."""
    peer = _peer(InProcessFabric(), Responder(SECRET, "prefill"))
    released: list[str] = []

    @peer.app.post("/internal/release")
    async def release(raw: Request) -> Response:
        released.append((await raw.json())["xid"])
        return Response(status_code=200)

    client = TestClient(peer)
    verifier = PeerVerifier(SECRET, client=client)
    http_release(URL, "xid-3", SECRET, verify=verifier.ensure, client=client)
    assert released == ["xid-3"]
    assert peer.secrets_received() == ["/internal/release"]


def test_a_proof_is_asked_again_after_its_ttl_or_once_forgotten() -> None:
    now = [0.0]
    peer = _peer(InProcessFabric(), Responder(SECRET, "prefill"))
    verifier = PeerVerifier(SECRET, client=TestClient(peer), ttl_s=60.0, clock=lambda: now[0])
    verifier.ensure(URL)
    verifier.ensure(URL)
    assert peer.paths().count(CHALLENGE_PATH) == 1
    now[0] += 60.0
    verifier.ensure(URL)
    verifier.forget(URL)
    verifier.ensure(URL)
    assert peer.paths().count(CHALLENGE_PATH) == 3


def test_nothing_is_sent_through_the_instances_client_once_it_is_closed() -> None:
    """At shutdown the instance closes its client while flow I/O may still carry out a
    queued release or reconnect: each says why it was not sent, none raises another error."""
    peer = _peer(InProcessFabric(), Responder(SECRET, "prefill"))
    client = TestClient(peer)
    client.close()
    verifier = PeerVerifier(SECRET, client=client)
    http_release(URL, "xid-4", SECRET, verify=verifier.ensure, client=client)
    directory = PeerDirectory(endpoint(InProcessFabric()), client=client, secret=SECRET)
    with pytest.raises(PeerUnavailableError, match="stopping"):
        directory.get_peer(URL)
    assert peer.requests == []
