"""The KV tier under a real engine (tiny preset, greedy): blocks the pool evicts come
back from the tier, token-exact (and with the logprobs of the same hit served from the
pool, bit for bit), and a truncated or corrupted tier costs only a recompute."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.sampling import TokenLogprobs
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.kv_tier import HEADER_BYTES
from kvduplex.engine.kv_tier_file import FileTier
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.request import Request
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.server import build_instance
from kvduplex.instance.state import kv_clock
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model

BS = 4
NUM_BLOCKS = 20
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 10 blocks; a hit covers at most 9
OTHERS = [[(11 * i + 5 * j) % 250 + 1 for i in range(56)] for j in (1, 2)]  # 17 blocks with answers


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


def make_engine(
    tiny: LoadedModel, tier: KVTierKind, path: str = "", overlap: int | None = None
) -> LLMEngine:
    """An engine on `tiny` over a small pool and a 64-block tier; `overlap`: its
    ``kv_tier_overlap_blocks`` (None: the device's default)."""
    cache = CacheConfig(
        block_size=BS, num_blocks=NUM_BLOCKS, kv_tier=tier, kv_tier_blocks=64,
        kv_tier_path=path, kv_tier_overlap_blocks=overlap,
    )  # fmt: skip
    cfg = EngineConfig(
        model=ModelLoadConfig(model="tiny"),
        cache=cache,
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    return LLMEngine(cfg, loaded=tiny)


@pytest.fixture
def engines(tiny: LoadedModel) -> Iterator[list[LLMEngine]]:
    """Engines made by a test; their tiers closed afterwards."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        if engine.kv_tier is not None:
            engine.kv_tier.close()


@dataclass
class Served:
    """One request's whole answer."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    final: RequestOutput
    """Its last output (cached-token counts)."""

    @property
    def num_cached_tokens(self) -> int:
        return self.final.num_cached_tokens


def run_one(engine: LLMEngine, rid: str, prompt: list[int]) -> Served:
    """Serve one request alone, stepping to its end; the pool is consistent after it."""
    engine.add_request(Request(rid, prompt, GREEDY))
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    final: RequestOutput | None = None
    while engine.has_unfinished():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs or [])
            if out.finished:
                final = out
    assert final is not None and len(logprobs) == len(token_ids)
    engine.check_integrity()
    assert engine.block_pool.stats().num_in_use == 0
    return Served(token_ids, logprobs, final)


def evict_prompt(engine: LLMEngine) -> None:
    """Two other long requests: every block of PROMPT leaves the pool."""
    for j, other in enumerate(OTHERS):
        run_one(engine, f"other{j}", other)
    keys = compute_block_hashes(PROMPT, BS, engine.loaded.identity)
    assert engine.block_pool.num_cached_prefix(keys) == 0


@pytest.fixture(scope="module")
def from_scratch(tiny: LoadedModel) -> list[int]:
    """PROMPT's answer on an engine without a tier, computed from scratch."""
    return run_one(make_engine(tiny, KVTierKind.NONE), "ref", PROMPT).token_ids


@pytest.fixture(scope="module")
def pool_hit(tiny: LoadedModel, from_scratch: list[int]) -> Served:
    """PROMPT served again with its whole hit (36 tokens) from the pool, no tier."""
    engine = make_engine(tiny, KVTierKind.NONE)
    run_one(engine, "ref", PROMPT)
    served = run_one(engine, "ref2", PROMPT)
    assert served.token_ids == from_scratch and served.num_cached_tokens == 36
    return served


@pytest.mark.parametrize("kind", [KVTierKind.HOST, KVTierKind.FILE])
def test_evicted_prefix_comes_back_from_the_tier_token_exact(
    tiny: LoadedModel,
    engines: list[LLMEngine],
    from_scratch: list[int],
    pool_hit: Served,
    kind: KVTierKind,
    tmp_path: Path,
) -> None:
    engine = make_engine(tiny, kind, str(tmp_path) if kind is KVTierKind.FILE else "")
    engines.append(engine)
    assert engine.kv_tier is not None
    stats = engine.kv_tier.tier.stats
    first = run_one(engine, "a", PROMPT)
    assert first.token_ids == from_scratch and first.num_cached_tokens == 0
    evict_prompt(engine)
    assert stats.num_stored_blocks >= 9

    again = run_one(engine, "a2", PROMPT)
    assert again.token_ids == from_scratch
    assert again.logprobs == pool_hit.logprobs  # the very bytes the pool held
    assert again.num_cached_tokens == 36  # every full prompt block but the last token's
    assert again.final.num_prompt_computed_here == 4
    assert stats.num_loaded_blocks == 9 and stats.num_corrupt_blocks == 0


def test_pool_head_and_tier_tail_make_one_hit(
    tiny: LoadedModel, engines: list[LLMEngine], from_scratch: list[int], pool_hit: Served
) -> None:
    """One other request evicts only PROMPT's tail (released first): its head is still
    in the pool, its tail in the tier, and the hit runs through both."""
    engine = make_engine(tiny, KVTierKind.HOST)
    engines.append(engine)
    assert engine.kv_tier is not None
    run_one(engine, "a", PROMPT)
    run_one(engine, "other", OTHERS[0])
    keys = compute_block_hashes(PROMPT, BS, engine.loaded.identity)
    num_in_pool = engine.block_pool.num_cached_prefix(keys)
    assert 0 < num_in_pool < 9
    again = run_one(engine, "a2", PROMPT)
    assert again.token_ids == from_scratch and again.num_cached_tokens == 36
    assert again.logprobs == pool_hit.logprobs
    assert engine.kv_tier.tier.stats.num_loaded_blocks == 9 - num_in_pool


def test_truncated_tier_file_is_recomputed(
    tiny: LoadedModel, engines: list[LLMEngine], from_scratch: list[int], tmp_path: Path
) -> None:
    engine = make_engine(tiny, KVTierKind.FILE, str(tmp_path))
    engines.append(engine)
    assert engine.kv_tier is not None and isinstance(engine.kv_tier.tier, FileTier)
    tier = engine.kv_tier.tier
    run_one(engine, "a", PROMPT)
    evict_prompt(engine)
    tier.flush()
    os.ftruncate(tier.fileno(), 0)

    again = run_one(engine, "a2", PROMPT)
    assert again.token_ids == from_scratch
    assert again.num_cached_tokens == 0  # the first block failed: nothing after it is used
    assert tier.stats.num_corrupt_blocks == 1 and tier.stats.num_loaded_blocks == 0


@pytest.mark.parametrize("kind", [KVTierKind.HOST, KVTierKind.FILE])
def test_a_corrupt_slot_ends_the_hit_there(
    tiny: LoadedModel,
    engines: list[LLMEngine],
    from_scratch: list[int],
    kind: KVTierKind,
    tmp_path: Path,
) -> None:
    engine = make_engine(tiny, kind, str(tmp_path) if kind is KVTierKind.FILE else "")
    engines.append(engine)
    assert engine.kv_tier is not None
    tier = engine.kv_tier.tier
    run_one(engine, "a", PROMPT)
    evict_prompt(engine)
    tier.flush()
    fourth = compute_block_hashes(PROMPT, BS, engine.loaded.identity)[3]
    slot = tier.slot_of(fourth)
    assert slot is not None
    position = slot * tier.slot_bytes + HEADER_BYTES + 100  # inside the payload
    if isinstance(tier, FileTier):
        byte = os.pread(tier.fileno(), 1, position)[0]
        os.pwrite(tier.fileno(), bytes([byte ^ 0x10]), position)
    else:
        tier.slots.view(-1)[position] ^= 0x10

    again = run_one(engine, "a2", PROMPT)
    assert again.token_ids == from_scratch
    assert again.num_cached_tokens == 12  # three good blocks, then the corrupt one
    assert tier.stats.num_corrupt_blocks == 1 and tier.stats.num_loaded_blocks == 3
    assert not tier.contains(fourth)

    # The recomputed blocks are cached again; evicted again, they are stored afresh.
    evict_prompt(engine)
    assert tier.contains(fourth)
    third = run_one(engine, "a3", PROMPT)
    assert third.token_ids == from_scratch and third.num_cached_tokens == 36


def test_no_tier_is_the_default_and_changes_nothing(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, KVTierKind.NONE)
    assert engine.kv_tier is None and engine.kv_manager.tier is None
    assert engine.block_pool.on_evict is None
    run_one(engine, "a", PROMPT)
    evict_prompt(engine)
    assert run_one(engine, "a2", PROMPT).num_cached_tokens == 0


def test_tier_counters_reach_the_metrics(
    tiny: LoadedModel, engines: list[LLMEngine], from_scratch: list[int]
) -> None:
    engine = make_engine(tiny, KVTierKind.HOST)
    engines.append(engine)
    registry = CollectorRegistry()
    AsyncEngine(engine, EngineMetrics(registry))  # binds the metrics; its thread is not started
    run_one(engine, "a", PROMPT)
    evict_prompt(engine)
    run_one(engine, "a2", PROMPT)
    assert engine.kv_tier is not None
    engine.kv_tier.tier.flush()
    stats = engine.kv_tier.tier.stats
    text = generate_latest(registry).decode()
    slot = HEADER_BYTES + engine.layout.bytes_per_block
    for line in (
        "kvduplex_kv_tier_hit_blocks_total 9.0",
        f"kvduplex_kv_tier_hit_tokens_total {9 * BS}.0",
        f"kvduplex_kv_tier_stored_blocks_total {stats.num_stored_blocks}.0",
        f"kvduplex_kv_tier_written_bytes_total {stats.num_stored_blocks * slot}.0",
        f"kvduplex_kv_tier_read_bytes_total {9 * slot}.0",
        "kvduplex_kv_tier_corrupt_blocks_total 0.0",
        f"kvduplex_kv_tier_evicted_blocks_total {stats.num_evicted_blocks}.0",
        "kvduplex_kv_tier_blocks_total 64.0",
    ):
        assert line + "\n" in text, line


def test_an_instance_serves_its_tier_metrics_and_closes_it(tmp_path: Path) -> None:
    cache = CacheConfig(
        kv_cache_mb=4, kv_tier=KVTierKind.FILE, kv_tier_blocks=32, kv_tier_path=str(tmp_path)
    )
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny"), cache=cache)
    instance = build_instance(cfg, ServerConfig(port=0))
    try:
        link = instance.engine.kv_tier
        assert link is not None and isinstance(link.tier, FileTier)
        with TestClient(instance.app) as client:
            text = client.get("/metrics").text
        assert "kvduplex_kv_tier_blocks_total 32.0" in text
        assert "kvduplex_kv_tier_corrupt_blocks_total 0.0" in text
    finally:
        instance.shutdown()
    assert instance.engine.block_pool.on_evict is None  # closed with the instance


def test_the_cache_size_the_router_reads_counts_the_tier(tiny: LoadedModel) -> None:
    plain, tiered = make_engine(tiny, KVTierKind.NONE), make_engine(tiny, KVTierKind.HOST)
    try:
        assert kv_clock(plain)["kv_num_blocks"] == plain.block_pool.num_blocks
        assert tiered.kv_tier is not None
        want = tiered.block_pool.num_blocks + tiered.kv_tier.tier.num_slots
        assert kv_clock(tiered)["kv_num_blocks"] == want
        run_one(tiered, "r", list(range(1, 40)))
        assert kv_clock(tiered)["kv_blocks_allocated"] == tiered.block_pool.num_allocated > 0
    finally:
        for engine in (plain, tiered):
            if engine.kv_tier is not None:
                engine.kv_tier.close()
