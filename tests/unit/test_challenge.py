"""The proof of the cluster secret (`kvduplex.common.challenge`), both sides in memory: a
right exchange, a wrong secret on either side, a replayed nonce, a replayed answer, an
expired challenge, another role, a relay from another address; and that no message
carries the secret."""

from __future__ import annotations

import msgspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvduplex.common.challenge import MAX_PENDING
from kvduplex.common.challenge import TTL_S
from kvduplex.common.challenge import Exchange
from kvduplex.common.challenge import NotAnswered
from kvduplex.common.challenge import Proof
from kvduplex.common.challenge import ProofAnswer
from kvduplex.common.challenge import Refusal
from kvduplex.common.challenge import Refused
from kvduplex.common.challenge import Responder
from kvduplex.common.challenge import address_matches
from kvduplex.common.challenge import mac
from kvduplex.common.challenge import seen_address
from kvduplex.common.guard import InternalGuard
from kvduplex.instance.auth_routes import make_auth_router

SECRET = "cluster-secret-" + "a" * 24
URL = "http://10.0.0.7:8000"
SEEN = "10.0.0.7:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answer(responder: Responder, step: str, body: bytes, seen: str = SEEN) -> tuple[int, bytes]:
    """`responder`'s HTTP answer to one POST, as its routes give it (`auth_routes`)."""
    try:
        if step == "challenge":
            return 200, responder.challenge(body, seen)
        return 200, responder.prove(body)
    except ValueError:
        return 400, b"{}"
    except Refused:
        return 401, b'{"error": {"code": "invalid_cluster_secret"}}'


def exchange(
    ex: Exchange, responder: Responder, seen: str = SEEN, roles: tuple[str, ...] | None = None
) -> tuple[str, list[bytes]]:
    """Run `ex` against `responder`: the role it proved, and every message sent."""
    sent = [ex.challenge()]
    status, body = answer(responder, "challenge", sent[-1], seen)
    sent += [body, ex.proof(status, body)]
    status, body = answer(responder, "proof", sent[-1])
    sent.append(body)
    return ex.check(status, body, roles), sent


def test_a_right_exchange_proves_both_sides_and_sends_no_secret() -> None:
    responder = Responder(SECRET, "decode")
    role, sent = exchange(Exchange(SECRET, URL), responder, roles=("decode",))
    assert role == "decode"
    assert len(sent) == 4 and all(SECRET.encode() not in message for message in sent)
    assert responder.num_pending == 0  # the nonce was used up


def test_a_wrong_secret_on_either_side_is_refused() -> None:
    # The instance holds another secret: it refuses the verifier's proof (401).
    with pytest.raises(Refused) as caught:
        exchange(Exchange(SECRET, URL), Responder("another-secret-" + "b" * 24, "decode"))
    assert caught.value.refusal is Refusal.WRONG_SECRET

    # An impostor that skips the verifier's proof and makes its own up is refused too.
    class Impostor(Responder):
        def prove(self, body: bytes) -> bytes:
            given = msgspec.json.decode(body, type=Proof)
            made_up = mac("a-guess-at-the-secret-000", b"instance", given.nonce, URL)
            return msgspec.json.encode(ProofAnswer("decode", SEEN, made_up))

    with pytest.raises(Refused) as caught:
        exchange(Exchange(SECRET, URL), Impostor("a-guess-at-the-secret-000", "decode"))
    assert caught.value.refusal is Refusal.WRONG_SECRET


def test_a_replayed_nonce_is_refused() -> None:
    """The verifier's proof opens one exchange: sent again, its nonce is unknown."""
    responder = Responder(SECRET, "prefill")
    ex = Exchange(SECRET, URL)
    _, body = answer(responder, "challenge", ex.challenge())
    proof = ex.proof(200, body)
    assert answer(responder, "proof", proof)[0] == 200
    with pytest.raises(Refused, match="unknown or used nonce"):
        responder.prove(proof)


def test_a_replayed_answer_is_refused() -> None:
    """An instance's recorded proof answers no other exchange: each has a fresh nonce."""
    responder = Responder(SECRET, "decode")
    _, sent = exchange(Exchange(SECRET, URL), responder)
    recorded = sent[-1]
    ex = Exchange(SECRET, URL)
    _, body = answer(responder, "challenge", ex.challenge())
    ex.proof(200, body)
    with pytest.raises(Refused) as caught:
        ex.check(200, recorded)
    assert caught.value.refusal is Refusal.WRONG_SECRET


def test_an_expired_challenge_is_refused() -> None:
    clock = Clock()
    responder = Responder(SECRET, "decode", clock=clock)
    ex = Exchange(SECRET, URL)
    _, body = answer(responder, "challenge", ex.challenge())
    proof = ex.proof(200, body)
    clock.now += TTL_S + 0.01
    with pytest.raises(Refused, match="expired"):
        responder.prove(proof)
    with pytest.raises(Refused, match="unknown or used"):  # used up, expired or not
        responder.prove(proof)


def test_another_role_than_asked_is_refused() -> None:
    with pytest.raises(Refused) as caught:
        exchange(Exchange(SECRET, URL), Responder(SECRET, "prefill"), roles=("decode",))
    assert caught.value.refusal is Refusal.ROLE


