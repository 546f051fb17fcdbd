"""Two real engines (tiny preset, greedy) sharing one store through their store tiers, the
store an in-process fake (`tests.support.fake_store`; the real Mooncake store between
real processes: tests/integration/test_kv_store.py): a prompt one engine demoted is
served by the other from the store, token-exact; a store that is down or hung costs
only a recompute, counted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest

from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.kv_tier_store import StoreTier
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.tier_link import TierLink
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from tests.support.fake_store import FakeStore
from tests.unit.test_kv_tier_engine import PROMPT
from tests.unit.test_kv_tier_engine import evict_prompt
from tests.unit.test_kv_tier_engine import make_engine
from tests.unit.test_kv_tier_engine import run_one

TIMEOUT_S = 0.2


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


@pytest.fixture(scope="module")
def from_scratch(tiny: LoadedModel) -> list[int]:
    """PROMPT's answer on an engine without a tier, computed from scratch."""
    return run_one(make_engine(tiny, KVTierKind.NONE), "ref", PROMPT).token_ids


@pytest.fixture
def store() -> Iterator[FakeStore]:
    made = FakeStore()
    yield made
    made.gate.set()


@pytest.fixture
def engines(tiny: LoadedModel, store: FakeStore) -> Iterator[list[LLMEngine]]:
    """Two engines whose tiers share `store` (joined); their tiers closed afterwards."""
    made = [make_engine(tiny, KVTierKind.NONE) for _ in range(2)]
    for engine in made:
        tier = StoreTier(engine.layout, engine.loaded.identity, 64, store.connect,
                         timeout_s=TIMEOUT_S)  # fmt: skip
        assert tier.joined(5.0)
        engine.kv_tier = TierLink(tier, engine.kv_pool, engine.block_pool)
        engine.kv_manager.tier = engine.kv_tier
    yield made
    store.gate.set()
    for engine in made:
        assert engine.kv_tier is not None
        engine.kv_tier.close()


def store_tier(engine: LLMEngine) -> StoreTier:
    assert engine.kv_tier is not None and isinstance(engine.kv_tier.tier, StoreTier)
    return engine.kv_tier.tier


def test_a_prompt_one_engine_demoted_the_other_serves_from_the_store(
    engines: list[LLMEngine], from_scratch: list[int]
) -> None:
    first, second = engines
    assert run_one(first, "a", PROMPT).token_ids == from_scratch
    evict_prompt(first)
    store_tier(first).flush()
    registry = CollectorRegistry()
    AsyncEngine(second, EngineMetrics(registry))  # binds the metrics; its thread is not started
    served = run_one(second, "b", PROMPT)
    assert served.token_ids == from_scratch
    assert served.num_cached_tokens == 36  # 9 blocks from the store (the last token computed)
    stats = store_tier(second).stats
    assert (stats.num_loaded_blocks, stats.num_unavailable, stats.num_corrupt_blocks) == (9, 0, 0)
    text = generate_latest(registry).decode()
    assert "kvduplex_kv_tier_hit_blocks_total 9.0\n" in text
    assert "kvduplex_kv_tier_store_up 1.0\n" in text
    assert 'kvduplex_kv_hit_tokens_total{source="store"} 36.0\n' in text
    assert 'kvduplex_kv_hit_tokens_total{source="pool"} 0.0\n' in text
    assert run_one(second, "c", PROMPT).num_cached_tokens == 36  # now from its own pool
    text = generate_latest(registry).decode()
    assert 'kvduplex_kv_hit_tokens_total{source="store"} 36.0\n' in text
    assert 'kvduplex_kv_hit_tokens_total{source="pool"} 36.0\n' in text


@pytest.mark.parametrize("fault", ["down", "hung"])
def test_a_failing_store_costs_a_recompute_never_a_wrong_token(
    engines: list[LLMEngine], store: FakeStore, from_scratch: list[int], fault: str
) -> None:
    first, second = engines
    run_one(first, "a", PROMPT)
    evict_prompt(first)
    store_tier(first).flush()
    if fault == "down":
        store.is_down = True
    else:
        store.gate.clear()
    served = run_one(second, "b", PROMPT)
    assert served.token_ids == from_scratch and served.num_cached_tokens == 0
    stats = store_tier(second).stats
    assert stats.num_unavailable >= 1 and stats.num_loaded_blocks == 0
    assert not store_tier(second).health.is_up()
