"""The store tier over an in-process fake store (`tests.support.fake_store`): a block one
instance stored, another loads bit for bit; entries are per model and checked like
slots; and a store that is down, hangs, or is slow costs at most a deadline: the tier
answers miss, counts it, warns once, leaves the store alone and tries it again later.
The same tier against a real Mooncake store: tests/integration/test_kv_store.py."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine import kv_store_client
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.kv_tier import HEADER_BYTES
from kvduplex.engine.kv_tier_store import STAGING_BUFFERS
from kvduplex.engine.kv_tier_store import StoreTier
from kvduplex.engine.tier_link import build_tier
from tests.support.fake_store import FakeStore
from tests.support.fake_store import StoreCalls

LAYOUT = KVCacheLayout(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
IDENTITY = b"test-model\x1ffloat32"
TIMEOUT_S = 0.2
RETRY_S = 1.0


def key(n: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(n.to_bytes(8, "little"), digest_size=32).digest())


def block(seed: int) -> torch.Tensor:
    """One block of LAYOUT, distinct per seed."""
    shape = LAYOUT.shape[:2] + LAYOUT.shape[3:]
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class Clock:
    """The tiers' clock: retry times pass when a test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store() -> Iterator[FakeStore]:
    made = FakeStore()
    yield made
    made.gate.set()  # a test that hung the store never leaves a thread blocked


@pytest.fixture
def clock() -> Clock:
    return Clock()


MakeTier = Callable[..., StoreTier]


@pytest.fixture
def calls() -> StoreCalls:
    return StoreCalls()


@pytest.fixture
def make_tier(store: FakeStore, clock: Clock, calls: StoreCalls) -> Iterator[MakeTier]:
    """Tiers over `store`, joined when made (unless the store is down); closed after."""
    made: list[StoreTier] = []

    def make(identity: bytes = IDENTITY, layout: KVCacheLayout = LAYOUT) -> StoreTier:
        tier = StoreTier(
            layout, identity, 8, store.connect, timeout_s=TIMEOUT_S, retry_s=RETRY_S, clock=clock,
            make_worker=calls.make_worker,
        )  # fmt: skip
        made.append(tier)
        tier.joined(5.0)
        return tier

    yield make
    store.gate.set()
    for tier in made:
        tier.close()


def test_a_block_one_tier_stored_another_loads_bit_exact(
    make_tier: MakeTier, store: FakeStore
) -> None:
    a, b = make_tier(), make_tier()
    kv = block(1)
    a.store(key(1), kv)
    a.flush()
    assert list(store.entries) == [f"kvduplex/{a.layout_id.hex()}/{key(1).hex()}"]
    assert b.find_run([key(1), key(2)]) == 1
    out = torch.zeros_like(kv)
    assert b.load(key(1), out) and torch.equal(out, kv)
    assert not b.load(key(2), out)
    entry_bytes = HEADER_BYTES + LAYOUT.bytes_per_block
    assert (a.stats.num_stored_blocks, a.stats.num_written_bytes, a.num_used) == (1, entry_bytes, 1)
    assert (b.stats.num_loaded_blocks, b.stats.num_read_bytes) == (1, entry_bytes)
    assert a.stats.num_unavailable == b.stats.num_unavailable == 0


def test_a_lookup_is_one_call_and_stops_at_the_first_block_missing(
    make_tier: MakeTier, store: FakeStore
) -> None:
    a = make_tier()
    for n in (1, 2, 4):
        a.store(key(n), block(n))
    a.flush()
    store.calls.clear()
    assert a.find_run([key(1), key(2), key(3), key(4)]) == 2
    assert store.calls == ["batch_is_exist"]


def test_another_model_never_shares_an_entry(make_tier: MakeTier, store: FakeStore) -> None:
    a = make_tier()
    other_model, other_layout = (
        make_tier(b"other-model"),
        make_tier(layout=replace(LAYOUT, num_kv_heads=1)),
    )
    a.store(key(1), block(1))
    a.flush()
    out = torch.zeros_like(block(1))
    for other in (other_model, other_layout):
        assert other.find_run([key(1)]) == 0 and not other.load(key(1), out)
    # An entry put under this model's name by another model is caught by its header.
    store.entries[other_model.store_key(key(1))] = store.entries[a.store_key(key(1))]
    assert not other_model.load(key(1), out)
    assert other_model.stats.num_corrupt_blocks == 1


