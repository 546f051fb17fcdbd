"""Routing over two prefill and two decode instances: new sessions spread, a session's
turns stay on one prefill and one decode instance (named or recognised by its prompt).

Which instance served a request is read from its finished-request counter
(``kvduplex_requests_finished_total``); requests of the stickiness test run one
at a time so that each moves exactly one prefill and one decode counter.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

_SERVE = ["serve", "--model", "tiny", "--num-blocks", "256", "--block-size", "8",
          "--log-level", "warning"]  # fmt: skip
MODES = ["push", "pull"]
SYSTEM = "You are a coding agent. Use the tools; answer briefly. " * 3


@dataclass
class Quad:
    prefill: list[str]
    decode: list[str]
    routers: dict[str, str]

    @property
    def instances(self) -> list[str]:
        return [*self.prefill, *self.decode]


@pytest.fixture(scope="module")
def quad(cluster: LocalCluster) -> Quad:
    ps = [cluster.start(f"prefill-{i}", [*_SERVE, "--role", "prefill"], free_port()) for i in (0, 1)]
    ds = [cluster.start(f"decode-{i}", [*_SERVE, "--role", "decode"], free_port()) for i in (0, 1)]
    cluster.wait_healthy(timeout_s=180)
    p_urls, d_urls = [p.url for p in ps], [d.url for d in ds]
    routers = {}
    for mode in MODES:
        args = ["router", "--mode", mode, "--model", "tiny", "--return-mode", "none",
                "--prefill", *p_urls, "--decode", *d_urls]  # fmt: skip
        routers[mode] = cluster.start(f"router-{mode}", args, free_port()).url
    cluster.wait_healthy(timeout_s=60)
    return Quad(p_urls, d_urls, routers)


@pytest.fixture(autouse=True)
def clean_pools(quad: Quad) -> Iterator[None]:
    yield
    for url in quad.instances:
        assert_pool_clean(url)


def _served(quad: Quad) -> dict[str, float]:
    """Finished requests per instance."""
    return {url: metric(url, "kvduplex_requests_finished_total") for url in quad.instances}


def _chat(router: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
          **extra: Any) -> str:  # fmt: skip
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True, **extra}  # fmt: skip
    resp = httpx.post(router + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def test_concurrent_new_sessions_reach_every_instance(quad: Quad) -> None:
    """Eight conversations that share a system prompt, all at once: before sessions and
    load counted from assignment, every one went to the same prefill instance."""
    router = quad.routers["push"]
    before = _served(quad)
    misses = metric(router, "kvduplex_router_session_misses_total")
    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {i}: fix it"}]
        for i in range(8)
    ]
    with ThreadPoolExecutor(len(conversations)) as pool:
        list(pool.map(lambda m: _chat(router, m), conversations))
    wait_until(
        lambda: sum(_served(quad).values()) - sum(before.values()) == 16,
        what="every prefill and decode counted",
    )
    after = _served(quad)
    per_instance = {url: after[url] - before[url] for url in quad.instances}
    assert all(n >= 2 for n in per_instance.values()), per_instance
    assert metric(router, "kvduplex_router_session_misses_total") - misses == 8
    assert metric(router, "kvduplex_router_requests_total", mode="push") >= 8


@pytest.mark.parametrize("mode", MODES)
def test_a_sessions_turns_stay_on_one_prefill_and_one_decode(quad: Quad, mode: str) -> None:
    router = quad.routers[mode]
    # Three sessions over two instances of each role: routing each turn by load alone
    # would move them around (round-robin over an odd number of sessions).
    names: list[tuple[dict[str, str] | None, dict[str, Any]]] = [
        ({"X-Session-Id": f"{mode}-a"}, {}),
        (None, {"prompt_cache_key": f"{mode}-b"}),
        (None, {}),  # recognised by its prompt
    ]
    histories = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{mode} session {i}"}]
        for i in range(len(names))
    ]
    served: list[set[tuple[str, str]]] = [set() for _ in names]
    hits = metric(router, "kvduplex_router_session_hits_total")
    misses = metric(router, "kvduplex_router_session_misses_total")
    for turn in range(3):
        for i, (headers, extra) in enumerate(names):  # interleaved, one request at a time
            before = _served(quad)
            answer = _chat(router, histories[i], headers, **extra)
            wait_until(
                lambda b=before: sum(_served(quad).values()) - sum(b.values()) == 2,
                what="the turn counted on its prefill and decode",
            )
            after = _served(quad)
            (p,) = [url for url in quad.prefill if after[url] > before[url]]
            (d,) = [url for url in quad.decode if after[url] > before[url]]
            served[i].add((p, d))
            histories[i] += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"turn {turn + 1}: go on"},
            ]
    assert all(len(pairs) == 1 for pairs in served), served
    assert {p for pairs in served for p, _ in pairs} == set(quad.prefill), "sessions spread"
    assert metric(router, "kvduplex_router_session_misses_total") - misses == len(names)
    assert metric(router, "kvduplex_router_session_hits_total") - hits == 2 * len(names)
