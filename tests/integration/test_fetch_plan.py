"""The fetch plan on real processes: once prefill's pool has turned over since a session
was there, prefill READs the session's history from decode's pool and computes only the
new tokens (decode computes nothing); when decode's lease runs out before prefill could
read, or decode lends nothing, prefill computes the history. Every answer equals a
colocated instance's, token for token, and every pool ends clean."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.integration.test_session_plans import _complete
from tests.integration.test_session_plans import _returns_settled
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

BS = 8
_SERVE = ["serve", "--model", "tiny", "--block-size", str(BS), "--log-level", "warning"]
NEW_TOKENS = 12
"""Tokens of each turn's new message."""
MAX_NEW_COMPUTED = NEW_TOKENS + 10 + BS
"""At most what prefill computes of a turn over a fetched history: the new message, the
previous answer (10 tokens, its last one without KV) and a partial block."""


@dataclass
class Rig:
    """Prefill with a 40-block pool that other sessions turn over, a roomier decode, a
    router over them (default plans: fetch), and the colocated reference."""

    prefill: Process
    decode: Process
    router: Process
    reference: Process
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    histories: dict[str, list[int]] = field(default_factory=dict)

    def turn(self, name: str) -> dict[str, int]:
        """The session's next turn through the router, checked against the reference;
        its ``usage.kv``."""
        ids = self.histories.get(name) or [self.rng.randrange(1, 250) for _ in range(90)]
        got, usage = _complete(self.router.url, ids, f"fetch-{name}")
        want, _ = _complete(self.reference.url, ids, f"ref-{name}")
        assert got == want, f"session {name} at {len(ids)} tokens: {got} != {want}"
        self.histories[name] = ids + got + [self.rng.randrange(1, 250) for _ in range(NEW_TOKENS)]
        wait_until(lambda: _returns_settled(self.decode.url), what="returns to settle")
        return dict(usage["kv"])

    def counter(self, name: str, **labels: str) -> float:
        return metric(self.router.url, f"kvduplex_router_{name}", **labels)

    def check_clean(self) -> None:
        for proc in (self.prefill, self.decode, self.reference):
            assert_pool_clean(proc.url)


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster) -> Process:
    return cluster.start(
        "reference-fetch", [*_SERVE, "--num-blocks", "400", "--role", "both"], free_port()
    )


def _rig(
    cluster: LocalCluster, reference: Process, name: str, decode_flags: list[str],
    router_flags: list[str],
) -> Iterator[Rig]:  # fmt: skip
    p = cluster.start(
        f"prefill-{name}", [*_SERVE, "--num-blocks", "40", "--role", "prefill"], free_port()
    )
    d = cluster.start(f"decode-{name}", [*_SERVE, "--role", "decode", *decode_flags], free_port())
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--mode", "push", "--return-mode", "push", "--model", "tiny",
            "--prefill", p.url, "--decode", d.url, "--fetch-timeout-s", "30", *router_flags]  # fmt: skip
    router = cluster.start(f"router-{name}", args, free_port())
    cluster.wait_healthy(timeout_s=60)
    try:
        yield Rig(p, d, router, reference)
    finally:
        cluster.stop_process(router)


@pytest.fixture(scope="module")
def fetching(cluster: LocalCluster, reference: Process) -> Iterator[Rig]:
    """Decode's lease outlasts the test: only prefill's release ends it in time."""
    yield from _rig(cluster, reference, "fetch", ["--num-blocks", "400", "--fetch-lease-s", "60"], [])


@pytest.fixture
def short_lease(cluster: LocalCluster, reference: Process) -> Iterator[Rig]:
    """Decode's lease is shorter than the margin prefill's READ keeps before its end, and
    its pool holds 150 blocks; the router probes the instances once an hour, so it does
    not see decode's pool turn over."""
    yield from _rig(
        cluster, reference, "short-lease", ["--num-blocks", "150", "--fetch-lease-s", "0.2"],
        ["--health-interval-s", "3600"],
    )  # fmt: skip


