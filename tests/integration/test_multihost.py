"""Hosts in network namespaces on one bridge, found by DNS: a session alternating two routers.

Two prefill and two decode instances and two routers each run on a host of their
own (`benchmarks.multihost.Fleet`: a namespace per process on a bridge); the
routers resolve the instances' DNS names at a DNS server on the bridge's address;
prefill and decode move KV with UCX over TCP on their host's interface. A
colocated reference runs in ours. The turns of a session alternate the routers:
each answer is token-exact, and from the second turn on prefill's cache holds the
previous answer that decode returned to it, whichever router sent that turn.
Afterwards no block is in use anywhere. Skipped where namespaces cannot be
created (not root, no `ip`, a container that forbids it).
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks.multihost import Fleet
from benchmarks.multihost import FleetConfig
from benchmarks.multihost import Host
from benchmarks.multihost import HostRole
from kvduplex.bench.netns import netns_unavailable_reason
from kvduplex.router import rendezvous
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import complete_turn
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

BS = 8


@dataclass
class Hosts:
    fleet: Fleet
    prefill: list[Host]
    decode: list[Host]
    routers: list[str]
    reference: str


def _sees(router: str, urls: set[str]) -> bool:
    instances = httpx.get(router + "/health", timeout=5).json()["instances"]
    return {i["url"] for i in instances if i["healthy"]} == urls


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    config = FleetConfig(num_blocks=256, block_size=BS, dns_interval_s=0.5, log_level="warning")
    with Fleet(config, Path(tmp_path_factory.mktemp("multihost-logs"))) as fleet:
        ps = [fleet.start_instance(HostRole.PREFILL, f"prefill-{i}") for i in range(2)]
        ds = [fleet.start_instance(HostRole.DECODE, f"decode-{i}") for i in range(2)]
        reference = fleet.start_reference()
        fleet.wait_healthy([h.proc for h in (*ps, *ds)] + [reference], timeout_s=180)
        for h in (*ps, *ds):
            fleet.publish(h)
        routers = [fleet.start_router(f"router-{i}") for i in range(2)]
        fleet.wait_healthy([r.proc for r in routers], timeout_s=60)
        urls = {h.url for h in (*ps, *ds)}
        for r in routers:
            wait_until(lambda r=r: _sees(r.url, urls), 30, f"{r.label} to find every instance")
        yield Hosts(fleet, ps, ds, [r.url for r in routers], reference.url)


def _returns(url: str) -> dict[str, int]:
    return dict(httpx.get(url + "/internal/kv/return/stats", timeout=10).json())


def _returns_settled(decode: Host, num_offered: int) -> bool:
    """`decode` offered `num_offered` returns in all, and each has ended."""
    s = _returns(decode.url)
    ended = s["num_done"] + s["num_failed"] + s["num_declined"]
    return s["num_offered"] >= num_offered and ended == s["num_offered"]


def _rx_bytes(host: Host) -> int:
    """Bytes received on `host`'s interface (inside its namespace)."""
    assert host.end.netns is not None
    out = subprocess.run(
        ["ip", "-n", host.end.netns, "-j", "-s", "link", "show", "dev", host.end.dev],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def _received_blocks(decode: Host) -> int:
    stats = httpx.get(decode.url + "/internal/kv/push/stats", timeout=10).json()
    return int(stats["num_received_blocks"])


def _block_bytes(instance: str) -> int:
    """Bytes of one block over all layers, K and V, from the instance's handshake."""
    layout = httpx.get(instance + "/internal/kv/handshake", timeout=10).json()["layout"]
    per_token = 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_dim"]
    return per_token * layout["block_size"] * {"float32": 4}[layout["dtype"].removeprefix("torch.")]


def test_a_session_alternating_routers_keeps_its_duplex_hit_across_hosts(hosts: Hosts) -> None:
    session = "multihost-ana"
    (p,) = [h for h in hosts.prefill if h.url == rendezvous.rank(
        session, [h.url for h in hosts.prefill], str)[0]]  # fmt: skip
    (d,) = [h for h in hosts.decode if h.url == rendezvous.rank(
        session, [h.url for h in hosts.decode], str)[0]]  # fmt: skip
    accepted = {h.label: _returns(h.url)["num_accepted"] for h in hosts.prefill}
    num_offered = _returns(d.url)["num_offered"]
    rx_before, blocks_before = _rx_bytes(d), _received_blocks(d)
    rng = random.Random(3)
    history = [rng.randrange(1, 250) for _ in range(45)]
    returned = 0
    for turn in range(4):
        got, cached = complete_turn(hosts.routers[turn % 2], history, session)
        want, _ = complete_turn(hosts.reference, history, f"ref-{session}")
        assert got == want, turn
        # The previous prompt and its answer but the last token, up to a full block: the
        # answer reached prefill by the duplex return, after the other router's turn.
        assert cached >= returned, (turn, cached, returned)
        num_offered += 1
        wait_until(lambda n=num_offered: _returns_settled(d, n), 30, "the return to end")
        returned = (len(history) + len(got) - 1) // BS * BS
        history = [*history, *got, *(rng.randrange(1, 250) for _ in range(10))]
    # Both routers sent every turn to the session's rendezvous choice: its returns all
    # went to that prefill instance.
    now = {h.label: _returns(h.url)["num_accepted"] for h in hosts.prefill}
    assert {label: now[label] - accepted[label] for label in now} == {
        h.label: 4 if h is p else 0 for h in hosts.prefill
    }
    # The KV came to decode over its host's link (UCX over TCP), not through shared memory.
    num_blocks = _received_blocks(d) - blocks_before
    assert num_blocks > 0
    assert _rx_bytes(d) - rx_before >= num_blocks * _block_bytes(d.url)
    for url in [*(h.url for h in (*hosts.prefill, *hosts.decode)), hosts.reference]:
        assert_pool_clean(url)
