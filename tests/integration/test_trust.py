"""The trust boundary on real processes: P and D share a cluster secret.

Every internal route answers 401 without it; the flows work with it (the
instances send it on their own handshakes and pull releases); an instance with
another secret cannot connect; internal routes refuse oversize bodies, ids out
of range and ids of other requests; and an offer from a NIXL agent that P never
handshook with is refused without a trace in P's cache. The push and pull flows
are driven here directly, as the router drives them.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.trust import SECRET_HEADER
from kvduplex.common.trust import secret_headers
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.kvflow.messages import KVOffer
from kvduplex.model.loader import load_model
from kvduplex.transport.messages import MessageCodec
from tests.integration.conftest import Deployment
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import kv_stats
from tests.integration.conftest import metric
from tests.integration.conftest import start_deployment
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl
from tests.transfer.peer_procs import PeerLauncher

pytestmark = pytest.mark.integration

skip_module_without_nixl()

SECRET = "trust-test-" + uuid.uuid4().hex
OTHER_SECRET = "other-cluster-" + uuid.uuid4().hex
AUTH = secret_headers(SECRET)
BS = 8
_SERVE = ["serve", "--model", "tiny", "--num-blocks", "96", "--block-size", str(BS)]
_SERVE += ["--log-level", "warning", "--kv-wait-timeout-s", "3"]


@pytest.fixture(scope="module")
def sec(cluster: LocalCluster) -> Deployment:
    """P and D of one cluster (no routers)."""
    return start_deployment(cluster, _SERVE, env={"KVDUPLEX_CLUSTER_SECRET": SECRET})


@pytest.fixture(scope="module")
def stranger(cluster: LocalCluster) -> str:
    """A decode instance of another cluster (another secret)."""
    other = {"KVDUPLEX_CLUSTER_SECRET": OTHER_SECRET}
    proc = cluster.start("decode-stranger", [*_SERVE, "--role", "decode"], free_port(), env=other)
    cluster.wait_healthy(timeout_s=180)
    return proc.url


@pytest.fixture(autouse=True)
def clean_pools(sec: Deployment) -> Iterator[None]:
    yield
    for url in (sec.prefill, sec.decode):
        assert_pool_clean(url, SECRET)
    assert_pool_clean(sec.reference)


def _body(prompt: list[int], max_tokens: int = 6, **extra: object) -> dict:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }  # fmt: skip


def _ids(n: int, salt: int) -> list[int]:
    return [(salt * 131 + i * 7) % 250 + 1 for i in range(n)]


def _reference(sec: Deployment, body: dict) -> list[int]:
    resp = httpx.post(sec.reference + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


def _get(url: str, path: str) -> dict:
    resp = httpx.get(url + path, headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def _assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_cluster_secret" and SECRET_HEADER in err["message"]
    assert err["type"] == "invalid_request_error"


_P_ROUTES = [
    ("GET", "/internal/kv/handshake"), ("GET", "/internal/kv/stats"),
    ("GET", "/internal/kv/push/stats"), ("GET", "/internal/kv/return/stats"),
    ("POST", "/internal/prefill"), ("POST", "/internal/release"),
    ("POST", "/internal/push/prefill"), ("POST", "/internal/push/cancel"),
]  # fmt: skip
_D_ROUTES = [
    ("GET", "/internal/kv/handshake"), ("GET", "/internal/kv/stats"),
    ("GET", "/internal/kv/pull/stats"), ("GET", "/internal/kv/push/stats"),
    ("GET", "/internal/kv/return/stats"), ("POST", "/internal/kv/retained"),
    ("POST", "/internal/push/cancel"),
]  # fmt: skip


def test_every_internal_route_needs_the_secret(sec: Deployment) -> None:
    for url, routes in ((sec.prefill, _P_ROUTES), (sec.decode, _D_ROUTES)):
        for method, path in routes:
            for headers in ({}, {SECRET_HEADER: OTHER_SECRET}, {SECRET_HEADER: SECRET[:-1]}):
                _assert_401(httpx.request(method, url + path, json={}, headers=headers, timeout=10))
            # With it, the request reaches the route: GETs answer, empty bodies are invalid.
            resp = httpx.request(method, url + path, json={}, headers=AUTH, timeout=10)
            assert resp.status_code == (200 if method == "GET" else 400), (path, resp.text)
    # kv_transfer_params on the public API name peers and where KV goes: members only.
    params = {"mode": "push", "xid": "x-no-secret", "prefill_url": sec.prefill}
    _assert_401(
        httpx.post(
            sec.decode + "/v1/completions",
            json=_body([1, 2, 3], kv_transfer_params=params),
            timeout=10,
        )
    )
    plain = httpx.post(sec.decode + "/v1/completions", json=_body([1, 2, 3]), timeout=30)
    assert plain.status_code == 200 and plain.json()["choices"][0]["token_ids"] == _reference(
        sec, _body([1, 2, 3])
    )


def _push(
    sec: Deployment, xid: str, body: dict, decode: str | None = None
) -> tuple[httpx.Response, httpx.Response]:
    """P's and D's answers to one push, both sent at once as the router sends them."""
    decode = decode or sec.decode
    p_req = {"xid": xid, "prompt_token_ids": body["prompt"], "decode_url": decode}
    d_body = {
        **body,
        "kv_transfer_params": {"mode": "push", "xid": xid, "prefill_url": sec.prefill},
    }
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            httpx.post, sec.prefill + "/internal/push/prefill", json=p_req, headers=AUTH, timeout=60
        )
        d = pool.submit(
            httpx.post, decode + "/v1/completions", json=d_body, headers=AUTH, timeout=60
        )
        return p.result(), d.result()


def test_push_and_pull_between_members_match_colocated(sec: Deployment) -> None:
    def stats() -> dict:
        return _get(sec.decode, "/internal/kv/push/stats")

    before = stats()
    body = _body(_ids(37, salt=1))
    p_ans, d_ans = _push(sec, "trust-push-1", body)
    assert p_ans.status_code == 200 and d_ans.status_code == 200, (p_ans.text, d_ans.text)
    assert d_ans.json()["choices"][0]["token_ids"] == _reference(sec, body)
    after = stats()
    assert after["num_received"] == before["num_received"] + 1
    assert after["num_fallbacks"] == before["num_fallbacks"], "D handshook with P using the secret"
    # Pull: D READs and then releases P's lease over HTTP, with the secret. The lease
    # (30 s) outlives the pool check's deadline, so a clean P means the release worked.
    body = _body(_ids(29, salt=2))
    held = httpx.post(
        sec.prefill + "/internal/prefill", json={"xid": "trust-pull-1", "prompt_token_ids": body["prompt"]},
        headers=AUTH, timeout=60,
    ).json()  # fmt: skip
    params = {"mode": "pull", "xid": "trust-pull-1", "prefill_url": sec.prefill, **{
        k: held[k] for k in ("engine_id", "block_ids", "num_tokens", "ids_digest", "lease_s")
    }}  # fmt: skip
    resp = httpx.post(
        sec.decode + "/v1/completions",
        json=_body(body["prompt"], kv_transfer_params=params),
        headers=AUTH,
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == _reference(
        sec, body
    )
    assert_pool_clean(sec.prefill, SECRET, timeout_s=15)


def test_an_instance_of_another_cluster_cannot_connect(sec: Deployment, stranger: str) -> None:
    p_ans, d_ans = _push(sec, "trust-stranger-1", _body(_ids(20, salt=3)), decode=stranger)
    # P cannot fetch the stranger's handshake, the stranger cannot present P's secret.
    assert p_ans.status_code == 502 and "cluster secret" in p_ans.json()["error"]["message"]
    _assert_401(d_ans)


def test_internal_routes_refuse_oversize_bodies(sec: Deployment) -> None:
    big = b'{"xid": "' + b"x" * (17 << 20) + b'"}'
    for headers in (AUTH, {}):  # the secret is checked first: a stranger's body is never read
        resp = httpx.post(sec.prefill + "/internal/push/prefill", content=big, headers={
            **headers, "content-type": "application/json"}, timeout=60)  # fmt: skip
        assert resp.status_code == (413 if headers else 401), resp.text[:200]
    assert resp.json()["error"]["code"] == "invalid_cluster_secret"


def test_internal_routes_refuse_bad_and_foreign_ids(sec: Deployment) -> None:
    post = _post
    prompt = _ids(24, salt=4)
    # Malformed: an xid too long or empty, a token outside the vocabulary, bad sampling.
    malformed = [
        {"xid": "x" * 300}, {"xid": ""}, {"prompt_token_ids": [1, 10**6]}, {"prompt_token_ids": []},
        {"temperature": -1}, {"top_k": 0}, {"top_p": 0}, {"seed": 2**80}, {"temperature": "hot"},
    ]  # fmt: skip
    for bad in malformed:
        for path in ("/internal/prefill", "/internal/push/prefill"):
            fields = {"xid": "bad-1", "prompt_token_ids": prompt, "decode_url": sec.decode, **bad}
            resp = post(sec.prefill, path, fields)
            assert resp.status_code == 400 and "error" in resp.json(), (path, bad, resp.text)
    # Unknown ids.
    assert post(sec.prefill, "/internal/release", {"xid": "never-leased"}).status_code == 404
    assert post(sec.decode, "/internal/push/cancel", {"xid": "never-pushed"}).status_code == 404
    assert post(sec.decode, "/internal/kv/retained", {"session_id": "no-such"}).status_code == 404
    # A pull lease on P; a push or a second prefill under its xid is refused, the lease kept.
    held = post(
        sec.prefill, "/internal/prefill", {"xid": "lease-a", "prompt_token_ids": prompt}
    ).json()
    push = {"xid": "lease-a", "prompt_token_ids": prompt, "decode_url": sec.decode}
    resp = post(sec.prefill, "/internal/push/prefill", push)
    assert resp.status_code == 400 and "in use" in resp.json()["error"]["message"]
    assert (
        post(
            sec.prefill, "/internal/prefill", {"xid": "lease-a", "prompt_token_ids": prompt}
        ).status_code
        == 400
    )
    assert kv_stats(sec.prefill, SECRET)["num_in_use"] == len(held["block_ids"])
    # Block ids out of the peer's range (pull params on D, a retained turn on P).
    params = {**{k: held[k] for k in ("engine_id", "num_tokens", "lease_s")}, "mode": "pull",
              "xid": "lease-a", "prefill_url": sec.prefill, "block_ids": [0, 1, 10**6]}  # fmt: skip
    resp = post(sec.decode, "/v1/completions", _body(prompt, kv_transfer_params=params))
    assert resp.status_code == 400 and "out of range" in resp.json()["error"]["message"]
    params["block_ids"] = [0, -1, 2]
    assert (
        post(sec.decode, "/v1/completions", _body(prompt, kv_transfer_params=params)).status_code
        == 400
    )
    keys = [
        bytes(k).hex()
        for k in compute_block_hashes(prompt, BS, load_model(ModelLoadConfig()).identity)
    ]
    retained = {
        "decode_url": sec.decode,
        "block_ids": [10**6, 1, 2],
        "keys": keys,
        "token_ids": prompt,
    }
    resp = post(
        sec.prefill, "/internal/push/prefill", {**push, "xid": "ret-oob", "pull_from": retained}
    )
    assert resp.status_code == 400 and "out of range" in resp.json()["error"]["message"]
    assert post(sec.prefill, "/internal/release", {"xid": "lease-a"}).status_code == 200


def test_two_decode_requests_cannot_wait_on_one_xid(sec: Deployment) -> None:
    """The first waits for a push that never comes (D's 3 s deadline, then it computes the
    prompt); the second, under the same xid meanwhile, is refused with 409."""
    body = _body(
        _ids(30, salt=5),
        kv_transfer_params={"mode": "push", "xid": "dup-1", "prefill_url": sec.prefill},
    )
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            httpx.post, sec.decode + "/v1/completions", json=body, headers=AUTH, timeout=60
        )
        wait_until(
            lambda: kv_stats(sec.decode, SECRET)["num_in_use"] > 0,
            what="the first request admitted",
        )
        second = httpx.post(sec.decode + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert second.status_code == 409, second.text
        assert first.result().json()["choices"][0]["token_ids"] == _reference(
            sec, _body(body["prompt"])
        )


def test_offer_from_an_agent_that_never_handshook_is_refused(sec: Deployment, tmp_path: Path) -> None:
    """A NIXL agent that holds P's handshake (as anyone who got past the secret would) offers
    P a well-formed turn, once as itself and once claiming to be D: P never connected to
    its agent, so P's transport refuses both and P caches nothing."""
    launcher = PeerLauncher(tmp_path)
    try:
        rogue = launcher.spawn(
            num_layers=4, num_kv_heads=2, head_dim=32, block_size=BS, num_blocks=32
        )
        handshake = httpx.get(sec.prefill + "/internal/kv/handshake", headers=AUTH, timeout=10)
        p_engine = httpx.post(
            rogue.url + "/test/connect", content=handshake.content, timeout=30
        ).json()["engine_id"]
        tokens = _ids(32, salt=6)
        keys = compute_block_hashes(tokens, BS, load_model(ModelLoadConfig()).identity)
        offer = KVOffer("rogue-offer-1", "victim", [bytes(k) for k in keys], tokens)

        def stats() -> dict:
            return _get(sec.prefill, "/internal/kv/return/stats")

        before, cached = stats(), kv_stats(sec.prefill, SECRET)["num_cached"]
        d_engine = httpx.get(sec.decode + "/health", headers=AUTH, timeout=10).json()["engine_id"]
        refused = "kvduplex_kv_notifications_refused_total"
        num_refused = metric(sec.prefill, refused, reason="unknown_agent")
        payload = base64.b64encode(MessageCodec().encode(offer)).decode()
        for claim in (None, d_engine):
            httpx.post(rogue.url + "/test/notify", json={
                "engine_id": p_engine, "xid": offer.xid, "payload": payload, "claim": claim,
            }, timeout=10).raise_for_status()  # fmt: skip
        wait_until(
            lambda: metric(sec.prefill, refused, reason="unknown_agent") == num_refused + 2,
            what="P refusing both offers",
        )
        assert stats()["num_accepted"] == before["num_accepted"]
        assert stats()["num_refused"] == before["num_refused"], "refused before the flows see it"
        assert (
            httpx.get(rogue.url + "/test/notifs", params={"timeout": 0.5}, timeout=10).json() == []
        )
        assert kv_stats(sec.prefill, SECRET)["num_cached"] == cached
        # A later request with that prefix finds nothing cached on P.
        resp = httpx.post(sec.prefill + "/internal/prefill", json={"xid": "after-rogue", "prompt_token_ids": [*tokens, 7]},
                          headers=AUTH, timeout=60)  # fmt: skip
        assert resp.json()["num_cached_tokens"] == 0
        assert (
            httpx.post(
                sec.prefill + "/internal/release",
                json={"xid": "after-rogue"},
                headers=AUTH,
                timeout=10,
            ).status_code
            == 200
        )
    finally:
        launcher.stop_all()