def test_prefill_fetches_a_lost_history_from_decode_and_computes_only_the_new_tokens(
    fetching: Rig,
) -> None:
    rig = fetching
    first = rig.turn("a")
    assert first["prefill_computed_tokens"] > 0 and first["decode_computed_tokens"] == 0
    again = rig.turn("a")  # prefill holds the history and the returned answer: push
    assert 0 < again["prefill_computed_tokens"] <= MAX_NEW_COMPUTED, again
    for name in "bcd":  # three other sessions turn prefill's 40 blocks over
        rig.turn(name)
    fetches, fetched = rig.counter("requests_total", mode="fetch"), rig.counter("fetched_tokens_total")
    late = rig.turn("a")
    assert late["decode_computed_tokens"] == 0, f"decode computes nothing: {late}"
    assert 0 < late["prefill_computed_tokens"] <= MAX_NEW_COMPUTED, late
    assert rig.counter("requests_total", mode="fetch") == fetches + 1
    num_fetched = rig.counter("fetched_tokens_total") - fetched
    assert num_fetched > 0 and num_fetched % BS == 0, "what prefill lacked, in whole blocks"
    assert rig.counter("fetch_misses_total") == 0
    # Decode's 60 s lease ends within the pools' check only by prefill's release.
    rig.check_clean()


def test_decodes_fetch_routes_refuse_what_they_cannot_serve(fetching: Rig) -> None:
    d, p = fetching.decode.url, fetching.prefill.url
    bad = [{}, {"xid": "f", "prompt_token_ids": []}, {"xid": "f", "prompt_token_ids": [-1]},
           {"xid": "f", "prompt_token_ids": "1 2"}, {"xid": "", "prompt_token_ids": [1, 2]},
           {"xid": "f", "prompt_token_ids": [2**40]}]  # fmt: skip
    for body in bad:
        resp = httpx.post(d + "/internal/kv/fetch", json=body, timeout=10)
        assert resp.status_code == 400 and "message" in resp.json()["error"], (body, resp.text)
    resp = httpx.post(
        d + "/internal/kv/fetch", json={"xid": "f", "prompt_token_ids": list(range(1, 40))},
        timeout=10,
    )  # fmt: skip
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_cached"
    resp = httpx.post(d + "/internal/release", json={"xid": "no-such-lease"}, timeout=10)
    assert resp.status_code == 404
    ids = list(range(1, 30))
    push = {"xid": "bad-pull-from", "prompt_token_ids": ids, "decode_url": d}
    neither = {"decode_url": d, "block_ids": [1], "keys": ["00"]}
    longer = {**neither, "num_tokens": 64, "lease_xid": "f"}
    for pull_from in (neither, longer):
        resp = httpx.post(p + "/internal/push/prefill", json={**push, "pull_from": pull_from},
                          timeout=30)  # fmt: skip
        assert resp.status_code == 400 and "pull_from" in resp.text, resp.text
    fetching.check_clean()


def test_prefill_computes_the_history_when_the_lease_runs_out_or_decode_lends_nothing(
    short_lease: Rig,
) -> None:
    rig = short_lease
    for name in "abcd":  # b, c and d turn prefill's pool over after a
        rig.turn(name)
    fetches, misses = rig.counter("requests_total", mode="fetch"), rig.counter("fetch_misses_total")
    late = rig.turn("a")  # decode lends it, but its lease ends before prefill can read
    assert rig.counter("requests_total", mode="fetch") == fetches + 1
    assert rig.counter("fetch_misses_total") == misses, "decode lent the history"
    assert rig.counter("fetched_tokens_total") == 0, "prefill did not read it"
    assert late["decode_computed_tokens"] == 0
    assert late["prefill_computed_tokens"] > MAX_NEW_COMPUTED, f"history recomputed: {late}"

    # Turn decode's pool over behind the router's back: it still counts on decode for b.
    # The fillers are sessions of their own, more recent than b's (decode evicts by
    # session value: plain requests' blocks would go first).
    for i in range(5):
        filler = [(i * 37 + j) % 250 + 1 for j in range(300)]
        resp = httpx.post(rig.decode.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": filler, "max_tokens": 2, "temperature": 0.0,
            "prompt_cache_key": f"filler-{i}"})  # fmt: skip
        assert resp.status_code == 200, resp.text
    late_b = rig.turn("b")  # decode has nothing of it left to lend
    assert rig.counter("requests_total", mode="fetch") == fetches + 2
    assert rig.counter("fetch_misses_total") == misses + 1
    assert late_b["decode_computed_tokens"] == 0
    assert late_b["prefill_computed_tokens"] > MAX_NEW_COMPUTED, late_b
    rig.check_clean()
