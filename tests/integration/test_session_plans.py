"""A session turn takes its plan by where its KV is: once prefill's pool has turned over
since the session was there, decode (which still holds the history) computes the new
tokens alone, the turn is not returned to a prefill that would not keep it, and every
answer equals a colocated instance's, token for token."""

from __future__ import annotations

import random

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

BS = 8
_SERVE = ["serve", "--model", "tiny", "--block-size", str(BS), "--log-level", "warning"]


def _complete(url: str, ids: list[int], session: str) -> tuple[list[int], dict]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 10, "temperature": 0.0,
            "ignore_eos": True, "prompt_cache_key": session, "return_token_ids": True}  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return list(out["choices"][0]["token_ids"]), out["usage"]


def _returns_settled(decode_url: str) -> bool:
    st = httpx.get(decode_url + "/internal/kv/return/stats", timeout=10).json()
    return bool(st["num_offered"] == st["num_done"] + st["num_declined"] + st["num_failed"])


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_session_whose_history_prefill_lost_is_computed_by_decode_exactly(
    cluster: LocalCluster,
) -> None:
    p = cluster.start(
        "prefill-small", [*_SERVE, "--num-blocks", "40", "--role", "prefill"], free_port()
    )
    d = cluster.start(
        "decode-roomy", [*_SERVE, "--num-blocks", "400", "--role", "decode"], free_port()
    )
    ref = cluster.start(
        "reference-plans", [*_SERVE, "--num-blocks", "400", "--role", "both"], free_port()
    )
    cluster.wait_healthy(timeout_s=180)
    # A fetched token costing as much as a computed one: no fetch plan (test_fetch_plan).
    args = ["router", "--mode", "push", "--return-mode", "push", "--model", "tiny",
            "--prefill", p.url, "--decode", d.url, "--fetch-token-cost", "1"]  # fmt: skip
    router = cluster.start("router-plans", args, free_port())
    cluster.wait_healthy(timeout_s=60)
    rng = random.Random(11)
    histories = {name: [rng.randrange(1, 250) for _ in range(90)] for name in "abcd"}

    def turn(name: str) -> dict:
        ids = histories[name]
        got, usage = _complete(router.url, ids, f"plans-{name}")
        want, _ = _complete(ref.url, ids, f"ref-{name}")
        assert got == want, f"session {name} at {len(ids)} tokens: {got} != {want}"
        histories[name] = ids + got + [rng.randrange(1, 250) for _ in range(12)]
        wait_until(lambda: _returns_settled(d.url), what="returns to settle")
        return dict(usage["kv"])

    try:
        first = turn("a")
        assert first["prefill_computed_tokens"] > 0
        again = turn("a")  # prefill holds the history and the returned answer
        assert 0 < again["prefill_computed_tokens"] <= 12 + 1 + BS, again
        for name in "bcd":  # three other sessions turn prefill's 40 blocks over
            turn(name)
        before = httpx.get(router.url + "/metrics", timeout=10).text
        late = turn("a")
        assert late["prefill_computed_tokens"] == 0, f"decode alone computes it: {late}"
        assert 0 < late["decode_computed_tokens"] <= 12 + 10 + BS, late
        after = httpx.get(router.url + "/metrics", timeout=10).text
        mode = 'kvduplex_router_requests_total{mode="short_append"}'
        assert _counter(after, mode) == _counter(before, mode) + 1
        skipped = "kvduplex_router_returns_skipped_room_total"
        assert _counter(after, skipped) == _counter(before, skipped) + 1, (
            "prefill lacks the history the answer would extend: not returned"
        )
    finally:
        cluster.stop_process(router)
    for url in (p.url, d.url, ref.url):
        assert_pool_clean(url)