def test_a_relay_from_another_address_is_refused() -> None:
    """An impostor at 10.0.0.7 relays both POSTs to a member at 10.0.0.9: the member's proof
    names the address it was reached at, which is not the one the verifier dialled."""
    with pytest.raises(Refused) as caught:
        exchange(Exchange(SECRET, URL), Responder(SECRET, "decode"), seen="10.0.0.9:8000")
    assert caught.value.refusal is Refusal.ADDRESS
    with pytest.raises(Refused):  # same address, another port
        exchange(Exchange(SECRET, URL), Responder(SECRET, "decode"), seen="10.0.0.7:8001")
    # A URL by name binds the name only: the address cannot be compared.
    named = "http://decode-0.decode.ns.svc.cluster.local.:8000"
    role, _ = exchange(Exchange(SECRET, named), Responder(SECRET, "decode"), seen="10.0.0.9:8000")
    assert role == "decode"


def test_malformed_and_unanswered_steps() -> None:
    responder = Responder(SECRET, "decode")
    with pytest.raises(ValueError, match="not a challenge"):
        responder.challenge(b'{"nonce": "xyz", "url": "http://a:1"}', SEEN)
    with pytest.raises(ValueError, match="not a proof"):
        responder.prove(b"[]")
    ex = Exchange(SECRET, URL)
    ex.challenge()
    for status, body, refusal in (
        (404, b"{}", Refusal.NO_CHALLENGE),
        (409, b'{"error": {"code": "no_cluster_secret"}}', Refusal.NO_SECRET),
        (401, b"{}", Refusal.WRONG_SECRET),
        (200, b'{"nonce": 1}', Refusal.MALFORMED),
    ):
        with pytest.raises(Refused) as caught:
            ex.proof(status, body)
        assert caught.value.refusal is refusal
    with pytest.raises(NotAnswered):
        ex.proof(503, b"draining")


def test_the_responder_keeps_a_bounded_number_of_challenges() -> None:
    clock = Clock()
    responder = Responder(SECRET, "decode", clock=clock, max_pending=MAX_PENDING)
    for _ in range(MAX_PENDING + 5):
        responder.challenge(Exchange(SECRET, URL).challenge(), SEEN)
    assert responder.num_pending == MAX_PENDING
    clock.now += TTL_S + 1  # expired ones go first
    responder.challenge(Exchange(SECRET, URL).challenge(), SEEN)
    assert responder.num_pending == 1


@pytest.mark.parametrize(
    ("url", "seen", "matches"),
    [
        ("http://10.0.0.7:8000", "10.0.0.7:8000", True),
        ("http://10.0.0.7", "10.0.0.7:80", True),
        ("https://10.0.0.7", "10.0.0.7:443", True),
        ("http://[fd00::5]:8000", "[fd00::5]:8000", True),
        ("http://10.0.0.7:8000", "[::ffff:10.0.0.7]:8000", True),
        ("http://10.0.0.7:8000", "10.0.0.8:8000", False),
        ("http://10.0.0.7:8000", "", False),
        ("http://prefill.ns.svc.cluster.local.:8000", "", True),
    ],
)
def test_address_matches(url: str, seen: str, matches: bool) -> None:
    assert address_matches(url, seen) is matches


def test_seen_address_of_an_asgi_server() -> None:
    assert seen_address(("10.0.0.7", 8000)) == "10.0.0.7:8000"
    assert seen_address(("::ffff:10.0.0.7", 8000)) == "10.0.0.7:8000"
    assert seen_address(("fd00::5", 8000)) == "[fd00::5]:8000"
    assert seen_address(("/run/kvduplex.sock", None)) == ""
    assert seen_address(None) == ""


def test_the_proof_routes_are_open_behind_the_guard_and_nothing_else_is() -> None:
    """An instance's two proof routes answer callers without the secret (that is how they
    prove it); its other internal routes still need it; one without a secret answers 409."""
    def app(responder: Responder | None) -> TestClient:
        inner = FastAPI()
        inner.include_router(make_auth_router(responder))

        @inner.get("/internal/kv/stats")
        async def stats() -> dict:
            return {}

        inner.add_middleware(InternalGuard, secret=SECRET, max_body_bytes=4096)
        return TestClient(inner)

    client = app(Responder(SECRET, "prefill"))
    assert client.get("/internal/kv/stats").status_code == 401
    ex = Exchange(SECRET, "http://testserver")
    first = client.post("/internal/auth/challenge", content=ex.challenge())
    second = client.post("/internal/auth/proof", content=ex.proof(first.status_code, first.content))
    assert ex.check(second.status_code, second.content) == "prefill"
    replay = client.post("/internal/auth/proof", content=second.request.content)
    assert replay.status_code == 401
    assert replay.json()["error"]["code"] == "invalid_cluster_secret"
    assert client.post("/internal/auth/challenge", content=b"{}").status_code == 400
    big = b'{"nonce": "' + b"0" * 5000 + b'"}'
    assert client.post("/internal/auth/challenge", content=big).status_code == 413
    no_secret = app(None).post("/internal/auth/challenge", content=ex.challenge())
    assert no_secret.status_code == 409
    with pytest.raises(Refused) as caught:
        Exchange(SECRET, "http://testserver").proof(no_secret.status_code, no_secret.content)
    assert caught.value.refusal is Refusal.NO_SECRET