@pytest.mark.parametrize("offset", [10, 50, HEADER_BYTES + 5], ids=["key", "layout-id", "payload"])
def test_a_corrupt_entry_is_caught_removed_and_replaced(
    make_tier: MakeTier, store: FakeStore, offset: int
) -> None:
    a, b = make_tier(), make_tier()
    kv = block(1)
    a.store(key(1), kv)
    a.flush()
    store.corrupt(a.store_key(key(1)), offset)
    out = torch.zeros_like(kv)
    assert not b.load(key(1), out) and torch.equal(out, torch.zeros_like(kv))
    assert b.stats.num_corrupt_blocks == 1 and b.stats.num_loaded_blocks == 0
    b.store(key(1), kv)  # recomputed and demoted again: replaces the bad entry
    b.flush()
    assert store.calls[-2:] == ["remove", "upsert"]
    assert a.load(key(1), out) and torch.equal(out, kv)


def test_an_entry_cut_short_is_caught(make_tier: MakeTier, store: FakeStore) -> None:
    a = make_tier()
    a.store(key(1), block(1))
    a.flush()
    name = a.store_key(key(1))
    store.entries[name] = store.entries[name][:-4]
    assert not a.load(key(1), torch.zeros_like(block(1)))
    assert a.stats.num_corrupt_blocks == 1


def test_a_block_whose_put_is_in_flight_loads_from_its_buffer(
    make_tier: MakeTier, store: FakeStore
) -> None:
    a = make_tier()
    store.gate.clear()  # the store hangs: the put waits in the writer thread
    kv = block(1)
    a.store(key(1), kv)
    assert store.wait_blocked(1, 5.0)
    out = torch.zeros_like(kv)
    assert a.find_run([key(1)]) == 1 and a.load(key(1), out) and torch.equal(out, kv)
    store.gate.set()
    a.flush()
    assert a.store_key(key(1)) in store.entries and a.num_used == 1


