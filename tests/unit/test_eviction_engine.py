"""Eviction by session value under a real engine (tiny preset, greedy, stepped directly):
a pool too small for every session keeps a live session's history through a burst of
plain requests that LRU lets evict it, drops an idle session's first, and answers stay
token-exact; the settings and the counters on /metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from typing import cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest

from kvduplex.cli.main import parse_args
from kvduplex.cli.settings import ServeSettings
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import EvictionPolicy
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.settings import ConfigError
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.eviction import SHARED
from kvduplex.engine.eviction import EvictionClass
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.request import Request
from kvduplex.instance.kv_routes import make_prefill_router
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from tests.unit.conftest import tiny_instance

BS = 4
NUM_BLOCKS = 24
IDLE_S = 180.0
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 1 for i in range(n)]


A_PROMPT, B_PROMPT = tokens(1, 32), tokens(2, 32)  # 40 tokens with the answer: 9 blocks cached
PLAIN = [tokens(10 + j, 20) for j in range(4)]  # 7 blocks each while running, 6 cached
C_PROMPT = tokens(3, 52)  # a live session's long turn: 14 blocks while running


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_engine(
    tiny: LoadedModel, policy: EvictionPolicy, clock: FakeClock, num_blocks: int = NUM_BLOCKS
) -> LLMEngine:
    cache = CacheConfig(
        block_size=BS, num_blocks=num_blocks, eviction=policy, session_idle_s=IDLE_S
    )
    cfg = EngineConfig(
        model=ModelLoadConfig(model="tiny"),
        cache=cache,
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    return LLMEngine(cfg, loaded=tiny, clock=clock)


@dataclass
class Served:
    token_ids: list[int]
    num_cached_tokens: int


def run_one(engine: LLMEngine, rid: str, prompt: list[int], session: str | None) -> Served:
    """Serve one request alone, stepping to its end; the pool is consistent after it."""
    engine.add_request(Request(rid, prompt, GREEDY, session_id=session))
    out: list[int] = []
    num_cached = -1
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
            if o.finished:
                num_cached = o.num_cached_tokens
        engine.check_integrity()
    s = engine.block_pool.stats()
    assert s.num_in_use == 0 and s.num_free + s.num_cached == s.total
    return Served(out, num_cached)


def num_cached_blocks(engine: LLMEngine, token_ids: Sequence[int]) -> int:
    keys = compute_block_hashes(token_ids, BS, engine.loaded.identity)
    return engine.block_pool.num_cached_prefix(keys)


@dataclass
class Story:
    """What one engine went through: a finished session (b), a live one (a), a burst of
    plain requests, a live session's long turn (c), then a's next turn."""

    a1: Served
    a2: Served
    a2_prompt: list[int]
    a_after_burst: int
    """Blocks of a's history cached after the plain burst."""
    a_after_c: int
    b_after_c: int
    engine: LLMEngine


def tell(tiny: LoadedModel, policy: EvictionPolicy) -> Story:
    clock = FakeClock()
    engine = make_engine(tiny, policy, clock)
    # 1. t=0: session b's turn (9 blocks cached); it will not come back.
    run_one(engine, "b1", B_PROMPT, "b")
    # 2. t=200: session a's turn (9 blocks); a is live, b idle for 200 s > 180 s.
    clock.now = 200
    a1 = run_one(engine, "a1", A_PROMPT, "a")
    assert num_cached_blocks(engine, A_PROMPT + a1.token_ids) == 9
    # 3. t=220: a burst of plain requests, 6 blocks cached each: the pool cannot hold all.
    clock.now = 220
    for j, prompt in enumerate(PLAIN):
        run_one(engine, f"plain{j}", prompt, None)
    a_history = A_PROMPT + a1.token_ids
    a_after_burst = num_cached_blocks(engine, a_history)
    # 4. t=230: session c's long first turn needs 14 blocks.
    clock.now = 230
    run_one(engine, "c1", C_PROMPT, "c")
    a_after_c = num_cached_blocks(engine, a_history)
    b_after_c = num_cached_blocks(engine, B_PROMPT)
    # 5. t=240: a's next turn: its history, the answer, four new tokens.
    clock.now = 240
    a2_prompt = [*a_history, 5, 6, 7, 8]
    a2 = run_one(engine, "a2", a2_prompt, "a")
    return Story(a1, a2, a2_prompt, a_after_burst, a_after_c, b_after_c, engine)


@pytest.fixture(scope="module")
def from_scratch(tiny: LoadedModel) -> dict[str, list[int]]:
    """a's turns computed from scratch, on a pool that evicts nothing."""
    engine = make_engine(tiny, EvictionPolicy.LRU, FakeClock(), num_blocks=64)
    a1 = run_one(engine, "a1", A_PROMPT, None).token_ids
    engine.block_pool.reset_prefix_cache()
    a2 = run_one(engine, "a2", [*A_PROMPT, *a1, 5, 6, 7, 8], None)
    assert a2.num_cached_tokens == 0
    return {"a1": a1, "a2": a2.token_ids}


