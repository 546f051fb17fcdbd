"""Drain on SIGTERM, on real processes: what is in flight finishes token-exact, nothing
new is admitted, the process exits 0; a second signal exits at once. Behind a push
router with two decode instances, the router stops sending new work to the draining
one within a probe interval and the duplex returns it owes still reach prefill.

Also: ``kvduplex serve --config FILE`` starts with the file's values."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from kvduplex.router import rendezvous
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import kv_stats
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.integration.faults import Outcome
from tests.integration.faults import Victim
from tests.integration.faults import body
from tests.integration.faults import prompt_ids
from tests.integration.faults import reference_tokens

pytestmark = pytest.mark.integration

SERVE = ["serve", "--model", "tiny", "--block-size", "8", "--log-level", "info"]
LONG_ANSWER = 600
"""Tokens of an answer in flight at the signal: long enough to still run after it."""
PROBE_S = 0.5
EXIT_BOUND_S = 60.0


def _signal(proc: Process, sig: signal.Signals = signal.SIGTERM) -> None:
    os.kill(proc.popen.pid, sig)


def _long_victim(url: str, salt: int, **extra: object) -> Victim:
    b = body(prompt_ids(40, salt), LONG_ANSWER, stream=True, **extra)
    return Victim(url, b, client_timeout_s=120).start()


def _sessions_first_on(url: str, other: str, n: int) -> list[str]:
    """`n` session ids that rank instance `url` before `other` (the router's choice)."""
    ids = (f"s{i}" for i in itertools.count())
    first = (sid for sid in ids if rendezvous.rank(sid, [url, other], str)[0] == url)
    return list(itertools.islice(first, n))


def _is_draining(url: str) -> bool:
    resp = httpx.get(url + "/ready", timeout=5)
    return resp.status_code == 503 and resp.json()["status"] == "draining"


def test_serve_config_file_then_a_drain(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: tiny\nnum_blocks: 300\nserved_model_name: from-file\ndrain_timeout_s: 60\n"
    )
    with LocalCluster(log_dir=tmp_path / "logs", env={"OMP_NUM_THREADS": "1"}) as cluster:
        inst = cluster.start("instance", ["serve", "--config", str(config)], free_port())
        cluster.wait_healthy(timeout_s=120)
        url = inst.url
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "from-file"
        assert kv_stats(url)["total"] == 300
        assert httpx.get(url + "/ready").json()["status"] == "ready"
        assert '"served_model_name": "from-file"' in inst.log_tail(100_000)  # effective config

        victim = _long_victim(url, salt=1, model="from-file")
        assert victim.first_token.wait(60), victim.error
        _signal(inst)
        wait_until(lambda: _is_draining(url), 10, "/ready to say draining")
        refused = httpx.post(url + "/v1/completions", json=body([5, 6, 7], 2), timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert httpx.get(url + "/health").status_code == 200  # liveness unchanged
        assert victim.done.wait(120)
        assert victim.finished and len(victim.tokens) == LONG_ANSWER, victim.error
        assert inst.popen.wait(EXIT_BOUND_S) == 0, inst.log_tail()
        assert "drained in" in inst.log_tail()


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    with LocalCluster(log_dir=tmp_path / "logs", env={"OMP_NUM_THREADS": "1"}) as cluster:
        inst = cluster.start("instance", [*SERVE, "--drain-timeout-s", "120"], free_port())
        cluster.wait_healthy(timeout_s=120)
        victim = _long_victim(inst.url, salt=2)
        assert victim.first_token.wait(60), victim.error
        _signal(inst)
        wait_until(lambda: _is_draining(inst.url), 10, "/ready to say draining")
        _signal(inst)
        started = time.monotonic()
        assert inst.popen.wait(EXIT_BOUND_S) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 10
        assert victim.done.wait(30) and not victim.finished


def _count_returns(prefill: str) -> int:
    return int(httpx.get(prefill + "/internal/kv/return/stats", timeout=10).json()["num_accepted"])


def test_draining_decode_behind_a_router(tmp_path: Path) -> None:
    """Answers in flight on the draining decode instance complete token-exact (and their
    turns are returned to prefill); new requests go to the other one; it exits 0."""
    with LocalCluster(log_dir=tmp_path / "logs", env={"OMP_NUM_THREADS": "1"}) as cluster:
        p = cluster.start("prefill", [*SERVE, "--role", "prefill"], free_port())
        d1 = cluster.start("decode-1", [*SERVE, "--role", "decode"], free_port())
        d2 = cluster.start("decode-2", [*SERVE, "--role", "decode"], free_port())
        ref = cluster.start("reference", [*SERVE, "--role", "both"], free_port())
        cluster.wait_healthy(timeout_s=180)
        args = ["router", "--model", "tiny", "--prefill", p.url, "--decode", d1.url, d2.url]
        args += ["--return-mode", "push", "--health-interval-s", str(PROBE_S)]
        router = cluster.start("router", args, free_port())
        cluster.wait_healthy(timeout_s=60)
        wait_until(lambda: httpx.get(router.url + "/ready").status_code == 200, 10, "router ready")

        # Two sessions whose rendezvous choice is decode-1, two decode-2 (the ports, and so
        # the choices of fixed ids, change from run to run).
        num_on_d1 = 2
        sessions = _sessions_first_on(d1.url, d2.url, num_on_d1)
        sessions += _sessions_first_on(d2.url, d1.url, 4 - num_on_d1)
        victims = [
            _long_victim(router.url, salt=10 + i, session_id=sid) for i, sid in enumerate(sessions)
        ]
        for v in victims:
            assert v.first_token.wait(60), v.error
        # The first token is prefill's: decode runs a request once its KV has landed.
        wait_until(lambda: kv_stats(d1.url)["num_running"] >= 1, 60, "a session on decode-1")
        returns_before = _count_returns(p.url)

        _signal(d1)
        assert _is_draining(d1.url)  # its answers still stream, so it is still up
        wait_until(
            lambda: not _router_sees_healthy(router.url, d1.url), 5 * PROBE_S + 5,
            "the router to take the draining instance out of rotation",
        )  # fmt: skip
        rerouted = metric(router.url, "kvduplex_router_rerouted_total")
        for i in range(3):  # new work: served by decode-2, not refused by decode-1 first
            b = body(prompt_ids(24, 100 + i), 8, session_id=f"new{i}")
            resp = httpx.post(router.url + "/v1/completions", json=b, timeout=60)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == reference_tokens(ref.url, b)
        assert metric(router.url, "kvduplex_router_rerouted_total") == rerouted

        for v in victims:
            assert v.done.wait(120)
            assert v.outcome(reference_tokens(ref.url, v.body)) is Outcome.COMPLETED, v.error
        assert d1.popen.wait(EXIT_BOUND_S) == 0, d1.log_tail()
        assert "drained in" in d1.log_tail()
        # The turns that finished on decode-1 while it drained were returned to prefill.
        wait_until(
            lambda: _count_returns(p.url) >= returns_before + num_on_d1, 20,
            "the draining instance's returns to reach prefill",
        )  # fmt: skip
        for url in (p.url, d2.url):
            assert_pool_clean(url)
        _signal(router)  # the router drains too: idle, it exits 0 at once
        assert router.popen.wait(EXIT_BOUND_S) == 0, router.log_tail()


def _router_sees_healthy(router: str, url: str) -> bool:
    instances = httpx.get(router + "/health", timeout=5).json()["instances"]
    return bool(next(i["healthy"] for i in instances if i["url"] == url))
