"""A prefill instance whose engine loop is wedged, on real processes.

P's engine loop is stalled by a fault (`tests.support.faults.StallWhileFileExists`,
the loop gate of an instance started by the test launcher: while the file exists, the
loop stops at the start of its next iteration, as in a step that never ends), with ``--engine-stall-timeout-s 1``. P's process, HTTP server
and notification pump stay up, so only health that means progress tells the wedge:
P's /health answers 503 and its KV heartbeats stop, so D's wait for a push in flight
ends (2 s here) and D computes the prompt itself, and the router sends new requests
around P. Once the file is removed, P is healthy again and pushes resume.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from tests.integration.conftest import metric
from tests.integration.faults import DEADLINE_S
from tests.integration.faults import P_FLAGS
from tests.integration.faults import REQUEST_BOUND_S
from tests.integration.faults import Outcome
from tests.integration.faults import Rig
from tests.integration.faults import Victim
from tests.integration.faults import blocks_left
from tests.integration.faults import body
from tests.integration.faults import poll
from tests.integration.faults import prompt_ids
from tests.integration.faults import reference_tokens
from tests.integration.faults import start_rig
from tests.integration.faults import stats
from tests.integration.faults import wait_router_sees
from tests.integration.faults import write_bytes
from tests.skips import skip_module_without_nixl
from tests.support.faults import Faults

pytestmark = pytest.mark.integration

skip_module_without_nixl()

STALL_LIMIT_S = 1.0
PUSH_STATS = "/internal/kv/push/stats"


@pytest.fixture(scope="module")
def stall_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("stall")) / "stall-engine"


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster, reference: str, stall_file: Path) -> Iterator[Rig]:
    r = start_rig(
        cluster, reference, "stall",
        p_faults=Faults(stall_file=stall_file),
        p_flags=[*P_FLAGS, "--engine-stall-timeout-s", str(STALL_LIMIT_S)],
    )  # fmt: skip
    yield r
    stall_file.unlink(missing_ok=True)
    r.stop()


@pytest.fixture
def wedge(rig: Rig, stall_file: Path) -> Iterator[Path]:
    """P as the router sees it, healthy, before the test; removed after it, whatever
    happened (P must not stay wedged). Without the wait, a test could start while the
    router still remembers the last test's wedge: its wait for "unhealthy" would pass at
    once, and the router's next probe could find P healthy before the new wedge bites."""
    wait_router_sees(rig.url, rig.p.url, "prefill", healthy=True)
    yield stall_file
    stall_file.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def salts() -> Iterator[int]:
    return itertools.count(7000)


def p_health(rig: Rig) -> int:
    return httpx.get(rig.p.url + "/health", timeout=5).status_code


def test_a_wedged_prefill_stops_heartbeating_and_decode_computes_the_prompt(
    rig: Rig, wedge: Path, salts: Iterator[int]
) -> None:
    salt = next(salts)
    prompt, xid = prompt_ids(1600, salt), f"stall-{salt}"
    d_before = stats(rig.d.url, PUSH_STATS)
    bytes_before = write_bytes(rig.p.url)
    p_req = {"xid": xid, "prompt_token_ids": prompt, "decode_url": rig.d.url}
    params = {"mode": "push", "xid": xid, "prefill_url": rig.p.url}
    with ThreadPoolExecutor(1) as pool:
        # P and D directly (no router, which would also give up on a P it sees unhealthy):
        # only P's heartbeats stopping can end D's wait while P is wedged.
        p_answer = pool.submit(
            httpx.post, rig.p.url + "/internal/push/prefill", json=p_req, timeout=60
        )
        v = Victim(rig.d.url, body(prompt, 6, kv_transfer_params=params)).start()
        poll(lambda: write_bytes(rig.p.url) > bytes_before, "P to start pushing the prompt's KV")
        wedge.touch()
        poll(lambda: p_health(rig) == 503, "P's /health to say 503", timeout_s=3 * STALL_LIMIT_S)
        assert "no progress" in httpx.get(rig.p.url + "/health", timeout=5).json()["reason"]
        alive_sent = stats(rig.p.url, PUSH_STATS)["num_alive_sent"]
        # The wedge outlasts D's wait: D answers while P is still wedged.
        assert v.done.wait(STALL_LIMIT_S + 3 * DEADLINE_S + 10), "D still waits for a wedged P"
        assert not p_answer.done(), "P finished its prefill before the wedge: test invalid"
        assert p_health(rig) == 503
        assert v.outcome(reference_tokens(rig.reference, v.body)) is Outcome.COMPLETED, v.error
        d_after = stats(rig.d.url, PUSH_STATS)
        assert d_after["num_fallbacks"] == d_before["num_fallbacks"] + 1, (d_before, d_after)
        assert d_after["num_received"] == d_before["num_received"], (d_before, d_after)
        assert stats(rig.p.url, PUSH_STATS)["num_alive_sent"] == alive_sent, "P heartbeat"
        wedge.unlink()
        poll(lambda: p_health(rig) == 200, "P's /health to say 200 again", timeout_s=5)
        p_answer.result(REQUEST_BOUND_S)  # P's call ends too (its push was cancelled)
    assert blocks_left(rig.p.url) == 0 and blocks_left(rig.d.url) == 0


def test_the_router_routes_around_a_wedged_prefill_then_takes_it_back(
    rig: Rig, wedge: Path, salts: Iterator[int]
) -> None:
    wedge.touch()  # the idle loop stalls within one idle wait, then /health says 503
    wait_router_sees(rig.url, rig.p.url, "prefill", healthy=False)
    d_before = stats(rig.d.url, PUSH_STATS)
    bytes_before = write_bytes(rig.p.url)
    decode_only = metric(rig.url, "kvduplex_router_requests_total", mode="decode")
    v = Victim(rig.url, body(prompt_ids(200, next(salts)), 6)).start()
    assert v.done.wait(REQUEST_BOUND_S)
    assert v.outcome(reference_tokens(rig.reference, v.body)) is Outcome.COMPLETED, v.error
    # The router sent it to D alone (no push for D to wait on): it never waited for P.
    assert metric(rig.url, "kvduplex_router_requests_total", mode="decode") == decode_only + 1
    assert stats(rig.d.url, PUSH_STATS)["num_fallbacks"] == d_before["num_fallbacks"]
    assert write_bytes(rig.p.url) == bytes_before  # D computed it; P was never asked
    assert stats(rig.d.url, PUSH_STATS)["num_received"] == d_before["num_received"]

    wedge.unlink()
    wait_router_sees(rig.url, rig.p.url, "prefill", healthy=True)
    v = Victim(rig.url, body(prompt_ids(200, next(salts)), 6)).start()
    assert v.done.wait(REQUEST_BOUND_S)
    assert v.outcome(reference_tokens(rig.reference, v.body)) is Outcome.COMPLETED, v.error
    after = stats(rig.d.url, PUSH_STATS)
    assert after["num_received"] == d_before["num_received"] + 1, (d_before, after)
    assert blocks_left(rig.p.url) == 0 and blocks_left(rig.d.url) == 0
