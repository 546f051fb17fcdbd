"""The router's front door and its view of instance health, on real processes.

One prefill (P) and two decode instances (D0, D1) behind a push router, every
one of them started with an API key (KVDUPLEX_API_KEY), plus a colocated
reference without one for the right tokens. The router probes every
`HEALTH_INTERVAL_S`. Tests: the key on router and instances; D killed
mid-stream (the client's stream ends with an OpenAI error event, in bounded
time); D killed between requests (the next requests are answered exactly by
D1, the router's gauge says D0 is unhealthy, then takes D0 back once it is
restarted on its port, and new sessions reach it again); P killed (D computes
the prompts, then pushes resume once P is back); D stopped mid-stream, its
connections open (the router marks it unhealthy after its probes fail and
ends the stream with the error event within the marking deadline).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.integration.conftest import kv_stats
from tests.integration.faults import D_FLAGS
from tests.integration.faults import HEALTH_INTERVAL_S
from tests.integration.faults import REQUEST_BOUND_S
from tests.integration.faults import SERVE
from tests.integration.faults import Outcome
from tests.integration.faults import Victim
from tests.integration.faults import blocks_left
from tests.integration.faults import body
from tests.integration.faults import metric
from tests.integration.faults import poll
from tests.integration.faults import prompt_ids
from tests.integration.faults import reference_tokens
from tests.integration.faults import wait_router_sees
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

KEY = "sk-kvduplex-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEY_ENV = {"KVDUPLEX_API_KEY": KEY}
P_ARGS = [*SERVE, "--role", "prefill", "--num-blocks", "640"]
D_ARGS = [*SERVE, *D_FLAGS]
FINISHED = "kvduplex_requests_finished_total"
HEALTH_TIMEOUT_S = 2.0
"""The router's --health-timeout-s (its default)."""
STOP_BOUND_S = 2 * max(HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S) + HEALTH_TIMEOUT_S + 6.0
"""A stopped D's stream ends within the marking deadline (two failed probes, the default
--health-failures; a probe round lasts up to the timeout), plus slack for a loaded
machine."""


@dataclass
class Trio:
    cluster: LocalCluster
    reference: str
    router: str
    procs: dict[str, Process]
    """P, D0, D1."""

    def restart(self, name: str) -> None:
        """Start the killed `name` again on its port; wait until the router takes it back."""
        old = self.procs[name]
        self.cluster.stop_process(old)
        port = int(old.url.rsplit(":", 1)[1])
        args = P_ARGS if name == "P" else D_ARGS
        self.procs[name] = self.cluster.start(old.name, args, port, env=KEY_ENV)
        self.cluster.wait_healthy(timeout_s=120)
        wait_router_sees(self.router, old.url, _role(name), healthy=True)

    def ask(self, n: int, salt: int, **extra: object) -> Victim:
        """A request through the router, answered (or failed) within the bound."""
        v = Victim(self.router, body(prompt_ids(n, salt), 6, **extra), headers=AUTH).start()
        assert v.done.wait(REQUEST_BOUND_S), "no answer within the bound"
        return v

    def exact(self, v: Victim) -> bool:
        return v.outcome(reference_tokens(self.reference, v.body)) is Outcome.COMPLETED


def _role(name: str) -> str:
    return "prefill" if name == "P" else "decode"


@pytest.fixture(scope="module")
def trio(cluster: LocalCluster) -> Iterator[Trio]:
    ref = cluster.start("reference", [*SERVE, "--role", "both", *D_FLAGS[2:]], free_port())
    procs = {"P": cluster.start("prefill-h", P_ARGS, free_port(), env=KEY_ENV)}
    for name in ("D0", "D1"):
        procs[name] = cluster.start(f"decode-h{name[1]}", D_ARGS, free_port(), env=KEY_ENV)
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--mode", "push", "--model", "tiny", "--prefill", procs["P"].url,
            "--decode", procs["D0"].url, procs["D1"].url,
            "--health-interval-s", str(HEALTH_INTERVAL_S), "--return-mode", "none"]  # fmt: skip
    router = cluster.start("router-h", args, free_port(), env=KEY_ENV)
    cluster.wait_healthy(timeout_s=60)
    yield Trio(cluster, ref.url, router.url, procs)
    for proc in (router, *procs.values()):
        cluster.stop_process(proc)


@pytest.fixture(scope="module")
def salts() -> Iterator[int]:
    return itertools.count(5000)


