"""Disaggregated serving across a network link: P in its own network namespace.

P runs in a namespace joined to ours by a veth pair (`NetnsHost`); D, the
router, a colocated reference and this test stay in the root namespace. P and
D use UCX over TCP on the veth only, so the KV blocks cross the link instead of
shared memory. Skipped where namespaces cannot be created (not root, no `ip`,
a container that forbids it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvduplex.bench.netns import NetnsHost
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import p_across_link
from tests.skips import skip_module_without_nixl

pytestmark = pytest.mark.integration

skip_module_without_nixl()

_SERVE = ["serve", "--model", "tiny", "--num-blocks", "128", "--block-size", "8"]
_SERVE += ["--log-level", "warning"]

# D's stats route and counter of KV blocks that reached it from P, per router mode.
_RECEIVED_BLOCKS = {
    "pull": ("/internal/kv/pull/stats", "num_pulled_blocks"),
    "push": ("/internal/kv/push/stats", "num_received_blocks"),
}
MODES = list(_RECEIVED_BLOCKS)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class TwoHosts:
    link: NetnsHost
    cluster: LocalCluster
    prefill: str
    decode: str
    reference: str


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    log_dir = Path(tmp_path_factory.mktemp("netns-logs"))
    with p_across_link(
        log_dir, _SERVE, ["--role", "prefill"], ["--role", "decode"], ["--role", "both"]
    ) as on:
        yield TwoHosts(on.link, on.cluster, on.p.url, on.d.url, on.reference.url)


@pytest.fixture(scope="module", params=MODES)
def router(request: pytest.FixtureRequest, two_hosts: TwoHosts) -> Iterator[tuple[str, str]]:
    """(mode, URL) of a router over P and D in that mode."""
    mode: str = request.param
    args = ["router", "--mode", mode, "--model", "tiny", "--return-mode", "none"]
    args += ["--prefill", two_hosts.prefill, "--decode", two_hosts.decode]
    r = two_hosts.cluster.start(f"router-{mode}", args, free_port())
    two_hosts.cluster.wait_healthy(timeout_s=60)
    yield mode, r.url
    two_hosts.cluster.stop_process(r)


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    ids = list(resp.json()["choices"][0]["token_ids"])
    assert len(ids) == body["max_tokens"], ids
    return ids


def _received_blocks(decode: str, mode: str) -> int:
    path, counter = _RECEIVED_BLOCKS[mode]
    return int(httpx.get(decode + path, timeout=10).json()[counter])


def _block_bytes(instance: str) -> int:
    """Bytes of one block over all layers, K and V, from the instance's handshake."""
    layout = httpx.get(instance + "/internal/kv/handshake", timeout=10).json()["layout"]
    per_token = 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_dim"]
    return per_token * layout["block_size"] * _DTYPE_BYTES[layout["dtype"].removeprefix("torch.")]


def _rx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/rx_bytes").read_text())


def _prompt(num_tokens: int, seed: int) -> list[int]:
    return [(seed + 37 * i) % 500 + 5 for i in range(num_tokens)]


# Mixed lengths: 20 and 77 are not multiples of the block size (8).
PROMPT_LENGTHS = [20, 40, 77]


def test_kv_crosses_the_link_and_outputs_match_colocated(
    two_hosts: TwoHosts, router: tuple[str, str]
) -> None:
    mode, router_url = router
    seed = MODES.index(mode) * 1000  # each mode's prompts miss the other's prefix cache
    prompts = [_prompt(n, seed + n) for n in PROMPT_LENGTHS]
    blocks_before = _received_blocks(two_hosts.decode, mode)
    rx_before = _rx_bytes(two_hosts.link.outer.dev)

    routed = [_complete(router_url, p) for p in prompts]

    num_blocks = _received_blocks(two_hosts.decode, mode) - blocks_before
    num_rx_bytes = _rx_bytes(two_hosts.link.outer.dev) - rx_before
    assert routed == [_complete(two_hosts.reference, p) for p in prompts]
    assert num_blocks > 0
    # The KV bytes came in over the veth, not through shared memory.
    assert num_rx_bytes >= num_blocks * _block_bytes(two_hosts.prefill)
    for url in (two_hosts.prefill, two_hosts.decode, two_hosts.reference):
        assert_pool_clean(url)
