"""The store tier on a real Mooncake store, between real instances on 127.0.0.1: a master
and a storage node started as ``kvduplex up --kv-store`` starts them, and two colocated
instances (tiny preset, small pools) whose tiers share the store. A prompt one instance
demoted is served by the other from the store, token-exact; a corrupted entry is caught
and recomputed; a store that hangs, then dies, mid-session costs only recomputes, counted.

Skipped where Mooncake is not installed (pip install 'kvduplex[store]', and the system's
libibverbs1). The same tier over an in-process fake store: tests/unit/test_kv_tier_store*.py.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import LocalKVStore
from kvduplex.cluster import free_port
from kvduplex.cluster import start_kv_store
from kvduplex.common.kv_store import mooncake_import_problem
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until

_PROBLEM = mooncake_import_problem()
if _PROBLEM is not None:
    pytest.skip(_PROBLEM, allow_module_level=True)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BS = 4
SERVE = ["serve", "--model", "tiny", "--role", "both", "--block-size", str(BS)]
SERVE += ["--num-blocks", "20", "--kv-tier-blocks", "256", "--log-level", "warning"]
SERVE += ["--kv-store-timeout-s", "0.5", "--kv-store-retry-s", "0.5"]
MAX_TOKENS = 12
PREFIX = "kvduplex_kv_tier_"


def prompt(salt: int, n: int = 40) -> list[int]:
    """`n` token ids, distinct per salt (no prefix shared with another salt)."""
    return [(salt * 7919 + i * 31 + (i * i) % 97) % 250 + 1 for i in range(n)]


def complete(url: str, ids: list[int]) -> tuple[list[int], int]:
    """Greedy answer's token ids, and the prompt tokens served from a prefix cache."""
    body = {
        "model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def count(url: str, name: str) -> float:
    return metric(url, PREFIX + name)


@dataclass
class Rig:
    store: LocalKVStore
    first: str
    second: str
    cluster: LocalCluster

    def demote(self, ids: list[int], salt: int) -> list[int]:
        """Serve `ids` on the first instance, then two long prompts that push every one of
        its blocks out of the pool into the store; wait for their puts to land. Its
        answer."""
        answer, _ = complete(self.first, ids)
        for n in (1, 2):
            complete(self.first, prompt(salt * 10 + n, 56))
        wait_until(
            lambda: (
                count(self.first, "written_bytes_total") > 0
                and count(self.first, "stored_blocks_total") * self.entry_bytes()
                == count(self.first, "written_bytes_total")
            ),
            what="the demoted blocks' puts",
        )
        return answer

    def entry_bytes(self) -> float:
        stored = count(self.first, "stored_blocks_total")
        return count(self.first, "written_bytes_total") / stored if stored else 0.0

    def store_keys(self) -> list[str]:
        text = httpx.get(self.store.master.url + "/get_all_keys", timeout=10).text
        return [line for line in text.splitlines() if line.startswith("kvduplex/")]


def start_rig(cluster: LocalCluster, name: str) -> Rig:
    """A store and two instances on it, each joined (its store_up gauge is 1)."""
    store = start_kv_store(cluster, 0.25)
    procs = [
        cluster.start(f"{name}-{i}", [*SERVE, *store.serve_flags()], free_port()) for i in (1, 2)
    ]
    cluster.wait_healthy(timeout_s=180, procs=procs)
    for proc in procs:
        wait_until(lambda url=proc.url: metric(url, PREFIX + "store_up") == 1.0, what="join")
    return Rig(store, procs[0].url, procs[1].url, cluster)


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> Rig:
    return start_rig(cluster, "shared")


def test_a_prompt_one_instance_demoted_the_other_serves_from_the_store(rig: Rig) -> None:
    ids = prompt(1)
    answer = rig.demote(ids, salt=1)
    assert len(rig.store_keys()) >= len(ids) // BS
    hits_before = count(rig.second, "hit_blocks_total")
    again, num_cached = complete(rig.second, ids)
    assert again == answer
    assert num_cached == (len(ids) - 1) // BS * BS  # all but the block of the last token
    assert count(rig.second, "hit_blocks_total") - hits_before == num_cached // BS
    assert count(rig.second, "corrupt_blocks_total") == 0
    assert count(rig.second, "unavailable_total") == 0


@pytest.fixture
def raw_client(rig: Rig) -> Iterator[Any]:
    """A Mooncake client of the rig's store in this process (to damage entries)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    code = client.setup(
        "127.0.0.1", rig.store.metadata_url, 0, 64 * 2**20, "tcp", "", rig.store.master_address
    )
    assert code == 0
    yield client
    client.close()


def test_a_corrupted_entry_is_caught_and_recomputed(rig: Rig, raw_client: Any) -> None:
    ids = prompt(2)
    answer = rig.demote(ids, salt=2)
    for key in rig.store_keys():  # flip one payload byte of every entry
        value = bytearray(raw_client.get(key))
        value[-1] ^= 0x01
        assert raw_client.upsert(key, value) == 0
    corrupt_before = count(rig.second, "corrupt_blocks_total")
    hits_before = count(rig.second, "hit_blocks_total")
    again, num_cached = complete(rig.second, ids)
    assert again == answer and num_cached == 0
    assert count(rig.second, "corrupt_blocks_total") == corrupt_before + 1
    assert count(rig.second, "hit_blocks_total") == hits_before


def test_a_store_that_hangs_then_dies_costs_only_recomputes(cluster: LocalCluster) -> None:
    rig = start_rig(cluster, "failing")
    hung_ids, dead_ids = prompt(3), prompt(4)
    hung_answer = rig.demote(hung_ids, salt=3)
    dead_answer, _ = complete(rig.first, dead_ids)
    # The storage node stops answering: the second instance's load outlives its deadline.
    rig.store.storage.popen.send_signal(signal.SIGSTOP)
    again, num_cached = complete(rig.second, hung_ids)
    assert again == hung_answer and num_cached == 0
    assert count(rig.second, "unavailable_total") >= 1
    # Its next lookup finds that load still running past the deadline: the store is down.
    assert complete(rig.second, dead_ids)[0] == dead_answer
    assert count(rig.second, "store_up") == 0
    # Then the store dies: both instances go on answering, demotions and lookups counted.
    cluster.kill_process(rig.store.storage)
    cluster.kill_process(rig.store.master)
    unavailable_before = count(rig.first, "unavailable_total")
    for n in (5, 6):  # evicts on the first instance: its demotions find no store
        complete(rig.first, prompt(n, 56))
    assert count(rig.first, "unavailable_total") > unavailable_before
    assert complete(rig.second, dead_ids)[0] == dead_answer
    assert complete(rig.second, hung_ids)[0] == hung_answer
    for url in (rig.first, rig.second):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