def test_a_dead_store_answers_miss_at_once_warns_once_and_is_retried_later(
    make_tier: MakeTier, store: FakeStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = make_tier(), make_tier()
    a.store(key(1), block(1))
    a.flush()
    store.is_down = True
    caplog.set_level(logging.INFO, logger="kvduplex.engine.kv_store_client")
    out = torch.zeros_like(block(1))
    started = time.monotonic()
    assert b.find_run([key(1)]) == 0
    assert time.monotonic() - started < TIMEOUT_S
    num_calls = len(store.calls)
    assert not b.load(key(1), out) and b.find_run([key(1)]) == 0
    b.store(key(2), block(2))
    assert len(store.calls) == num_calls, "a store that just failed is left alone"
    assert b.stats.num_unavailable == 4 and b.stats.num_stored_blocks == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "answers miss" in warnings[0].getMessage()
    clock.now += RETRY_S  # still down at the retry: the next wait doubles
    assert b.find_run([key(1)]) == 0 and len(store.calls) == num_calls + 1
    clock.now += RETRY_S
    assert b.find_run([key(1)]) == 0 and len(store.calls) == num_calls + 1
    store.is_down = False
    clock.now += RETRY_S
    assert b.find_run([key(1)]) == 1 and b.load(key(1), out)
    assert "used again" in caplog.records[-1].getMessage()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_a_hung_store_costs_one_deadline_then_is_left_alone_until_it_answers(
    make_tier: MakeTier, store: FakeStore, clock: Clock, calls: StoreCalls
) -> None:
    a, b = make_tier(), make_tier()
    kv = block(1)
    a.store(key(1), kv)
    a.flush()
    store.gate.clear()
    out = torch.zeros_like(kv)
    started = time.monotonic()
    assert not b.load(key(1), out)
    assert TIMEOUT_S <= time.monotonic() - started < 10 * TIMEOUT_S
    clock.now += 10 * RETRY_S  # past the retry time, but the late call still holds the reader
    started = time.monotonic()
    assert b.find_run([key(1)]) == 0 and not b.load(key(1), out)
    assert time.monotonic() - started < TIMEOUT_S and store.num_blocked == 1
    assert b.stats.num_unavailable == 3
    store.gate.set()
    assert calls.wait_idle(5.0), "the late call never ended"
    assert b.find_run([key(1)]) == 1
    assert b.load(key(1), out) and torch.equal(out, kv)


def test_a_load_cut_short_by_its_lookup_that_never_returns_marks_the_store_down(
    make_tier: MakeTier, store: FakeStore
) -> None:
    a, b = make_tier(), make_tier()
    a.store(key(1), block(1))
    a.flush()
    assert b.find_run([key(1)]) == 1
    store.gate.clear()  # the store hangs between the lookup and the load
    assert not b.load(key(1), torch.zeros_like(block(1)))
    cut_short_at = time.monotonic()
    # The next calls skip the store while the load runs; once it has run past the
    # deadline, one of them marks the store down. The deadline under test: the load
    # began before it was cut short.
    assert b.find_run([key(1)]) == 0
    time.sleep(max(0.0, cut_short_at + TIMEOUT_S - time.monotonic()))
    assert b.find_run([key(1)]) == 0 and not b.health.is_up()
    assert store.num_blocked == 1


def test_demoting_waits_for_a_hung_store_one_deadline_at_most(
    make_tier: MakeTier, store: FakeStore
) -> None:
    a = make_tier()
    store.gate.clear()
    started = time.monotonic()
    for n in range(STAGING_BUFFERS):  # one put in flight per staging buffer: no wait
        a.store(key(n), block(n))
    assert time.monotonic() - started < TIMEOUT_S
    for n in range(STAGING_BUFFERS, STAGING_BUFFERS + 3):
        a.store(key(n), block(n))  # the first waits for the oldest put, then all are dropped
    assert TIMEOUT_S <= time.monotonic() - started < 3 * TIMEOUT_S
    assert not a.health.is_up()
    assert a.stats.num_stored_blocks == STAGING_BUFFERS and a.stats.num_unavailable == 3
    out = torch.zeros_like(block(0))
    assert a.load(key(STAGING_BUFFERS - 1), out) and torch.equal(out, block(STAGING_BUFFERS - 1))
    store.gate.set()
    a.flush()
    assert len(store.entries) == STAGING_BUFFERS


def test_a_slow_store_shortens_a_run_and_a_burst_without_being_marked_down(
    make_tier: MakeTier, store: FakeStore
) -> None:
    a, b = make_tier(), make_tier()
    keys = [key(n) for n in range(6)]
    for n, k in enumerate(keys):
        a.store(k, block(n))
    a.flush()
    store.delay_s = 0.75 * TIMEOUT_S
    assert b.find_run(keys) == len(keys)
    started = time.monotonic()
    out = torch.zeros_like(block(0))
    num_loaded = 0
    while num_loaded < len(keys) and b.load(keys[num_loaded], out):  # as a promotion does
        num_loaded += 1
    # Waiting for every load would take 4.5 deadlines.
    assert num_loaded < len(keys) and time.monotonic() - started < 3 * TIMEOUT_S
    assert b.health.is_up() and b.stats.num_unavailable == 1
    store.delay_s = 0.25 * TIMEOUT_S
    started = time.monotonic()
    for n in range(10, 10 + 3 * STAGING_BUFFERS):  # a burst of demotions
        a.store(key(n), block(n))
    assert time.monotonic() - started < 4 * TIMEOUT_S  # waiting for every put: 8 deadlines
    assert a.health.is_up() and a.stats.num_unavailable > 0
    assert a.stats.num_stored_blocks + a.stats.num_unavailable == len(keys) + 3 * STAGING_BUFFERS


def test_a_late_put_marks_the_store_down(
    make_tier: MakeTier, store: FakeStore, clock: Clock
) -> None:
    a = make_tier()
    store.gate.clear()
    a.store(key(1), block(1))
    clock.now += 2 * TIMEOUT_S
    a.store(key(2), block(2))
    assert not a.health.is_up() and a.stats.num_unavailable == 1


def test_joining_is_retried_until_the_store_answers(
    store: FakeStore, clock: Clock, make_tier: MakeTier
) -> None:
    store.is_down = True
    tier = make_tier()
    assert not tier.joined(1.0)
    assert tier.find_run([key(1)]) == 0 and tier.stats.num_unavailable == 1
    store.is_down = False
    assert tier.find_run([key(1)]) == 0 and store.num_connects == 0, "before the retry time"
    clock.now += RETRY_S
    tier.find_run([key(1)])  # joins in the background
    assert tier.joined(5.0) and store.num_connects == 1
    tier.store(key(1), block(1))
    tier.flush()
    assert tier.find_run([key(1)]) == 1


def test_closing_does_not_wait_for_a_hung_store(make_tier: MakeTier, store: FakeStore) -> None:
    a = make_tier()
    store.gate.clear()
    a.store(key(1), block(1))
    started = time.monotonic()
    a.close()
    assert time.monotonic() - started < 5 * TIMEOUT_S


def test_the_store_tier_without_its_client_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_store_client, "mooncake_import_problem", lambda: "not here")
    config = CacheConfig(kv_tier=KVTierKind.STORE, kv_store_master="127.0.0.1:1", kv_tier_blocks=4)
    with pytest.raises(ValueError, match="kv_tier store: not here"):
        build_tier(config, LAYOUT, IDENTITY, torch.device("cpu"))