def test_the_api_key_guards_v1_on_router_and_instances(trio: Trio, salts: Iterator[int]) -> None:
    b = body(prompt_ids(20, next(salts)), 4)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(trio.router + "/v1/completions", json=b, headers=headers, timeout=60)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    d0 = trio.procs["D0"].url
    assert httpx.get(d0 + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(d0 + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    for url in (trio.router, d0):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    r = httpx.post(trio.router + "/v1/completions", json=b, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference_tokens(trio.reference, b)


def test_decode_killed_mid_stream_ends_the_stream_with_an_error(
    trio: Trio, salts: Iterator[int]
) -> None:
    v = Victim(
        trio.router, body(prompt_ids(24, next(salts)), 1200, stream=True), headers=AUTH
    ).start()
    poll(lambda: len(v.tokens) >= 3, "a stream decoding")
    (name,) = [n for n in ("D0", "D1") if kv_stats(trio.procs[n].url)["num_running"] == 1]
    trio.cluster.kill_process(trio.procs[name])
    assert v.done.wait(REQUEST_BOUND_S), "the stream did not end"
    assert v.outcome([]) is Outcome.ERROR and v.api_error, v.error
    assert "failed mid-answer" in (v.error or "")
    want = reference_tokens(trio.reference, v.body)
    assert v.tokens == want[: len(v.tokens)], "each token once, in order"
    assert metric(trio.router, "kvduplex_router_stream_errors_total") == 1
    wait_router_sees(trio.router, trio.procs[name].url, "decode", healthy=False)
    trio.restart(name)


def test_decode_killed_is_routed_around_then_taken_back(
    trio: Trio, salts: Iterator[int]
) -> None:
    d0 = trio.procs["D0"].url
    trio.cluster.kill_process(trio.procs["D0"])
    for _ in range(4):  # new sessions: D0 is the least loaded until the router learns
        v = trio.ask(30, next(salts))
        assert trio.exact(v), v.error
    wait_router_sees(trio.router, d0, "decode", healthy=False)
    assert blocks_left(trio.procs["D1"].url) == 0
    trio.restart("D0")
    before = metric(d0, FINISHED)
    for _ in range(4):
        v = trio.ask(30, next(salts))
        assert trio.exact(v), v.error
    assert metric(d0, FINISHED) > before, "new sessions reach the restarted instance"


def test_prefill_killed_decode_computes_then_pushes_resume(
    trio: Trio, salts: Iterator[int]
) -> None:
    p = trio.procs["P"].url
    trio.cluster.kill_process(trio.procs["P"])
    for _ in range(2):
        v = trio.ask(30, next(salts))
        assert trio.exact(v), v.error
    wait_router_sees(trio.router, p, "prefill", healthy=False)
    trio.restart("P")
    before = metric(p, FINISHED)
    v = trio.ask(30, next(salts))
    assert trio.exact(v), v.error
    assert metric(p, FINISHED) == before + 1, "the router sends prefills to P again"
    for proc in trio.procs.values():
        assert blocks_left(proc.url) == 0


def test_decode_stopped_mid_stream_ends_the_stream_once_marked_unhealthy(
    trio: Trio, salts: Iterator[int]
) -> None:
    """SIGSTOP keeps D's connections open and silent: without the router's abandonment
    the stream would wait for the client's read deadline."""
    v = Victim(
        trio.router, body(prompt_ids(24, next(salts)), 1200, stream=True), headers=AUTH
    ).start()
    poll(lambda: len(v.tokens) >= 3, "a stream decoding")
    (name,) = [n for n in ("D0", "D1") if kv_stats(trio.procs[n].url)["num_running"] == 1]
    proc = trio.procs[name]
    errors = metric(trio.router, "kvduplex_router_stream_errors_total")
    os.killpg(proc.popen.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        assert v.done.wait(STOP_BOUND_S), "the stream did not end"
        print(f"stopped decode: the stream ended {time.monotonic() - stopped_at:.1f} s after")
        assert v.outcome([]) is Outcome.ERROR and v.api_error, v.error
        assert "marked unhealthy" in (v.error or "")
        want = reference_tokens(trio.reference, v.body)
        assert v.tokens == want[: len(v.tokens)], "each token once, in order"
        assert metric(trio.router, "kvduplex_router_stream_errors_total") == errors + 1
    finally:
        os.killpg(proc.popen.pid, signal.SIGCONT)
    wait_router_sees(trio.router, proc.url, "decode", healthy=True)
    poll(lambda: blocks_left(proc.url) == 0, "the resumed decode to free the request")
    v = trio.ask(30, next(salts))
    assert trio.exact(v), v.error
