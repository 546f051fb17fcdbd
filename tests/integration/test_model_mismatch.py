"""P and D that serve different things, behind real routers: no KV moves between them.

P runs ``tiny`` with seed 1, D ``tiny`` with seed 2 (same architecture, layout,
tokenizer and block size: only the weights differ). Their KV handshakes refuse
each other, naming the weights, so every answer through a router (push with
the duplex return, and pull) is what D alone gives, or a clear error naming
the mismatch; and D's own cache holds nothing of P's: the same prompts sent to
D directly answer as a fresh instance with D's weights does. Then the same with
two Hugging Face folders of one model that differ in their tokenizer only.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import kv_stats
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl
from tests.unit.test_fingerprint import write_hf_llama
from tests.unit.test_tokenizer import write_hf_tokenizer

pytestmark = pytest.mark.integration

skip_module_without_nixl()

BS = 8
_SERVE = ["serve", "--model", "tiny", "--num-blocks", "96", "--block-size", str(BS)]
_SERVE += ["--log-level", "warning", "--kv-wait-timeout-s", "3"]


@dataclass
class Mismatched:
    prefill: str
    decode: str
    fresh: str
    """A colocated instance with D's weights, which no request through a router reaches."""
    routers: dict[str, str]


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> Mismatched:
    p = cluster.start("prefill", [*_SERVE, "--seed", "1", "--role", "prefill"], free_port())
    d = cluster.start("decode", [*_SERVE, "--seed", "2", "--role", "decode"], free_port())
    fresh = cluster.start("fresh", [*_SERVE, "--seed", "2", "--role", "both"], free_port())
    cluster.wait_healthy(timeout_s=180)
    routers = {}
    for mode, flags in (("push", ["--return-mode", "push"]), ("pull", ["--return-mode", "none"])):
        args = ["router", "--mode", mode, "--model", "tiny", *flags, "--prefill", p.url]
        routers[mode] = cluster.start(f"router-{mode}", [*args, "--decode", d.url], free_port()).url
    cluster.wait_healthy(timeout_s=60)
    return Mismatched(p.url, d.url, fresh.url, routers)


@pytest.fixture()
def clean_pools(rig: Mismatched) -> Iterator[None]:
    yield
    for url in (rig.prefill, rig.decode, rig.fresh):
        assert_pool_clean(url)


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 37 + i * 11) % 250 + 1 for i in range(n)]


def _body(prompt: list[int], max_tokens: int = 8) -> dict:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip


def _answer(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


@pytest.mark.usefixtures("clean_pools")
def test_health_shows_fingerprints_that_differ_in_the_weights_only(rig: Mismatched) -> None:
    p, d, fresh = (httpx.get(u + "/health", timeout=10).json() for u in (rig.prefill, rig.decode, rig.fresh))
    assert p["fingerprint"]["weights"] == "preset:tiny:seed=1"
    assert d["fingerprint"]["weights"] == "preset:tiny:seed=2"
    assert d["fingerprint"] == fresh["fingerprint"]
    differing = {k for k in p["fingerprint"] if p["fingerprint"][k] != d["fingerprint"][k]}
    assert differing == {"weights", "digest"}


@pytest.mark.usefixtures("clean_pools")
def test_every_answer_through_a_router_is_ds_own_and_ds_cache_stays_clean(
    rig: Mismatched,
) -> None:
    # Prompts of several whole blocks (what a push would write and a return would offer),
    # one session sent twice (a duplex return after the first turn, a prefix hit after).
    prompts = [_prompt(n, salt) for salt, n in enumerate((5 * BS, 3 * BS + 3, 7 * BS, 2 * BS))]
    prompts.append(prompts[0] + _prompt(2 * BS, 9))
    num_errors = 0
    for mode, router in rig.routers.items():
        for prompt in prompts:
            resp = _answer(router, _body(prompt))
            if resp.status_code != 200:  # allowed: a clear error that names the mismatch
                num_errors += 1
                assert 400 <= resp.status_code < 600, resp.text
                assert "weights" in resp.text and "seed" in resp.text, (mode, resp.text)
                continue
            assert _ids(resp) == _ids(_answer(rig.fresh, _body(prompt))), (mode, prompt)
            kv = resp.json()["usage"]["kv"]
            assert kv["bytes_to_decode"] == 0 and kv["prefill_computed_tokens"] == 0, (mode, kv)
    assert num_errors < len(prompts) * len(rig.routers), "every request failed"
    # Nothing of P's reached D: D's own answers to the same prompts, now that its cache holds
    # whatever these requests left there, are a fresh instance's with D's weights.
    for prompt in prompts:
        assert _ids(_answer(rig.decode, _body(prompt))) == _ids(_answer(rig.fresh, _body(prompt)))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    for router in rig.routers.values():
        resp = _answer(router, chat, "/v1/chat/completions")
        if resp.status_code == 200:
            expected = _answer(rig.fresh, chat, "/v1/chat/completions")
            assert _ids(resp) == _ids(expected)
    # P cached nothing of D's either: D's turns were never returned to it.
    wait_until(lambda: kv_stats(rig.prefill)["num_in_use"] == 0, what="P's blocks released")
    returns = httpx.get(rig.decode + "/internal/kv/return/stats", timeout=10).json()
    assert returns.get("num_done", 0) == 0, returns


@pytest.mark.usefixtures("clean_pools")
def test_the_refusal_names_the_weights(rig: Mismatched) -> None:
    """P's push prefill, asked to push to D directly, refuses with the reason."""
    body = {"xid": "mm-1", "prompt_token_ids": _prompt(2 * BS, 3), "decode_url": rig.decode}
    resp = httpx.post(rig.prefill + "/internal/push/prefill", json=body, timeout=60)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "incompatible_peer"
    assert "weights: preset:tiny:seed=1 here vs preset:tiny:seed=2 there" in error["message"]


@pytest.fixture(scope="module")
def tok_rig(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Mismatched:
    """P on folder ``p`` and D (and a fresh colocated instance) on folder ``d``: the same
    weights and chat template, another tokenizer; a push router with the return."""
    root = tmp_path_factory.mktemp("folders")
    write_hf_llama(root / "p", tokenizer_vocab=300)
    shutil.copytree(root / "p", root / "d")
    write_hf_tokenizer(root / "d", vocab_size=290)
    serve = ["serve", "--served-model-name", "m", "--num-blocks", "96", "--block-size", str(BS)]
    serve += ["--log-level", "warning", "--kv-wait-timeout-s", "3", "--dtype", "float32"]
    p = cluster.start("tok-prefill", [*serve, "--model", str(root / "p"), "--role", "prefill"], free_port())
    d = cluster.start("tok-decode", [*serve, "--model", str(root / "d"), "--role", "decode"], free_port())
    fresh = cluster.start("tok-fresh", [*serve, "--model", str(root / "d"), "--role", "both"], free_port())
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--mode", "push", "--model", str(root / "d"), "--return-mode", "push"]
    router = cluster.start("tok-router", [*args, "--prefill", p.url, "--decode", d.url], free_port())
    cluster.wait_healthy(timeout_s=60)
    return Mismatched(p.url, d.url, fresh.url, {"push": router.url})


def test_a_tokenizer_only_difference_moves_no_kv(tok_rig: Mismatched) -> None:
    p, d = (httpx.get(u + "/health", timeout=10).json()["fingerprint"] for u in (tok_rig.prefill, tok_rig.decode))
    assert {k for k in p if p[k] != d[k]} == {"tokenizer", "digest"}
    router = tok_rig.routers["push"]
    prompts = [_prompt(n, salt) for salt, n in enumerate((4 * BS, 6 * BS + 5))]
    texts = ["the quick brown fox jumps over the lazy dog " * 4, "hello world, paged attention " * 5]
    bodies = [{**_body(prompt), "model": "m"} for prompt in prompts]
    bodies += [{**_body([]), "model": "m", "prompt": text} for text in texts]
    for body in bodies:
        resp = _answer(router, body)
        if resp.status_code != 200:
            assert "tokenizer" in resp.text, resp.text
            continue
        assert _ids(resp) == _ids(_answer(tok_rig.fresh, body)), body["prompt"]
        assert resp.json()["usage"]["kv"]["bytes_to_decode"] == 0
    for body in bodies:
        assert _ids(_answer(tok_rig.decode, body)) == _ids(_answer(tok_rig.fresh, body))
    for url in (tok_rig.prefill, tok_rig.decode, tok_rig.fresh):
        assert_pool_clean(url)