def test_a_live_sessions_history_survives_a_plain_burst(
    tiny: LoadedModel, from_scratch: dict[str, list[int]]
) -> None:
    story = tell(tiny, EvictionPolicy.SESSION)
    assert story.a1.token_ids == from_scratch["a1"]
    # The burst evicted plain blocks (and one of idle b's), none of a's.
    assert story.a_after_burst == 9
    # c's turn took plain blocks, then idle b's, still none of live a's.
    assert story.a_after_c == 9 and story.b_after_c < 9
    # a's next turn hits its whole history, and answers as from scratch.
    assert story.a2.num_cached_tokens == 36
    assert story.a2.token_ids == from_scratch["a2"]
    evicted = story.engine.block_pool.evictor.num_evicted
    assert evicted[EvictionClass.PLAIN] >= 18 and evicted[EvictionClass.SESSION] > 0


def test_under_lru_the_same_burst_evicts_it(
    tiny: LoadedModel, from_scratch: dict[str, list[int]]
) -> None:
    story = tell(tiny, EvictionPolicy.LRU)
    assert story.a1.token_ids == from_scratch["a1"]
    assert story.a_after_burst == 0  # released before the burst: gone
    assert story.a2.num_cached_tokens == 0
    assert story.a2.token_ids == from_scratch["a2"]  # recomputed, still exact


def test_evictions_by_class_reach_the_metrics(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, EvictionPolicy.SESSION, FakeClock(), num_blocks=12)
    registry = CollectorRegistry()
    AsyncEngine(engine, EngineMetrics(registry))  # binds the metrics; its thread is not started
    text = generate_latest(registry).decode()
    assert 'kvduplex_kv_evicted_blocks_total{class="session"} 0.0' in text
    run_one(engine, "a", A_PROMPT, "a")  # 9 blocks of a's history
    run_one(engine, "p", PLAIN[0], None)  # 7 blocks: 3 free, 4 of a's
    evicted = engine.block_pool.evictor.num_evicted
    assert sorted((c.label, n) for c, n in evicted.items()) == [
        ("plain", 0), ("returned", 0), ("session", 4),
    ]  # fmt: skip
    text = generate_latest(registry).decode()
    for label, num in (("plain", 0), ("session", 4), ("returned", 0)):
        assert f'kvduplex_kv_evicted_blocks_total{{class="{label}"}} {num}.0\n' in text


def cache_of(argv: list[str]) -> CacheConfig:
    settings = parse_args(["serve", *argv])
    assert isinstance(settings, ServeSettings)
    return settings.engine_config().cache


def test_eviction_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVDUPLEX_EVICTION", "KVDUPLEX_SESSION_IDLE_S"):
        monkeypatch.delenv(name, raising=False)
    default = cache_of([])
    assert (default.eviction, default.session_idle_s) == (EvictionPolicy.SESSION, 180.0)
    lru = cache_of(["--eviction", "lru", "--session-idle-s", "30"])
    assert (lru.eviction, lru.session_idle_s) == (EvictionPolicy.LRU, 30.0)
    with pytest.raises(ConfigError, match="session_idle_s must be > 0"):
        cache_of(["--session-idle-s", "0"])


def test_an_unknown_eviction_is_refused_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--eviction", "fifo"])
    assert "choose from 'lru', 'session'" in capsys.readouterr().err


def test_an_openai_requests_prompt_cache_key_names_its_session() -> None:
    instance = tiny_instance()
    engine = instance.engine
    prompt = list(range(1, 41))  # 40 tokens: two full blocks of 16 cached
    keys = compute_block_hashes(prompt, engine.kv_manager.block_size, engine.loaded.identity)

    def classes(e: LLMEngine) -> list[tuple[EvictionClass, str | None]]:
        ev = e.block_pool.evictor
        return [(ev.classes[b], ev.owners[b]) for b in e.block_pool.lookup(keys)]

    try:
        with TestClient(instance.app) as client:
            # 1. Named by prompt_cache_key, 2. by its alias, 3. by nothing: the blocks keep
            #    their class, held by the latest session (a plain use: the shared owner).
            for fields, owner in (
                ({"prompt_cache_key": "conv-1"}, "conv-1"),
                ({"session_id": "conv-2"}, "conv-2"),
                ({}, SHARED),
            ):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **fields}
                assert client.post("/v1/completions", json=body).status_code == 200
                got = instance.async_engine.call(classes).result(10)
                assert got == [(EvictionClass.SESSION, owner)] * 2
            assert 'kvduplex_kv_evicted_blocks_total{class="plain"}' in client.get("/metrics").text
    finally:
        instance.async_engine.shutdown()


def test_a_prefill_bodys_session_reaches_its_blocks() -> None:
    instance = tiny_instance()
    engine = instance.engine
    app = FastAPI()
    app.include_router(
        make_prefill_router(instance.state, cast(Any, SimpleNamespace(engine_id="e")), 30.0)
    )
    prompt = list(range(3, 43))
    keys = compute_block_hashes(prompt, engine.kv_manager.block_size, engine.loaded.identity)
    try:
        with TestClient(app) as client:
            body = {"xid": "x1", "prompt_token_ids": prompt, "session_id": "s9"}
            assert client.post("/internal/prefill", json=body).status_code == 200
            assert client.post("/internal/release", json={"xid": "x1"}).status_code == 200

        def classes(e: LLMEngine) -> list[tuple[EvictionClass, str | None]]:
            ev = e.block_pool.evictor
            return [(ev.classes[b], ev.owners[b]) for b in e.block_pool.lookup(keys)]

        assert instance.async_engine.call(classes).result(10) == [(EvictionClass.SESSION, "s9")] * 2
    finally:
        instance.async_engine.shutdown()
