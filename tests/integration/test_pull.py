"""Pull mode end to end: router → prefill (held blocks) → decode READs them over NIXL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import Deployment
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import start_deployment
from tests.integration.conftest import start_router
from tests.integration.conftest import stream
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

_SERVE = ["serve", "--model", "tiny", "--num-blocks", "128", "--block-size", "8", "--log-level", "warning"]


@pytest.fixture(scope="module")
def dep(cluster: LocalCluster) -> Deployment:
    return start_deployment(cluster, _SERVE, modes=("pull",))


def _complete(url: str, prompt: str, max_tokens: int = 10) -> list[int]:
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    ids = list(resp.json()["choices"][0]["token_ids"])
    assert len(ids) == max_tokens, ids
    return ids


def _stream(url: str, path: str, body: dict) -> list[int]:
    """Token ids of a streamed answer."""
    return stream(url, path, body)[0]


def _pull_body(prompt: str, **pull: object) -> dict[str, Any]:
    """A greedy 6-token completion that decode serves by pulling the prompt's KV as `pull`
    (``xid``, ``prefill_url``, ``block_ids``, ``num_tokens``, ...) says."""
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": {"mode": "pull", **pull},
    }  # fmt: skip


def _assert_falls_back(dep: Deployment, prompt: str, body: dict) -> None:
    """D answers `body` (a pull it cannot do) exactly, by computing locally: one failed pull."""
    failed = httpx.get(dep.decode + "/internal/kv/pull/stats", timeout=10).json()["num_failed"]
    resp = httpx.post(dep.decode + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == _complete(dep.reference, prompt, 6)
    stats = httpx.get(dep.decode + "/internal/kv/pull/stats", timeout=10).json()
    assert stats["num_failed"] == failed + 1


def _pulled_blocks(d: str) -> int:
    return int(httpx.get(d + "/internal/kv/pull/stats", timeout=10).json()["num_pulled_blocks"])


PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog",  # not a multiple of the block size
    "abcdefghijklmnop",  # 17 tokens with BOS
    "A longer prompt that spans several KV blocks of eight tokens each, and then some more.",
]


def test_router_matches_colocated_concurrently(dep: Deployment) -> None:
    before = _pulled_blocks(dep.decode)
    failed = httpx.get(dep.decode + "/internal/kv/pull/stats", timeout=10).json()["num_failed"]
    with ThreadPoolExecutor(4) as pool:
        routed = list(pool.map(lambda p: _complete(dep.routers["pull"], p), PROMPTS))
    expected = [_complete(dep.reference, p) for p in PROMPTS]
    assert routed == expected
    assert _pulled_blocks(dep.decode) > before
    assert httpx.get(dep.decode + "/internal/kv/pull/stats", timeout=10).json()["num_failed"] == failed


def test_streaming_completion_and_chat(dep: Deployment) -> None:
    body = {
        "model": "tiny", "prompt": PROMPTS[3] + " streamed", "max_tokens": 8,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    assert _stream(dep.routers["pull"], "/v1/completions", body) == _stream(dep.reference, "/v1/completions", body)
    chat = {
        "model": "tiny", "messages": [{"role": "user", "content": "hello over the pull path"}],
        "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    assert _stream(dep.routers["pull"], "/v1/chat/completions", chat) == _stream(
        dep.reference, "/v1/chat/completions", chat
    )
    full = httpx.post(dep.routers["pull"] + "/v1/chat/completions", json=chat, timeout=120).json()
    assert full["choices"][0]["token_ids"] == _stream(dep.reference, "/v1/chat/completions", chat)


def test_release_unknown_xid_is_404(dep: Deployment) -> None:
    resp = httpx.post(dep.prefill + "/internal/release", json={"xid": "nope"}, timeout=10)
    assert resp.status_code == 404
    assert "error" in resp.json()


def test_models_and_health(dep: Deployment) -> None:
    assert httpx.get(dep.routers["pull"] + "/health").status_code == 200
    assert [m["id"] for m in httpx.get(dep.routers["pull"] + "/v1/models").json()["data"]] == ["tiny"]


def test_prefill_down_decode_computes_alone(cluster: LocalCluster, dep: Deployment) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    r = start_router(cluster, "router-dead-prefill", "pull", dead, dep.decode)
    cluster.wait_healthy(timeout_s=60)
    before = _pulled_blocks(dep.decode)
    assert _complete(r.url, PROMPTS[1] + " alone") == _complete(dep.reference, PROMPTS[1] + " alone")
    assert _pulled_blocks(dep.decode) == before
    cluster.stop_process(r)


def test_unreachable_prefill_url_falls_back_on_decode(dep: Deployment) -> None:
    prompt = PROMPTS[3] + " fallback"
    body = _pull_body(
        prompt, xid="x-unreachable", prefill_url=f"http://127.0.0.1:{free_port()}",
        block_ids=[0, 1, 2], num_tokens=3,
    )  # fmt: skip
    resp = httpx.post(dep.decode + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == _complete(dep.reference, prompt, 6)


def test_mismatched_pull_spec_fails_over_to_local_prefill(dep: Deployment) -> None:
    prompt = PROMPTS[3] + " mismatch"
    body = _pull_body(prompt, xid="x-mismatch", prefill_url=dep.prefill, block_ids=[0], num_tokens=3)
    _assert_falls_back(dep, prompt, body)


def test_prefill_release_then_404(dep: Deployment) -> None:
    body = {"xid": "x-release", "prompt_token_ids": list(range(1, 20))}
    ans = httpx.post(dep.prefill + "/internal/prefill", json=body, timeout=60).json()
    assert ans["xid"] == "x-release" and ans["num_tokens"] == 19 and len(ans["block_ids"]) == 3
    assert isinstance(ans["engine_id"], str) and isinstance(ans["first_token"], int)
    rel = httpx.post(dep.prefill + "/internal/release", json={"xid": "x-release"}, timeout=10)
    assert rel.status_code == 200
    again = httpx.post(dep.prefill + "/internal/release", json={"xid": "x-release"}, timeout=10)
    assert again.status_code == 404
    bad = httpx.post(dep.prefill + "/internal/prefill", json={"xid": "", "prompt_token_ids": []})
    assert bad.status_code == 400 and "error" in bad.json()


def test_lease_expiry_releases_blocks(cluster: LocalCluster, dep: Deployment) -> None:
    p = cluster.start(
        "prefill-short-lease", [*_SERVE, "--role", "prefill", "--pull-lease-s", "0.3"], free_port()
    )
    cluster.wait_healthy(timeout_s=120)
    body = {"xid": "x-lease", "prompt_token_ids": list(range(1, 30))}
    ans = httpx.post(p.url + "/internal/prefill", json=body, timeout=60)
    assert ans.status_code == 200, ans.text
    assert len(ans.json()["block_ids"]) == 4  # 29 tokens held in blocks of 8
    assert_pool_clean(p.url)  # nobody released them: the lease did
    rel = httpx.post(p.url + "/internal/release", json={"xid": "x-lease"}, timeout=10)
    assert rel.status_code == 404
    cluster.stop_process(p)


def test_expired_lease_is_not_read(dep: Deployment) -> None:
    prompt = PROMPTS[3] + " late"
    ids = httpx.post(
        dep.decode + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "return_token_ids": True},
        timeout=60,
    ).json()["prompt_token_ids"]
    ans = httpx.post(
        dep.prefill + "/internal/prefill", json={"xid": "x-late", "prompt_token_ids": ids}, timeout=60
    ).json()
    body = _pull_body(
        prompt, xid="x-late", prefill_url=dep.prefill,
        block_ids=ans["block_ids"], num_tokens=ans["num_tokens"], ids_digest=ans["ids_digest"],
        lease_s=0.01,
    )  # fmt: skip
    _assert_falls_back(dep, prompt, body)


def test_pools_clean_and_transfers_happened(dep: Deployment) -> None:
    before = _pulled_blocks(dep.decode)
    prompt = PROMPTS[3] + " and the pools stay clean"
    assert _complete(dep.routers["pull"], prompt) == _complete(dep.reference, prompt)
    assert _pulled_blocks(dep.decode) > before
    assert_pool_clean(dep.prefill)
    assert_pool_clean(dep.decode)
