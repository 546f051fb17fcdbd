"""A short soak: a minute of concurrent multi-turn streaming sessions through a push router
with duplex return (one P, one D), then every pool clean and no process's memory growing.

The long run is ``benchmarks/bench_soak.py`` (same sessions, same checks, minutes).
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.soak import ProcessSampler
from benchmarks.soak import SoakConfig
from benchmarks.soak import format_summary
from benchmarks.soak import run_sessions
from benchmarks.soak import summarize
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import kv_stats
from tests.integration.conftest import start_duplex_rig
from tests.skips import skip_module_without_nixl

pytestmark = [pytest.mark.integration, pytest.mark.slow]

skip_module_without_nixl()

SERVE = ["serve", "--model", "tiny", "--log-level", "warning", "--kv-cache-mb", "64"]
DURATION_S = 60.0
WARMUP_S = 20.0
CONFIG = SoakConfig(num_sessions=12, num_turns=6, seed=7)
MAX_RSS_GROWTH_PCT = 10.0
"""Generous (about 0.5% on the CI machine); slow growth shows in the 10-minute benchmark."""
MIN_REQUESTS = 100
MAX_CLOSE_WAIT = CONFIG.num_sessions
"""Under load a pooled connection that its peer closed is dropped at the pool's next
request; a leaked one stays (the router once leaked one D connection in 30 requests)."""


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> dict[str, Process]:
    return start_duplex_rig(cluster, SERVE)


def test_soak(rig: dict[str, Process], request: pytest.FixtureRequest) -> None:
    sampler = ProcessSampler({name: proc.popen.pid for name, proc in rig.items()}, every_s=2.0)
    sampler.start()
    try:
        turns = asyncio.run(run_sessions(rig["router"].url, "tiny", CONFIG, DURATION_S))
    finally:
        sampler.stop()
    summary = summarize(turns, sampler, WARMUP_S, DURATION_S)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(format_summary(summary))

    assert summary.num_errors == 0, summary.errors
    assert summary.num_requests >= MIN_REQUESTS, summary
    for name, proc in rig.items():
        assert proc.is_alive(), f"{name} died:\n{proc.log_tail()}"
    for name in ("prefill", "decode"):
        assert_pool_clean(rig[name].url)
        st = kv_stats(rig[name].url)
        assert st["num_running"] == 0 and st["num_waiting"] == 0, st
    for name, m in summary.memory.items():
        assert m["growth_pct"] <= MAX_RSS_GROWTH_PCT, (name, m)
    for name, n in summary.close_wait_max.items():
        assert n <= MAX_CLOSE_WAIT, f"{name} held {n} connections in CLOSE-WAIT"
