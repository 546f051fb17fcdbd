"""A long KV tier hit read layer by layer during the first forward (`TierLoads`), under a
real engine (tiny preset, greedy): token-exact against the pool's own hit and the
synchronous promotion, bit for bit; a short run, or one the pool goes on after, is
promoted whole; a slot found corrupt or cut short mid-load voids the step and the prompt
is computed (exact answer, counters, nothing leaked); a forward that raises, or a tier
closed, mid-load leaves nothing pinned, referenced or running."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.block_pool import BlockHash
from kvduplex.engine.block_pool import compute_block_hashes
from kvduplex.engine.connector import KVConnector
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.kv_manager import HitSource
from kvduplex.engine.kv_tier import HEADER_BYTES
from kvduplex.engine.kv_tier import HostTier
from kvduplex.engine.kv_tier import SlotTier
from kvduplex.engine.kv_tier_file import FileTier
from kvduplex.engine.request import Request
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from tests.unit.test_kv_tier_engine import GREEDY
from tests.unit.test_kv_tier_engine import OTHERS
from tests.unit.test_kv_tier_engine import PROMPT
from tests.unit.test_kv_tier_engine import Served
from tests.unit.test_kv_tier_engine import make_engine as tier_engine
from tests.unit.test_kv_tier_engine import run_one

BS = 4
NUM_BLOCKS = 20
NUM_RUN = 9  # PROMPT's full blocks a hit may cover (its last token is computed)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


def make_engine(tiny: LoadedModel, tier: KVTierKind, path: str = "", overlap: int = 4) -> LLMEngine:
    """`test_kv_tier_engine`'s engine, a tier run of `overlap` blocks or more loaded layer
    by layer."""
    return tier_engine(tiny, tier, path, overlap)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines made by a test; their tiers closed afterwards."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        if engine.kv_tier is not None:
            engine.kv_tier.close()


@pytest.fixture(params=[KVTierKind.HOST, KVTierKind.FILE], ids=["host", "file"])
def kind(request: pytest.FixtureRequest) -> KVTierKind:
    kind: KVTierKind = request.param
    return kind


def tiered(tiny: LoadedModel, engines: list[LLMEngine], kind: KVTierKind, tmp_path: Path,
           overlap: int = 4) -> tuple[LLMEngine, SlotTier]:  # fmt: skip
    """An engine that served PROMPT, then evicted it into its tier (every write done)."""
    engine = make_engine(tiny, kind, str(tmp_path) if kind is KVTierKind.FILE else "", overlap)
    engines.append(engine)
    assert engine.kv_tier is not None and isinstance(engine.kv_tier.tier, SlotTier)
    run_one(engine, "a", PROMPT)
    for j, other in enumerate(OTHERS):
        run_one(engine, f"other{j}", other)
    keys = compute_block_hashes(PROMPT, BS, engine.loaded.identity)
    assert engine.block_pool.num_cached_prefix(keys) == 0
    tier = engine.kv_tier.tier
    tier.flush()
    return engine, tier


def prompt_keys(engine: LLMEngine) -> list[BlockHash]:
    return compute_block_hashes(PROMPT, BS, engine.loaded.identity)[:NUM_RUN]


def flip(tier: SlotTier, position: int) -> None:
    """Flip one bit of the tier's storage at byte `position`."""
    if isinstance(tier, FileTier):
        byte = os.pread(tier.fileno(), 1, position)[0]
        os.pwrite(tier.fileno(), bytes([byte ^ 0x10]), position)
    else:
        assert isinstance(tier, HostTier)
        tier.slots.view(-1)[position] ^= 0x10


def assert_let_go(engine: LLMEngine, tier: SlotTier) -> None:
    """No slot pinned, no job running, no block referenced, the pool consistent."""
    loads = engine.tier_loads
    assert loads is not None
    assert not tier._pins and not tier._unpinned_free
    assert loads.last is None or loads.last.is_ended
    engine.check_integrity()
    assert engine.block_pool.stats().num_in_use == 0


@pytest.fixture(scope="module")
def references(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Served]:
    """PROMPT's answer from scratch (no tier), with its whole hit from the pool, and with
    the hit promoted from the file tier before the step (overlap off)."""
    scratch = make_engine(tiny, KVTierKind.NONE)
    refs = {"scratch": run_one(scratch, "ref", PROMPT), "pool": run_one(scratch, "ref2", PROMPT)}
    assert refs["pool"].num_cached_tokens == NUM_RUN * BS
    engines: list[LLMEngine] = []
    engine, _ = tiered(tiny, engines, KVTierKind.FILE, tmp_path_factory.mktemp("sync"), overlap=0)
    try:
        refs["sync"] = run_one(engine, "sync", PROMPT)
        assert engine.tier_loads is None and refs["sync"].num_cached_tokens == NUM_RUN * BS
    finally:
        for made in engines:
            assert made.kv_tier is not None
            made.kv_tier.close()
    return refs


def test_a_long_hit_loads_layer_by_layer_token_exact(
    tiny: LoadedModel, engines: list[LLMEngine], kind: KVTierKind, tmp_path: Path,
    references: dict[str, Served],
) -> None:  # fmt: skip
    engine, tier = tiered(tiny, engines, kind, tmp_path)
    loads = engine.tier_loads
    assert loads is not None
    num_hit_tier = engine.kv_manager.num_hit_tokens_by_source[HitSource.TIER]

    again = run_one(engine, "a2", PROMPT)

    assert again.token_ids == references["scratch"].token_ids
    assert again.logprobs == references["pool"].logprobs  # the very bytes the pool held
    assert again.logprobs == references["sync"].logprobs
    assert again.num_cached_tokens == NUM_RUN * BS
    assert again.final.num_prompt_computed_here == len(PROMPT) - NUM_RUN * BS
    job = loads.last
    assert job is not None and job.num_layers_done == engine.layout.num_layers
    assert len(job.layer_done_at) == engine.layout.num_layers
    assert [len(load.block_ids) for load in job.loads] == [NUM_RUN]
    assert loads.num_loaded_blocks == NUM_RUN and loads.num_failed == 0
    assert tier.stats.num_loaded_blocks == NUM_RUN and tier.stats.num_corrupt_blocks == 0
    hit_tier = engine.kv_manager.num_hit_tokens_by_source[HitSource.TIER] - num_hit_tier
    assert hit_tier == NUM_RUN * BS
    assert_let_go(engine, tier)
    # Loaded with the step, the blocks are cached like computed ones: a third turn hits
    # the pool.
    third = run_one(engine, "a3", PROMPT)
    assert third.token_ids == references["scratch"].token_ids
    assert third.num_cached_tokens == NUM_RUN * BS and loads.num_loaded_blocks == NUM_RUN


def test_a_run_shorter_than_the_threshold_is_promoted_before_the_step(
    tiny: LoadedModel, engines: list[LLMEngine], kind: KVTierKind, tmp_path: Path,
    references: dict[str, Served],
) -> None:  # fmt: skip
    engine, tier = tiered(tiny, engines, kind, tmp_path, overlap=NUM_RUN + 1)
    again = run_one(engine, "a2", PROMPT)
    assert again.logprobs == references["sync"].logprobs
    assert engine.tier_loads is not None and engine.tier_loads.last is None
    assert tier.stats.num_loaded_blocks == NUM_RUN


def test_a_run_the_pool_continues_is_promoted_whole(
    tiny: LoadedModel, engines: list[LLMEngine], kind: KVTierKind, tmp_path: Path,
    references: dict[str, Served],
) -> None:  # fmt: skip
    """The tier holds the prompt, the pool its tail too (as after a duplex return of the
    blocks after the tier's): the run is promoted at the lookup, so the hit goes on
    through the pool's blocks instead of ending where a layer-wise load would::

        blocks   0 .. 4 | 5 .. 8
                 tier   | tier, pool
    """
    engine, tier = tiered(tiny, engines, kind, tmp_path)
    keys = prompt_keys(engine)
    tail = engine.kv_manager.try_allocate_blocks(4)
    assert tail is not None
    for block_id, key in zip(tail, keys[5:], strict=True):
        assert tier.load(key, engine.kv_pool[:, :, block_id])
    assert engine.kv_manager.cache_blocks(tail, keys[5:]) == 4
    engine.kv_manager.release_blocks(tail)

    again = run_one(engine, "a2", PROMPT)

    assert again.logprobs == references["pool"].logprobs
    assert again.num_cached_tokens == NUM_RUN * BS
    assert engine.tier_loads is not None and engine.tier_loads.last is None


class RecordingConnector(KVConnector):
    """The colocated connector, recording what it hears of failed loads."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []
        self.layers_after_failure: list[int] = []

    def load_failed(self, request_id: str, reason: str) -> None:
        self.failed.append((request_id, reason))

    def layer_hook(self, meta: Any) -> Callable[[int], None]:
        def hook(layer: int) -> None:
            if self.failed:
                self.layers_after_failure.append(layer)

        return hook


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_slot_found_bad_mid_load_voids_the_step_and_is_recomputed(
    tiny: LoadedModel, engines: list[LLMEngine], kind: KVTierKind, tmp_path: Path,
    references: dict[str, Served], damage: str,
) -> None:  # fmt: skip
    if damage == "truncate" and kind is not KVTierKind.FILE:
        pytest.skip("only a file can be cut short")
    engine, tier = tiered(tiny, engines, kind, tmp_path)
    connector = engine.connector = RecordingConnector()
    keys = prompt_keys(engine)
    slots = [tier.slot_of(k) for k in keys]
    assert None not in slots
    # flip: block 6 of the run; truncate: the block in the last slot (the file ends there)
    bad = 6 if damage == "flip" else max(range(NUM_RUN), key=lambda i: slots[i] or 0)
    layer = 1  # layer 0 of every block lands, then layer 1 of the bad block fails
    position = (slots[bad] or 0) * tier.slot_bytes + HEADER_BYTES + layer * tier.layer_bytes + 3
    if damage == "flip":
        flip(tier, position)
    else:
        assert isinstance(tier, FileTier)
        os.ftruncate(tier.fileno(), position)
    loads = engine.tier_loads
    assert loads is not None

    again = run_one(engine, "a2", PROMPT)

    assert again.token_ids == references["scratch"].token_ids
    assert loads.num_failed == 1
    assert [rid for rid, _ in connector.failed] == ["a2"]
    assert f"layer {layer}" in connector.failed[0][1]
    # heard no later than the bad layer's own hook (sooner if the loader ran ahead)
    assert connector.layers_after_failure[0] <= layer
    assert tier.stats.num_corrupt_blocks == 1 and not tier.contains(keys[bad])
    assert all(tier.contains(k) for k in keys[:bad])
    # Computed again from its pool hit: the run before the bad block is loaded again
    # (layer by layer if long enough), the rest computed.
    assert again.num_cached_tokens == bad * BS and tier.stats.num_loaded_blocks == bad
    assert loads.num_loaded_blocks == (bad if bad >= loads.min_blocks else 0)
    assert_let_go(engine, tier)


@pytest.mark.parametrize("corrupt", [False, True], ids=["sound", "corrupt"])
def test_two_requests_of_one_step_read_the_same_run(
    tiny: LoadedModel, engines: list[LLMEngine], tmp_path: Path,
    references: dict[str, Served], corrupt: bool,
) -> None:  # fmt: skip
    """Both loads pin the same slots; a bad one fails both and is dropped once."""
    engine, tier = tiered(tiny, engines, KVTierKind.FILE, tmp_path)
    keys = prompt_keys(engine)
    if corrupt:
        slot = tier.slot_of(keys[5])
        assert slot is not None
        flip(tier, slot * tier.slot_bytes + HEADER_BYTES + 2 * tier.layer_bytes + 7)
    for rid in ("x", "y"):
        engine.add_request(Request(rid, PROMPT, GREEDY))
    answers: dict[str, list[int]] = {"x": [], "y": []}
    while engine.has_unfinished():
        for out in engine.step():
            answers[out.request_id].extend(out.new_token_ids)
    loads = engine.tier_loads
    assert loads is not None
    first = loads.last if not corrupt else None
    assert answers["x"] == answers["y"] == references["scratch"].token_ids
    assert tier.stats.num_corrupt_blocks == int(corrupt)
    if corrupt:  # both computed again, each loading the 5 blocks before the bad one
        assert loads.num_failed == 2 and not tier.contains(keys[5])
        assert loads.num_loaded_blocks == 2 * 5
    else:
        assert first is not None and [len(x.block_ids) for x in first.loads] == [NUM_RUN] * 2
        assert loads.num_loaded_blocks == 2 * NUM_RUN
    assert_let_go(engine, tier)


def test_a_forward_that_raises_mid_load_leaves_nothing_behind(
    tiny: LoadedModel, engines: list[LLMEngine], kind: KVTierKind, tmp_path: Path,
    references: dict[str, Served],
) -> None:  # fmt: skip
    engine, tier = tiered(tiny, engines, kind, tmp_path)
    runner, execute = engine.runner, engine.runner.execute
    loads = engine.tier_loads
    assert loads is not None
    read_layer = tier.read_layer

    def gated_read(source: Any, layer: int, parts: Any) -> str | None:
        job = loads.last
        assert job is not None
        if layer == 1:  # mid-load until the step lets go of it
            with job.cond:
                job.cond.wait_for(lambda: job.is_cancelled)
        return read_layer(source, layer, parts)

    tier.read_layer = gated_read  # type: ignore[method-assign]

    def raising(seqs: Any, on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        assert on_layer_done is not None
        on_layer_done(0)
        raise RuntimeError("the forward failed at layer 1")

    runner.execute = raising  # type: ignore[method-assign]
    engine.add_request(Request("a2", PROMPT, GREEDY))
    with pytest.raises(RuntimeError, match="layer 1"):
        engine.step()
    assert loads.last is not None and loads.last.is_ended
    assert loads.last.num_layers_done == 1, "stopped mid-load"
    assert not tier._pins and loads.num_loaded_blocks == 0
    assert all(tier.contains(k) for k in prompt_keys(engine)), "nothing found bad"
    assert engine.abort_request("a2")
    assert_let_go(engine, tier)

    runner.execute = execute  # type: ignore[method-assign]
    tier.read_layer = read_layer  # type: ignore[method-assign]
    again = run_one(engine, "a3", PROMPT)
    assert again.logprobs == references["pool"].logprobs
    assert loads.num_loaded_blocks == NUM_RUN


def test_a_tier_closed_mid_load_stops_the_loader_and_the_prompt_is_computed(
    tiny: LoadedModel, engines: list[LLMEngine], kind: KVTierKind, tmp_path: Path,
    references: dict[str, Served],
) -> None:  # fmt: skip
    engine, tier = tiered(tiny, engines, kind, tmp_path)
    assert engine.kv_tier is not None
    close = engine.kv_tier.close

    loads = engine.tier_loads
    assert loads is not None
    # The loader stops before layer 2 until the tier's close has begun (then it finds
    # it closing at its next block); the close runs on another thread, as a shutdown's.
    closing = threading.Event()
    read_layer, shutdown = tier.read_layer, loads._loader.shutdown

    def gated_read(source: Any, layer: int, parts: Any) -> str | None:
        if layer == 2:
            closing.wait()
        return read_layer(source, layer, parts)

    def signalled_shutdown(wait: bool = True, *, cancel_futures: bool = False) -> None:
        closing.set()
        shutdown(wait, cancel_futures=cancel_futures)

    tier.read_layer = gated_read  # type: ignore[method-assign]
    loads._loader.shutdown = signalled_shutdown  # type: ignore[method-assign]
    closers: list[threading.Thread] = []

    class ClosingConnector(RecordingConnector):
        def layer_hook(self, meta: Any) -> Callable[[int], None]:
            def hook(layer: int) -> None:
                if layer == 1 and not closers:
                    closers.append(threading.Thread(target=close))
                    closers[0].start()

            return hook

    connector = engine.connector = ClosingConnector()
    again = run_one(engine, "a2", PROMPT)
    closers[0].join()

    assert again.token_ids == references["scratch"].token_ids
    assert [rid for rid, _ in connector.failed] == ["a2"]
    assert again.num_cached_tokens == 0  # the tier is gone: computed from scratch
    assert loads.num_failed == 1 and loads.num_loaded_blocks == 0
    assert not any(t.name.startswith("kvduplex-tier-load") for t in threading.enumerate())
    assert not tier._pins
    engine.check_integrity()
    assert engine.block_pool.stats().num_in_use == 0


# ---- the tier's side: layer reads, their checks, pins ----

LAYOUT = KVCacheLayout(num_layers=3, block_size=2, num_kv_heads=2, head_dim=4, num_blocks=4,
                       dtype="float32")  # fmt: skip


def test_layer_reads_are_checked_and_pinned_slots_are_not_reused(tmp_path: Path) -> None:
    tier = FileTier(LAYOUT, b"model", num_slots=2, directory=str(tmp_path))
    pool = torch.zeros(3, 2, 4, 2, 2, 4)  # (L, 2, blocks, BS, H, D)
    try:
        a, b, c, d = (BlockHash(bytes([n]) * 32) for n in b"abcd")
        block = torch.arange(3 * 2 * 2 * 2 * 4, dtype=torch.float32).view(3, 2, 2, 2, 4)
        tier.store(a, block)
        tier.store(b, block + 1)
        tier.flush()
        (source,) = tier.pin([a, c, b])  # stops at the first absent
        tier.store(d, block + 2)  # evicts b's entry, not the pinned one
        assert tier.contains(a) and not tier.contains(b)
        pool_bytes = pool.view(torch.uint8).numpy()
        for layer in range(3):
            parts = (pool_bytes[layer, 0, 1], pool_bytes[layer, 1, 1])
            assert tier.read_layer(source, layer, parts) is None
        assert torch.equal(pool[:, :, 1], block)
        flip(tier, source.slot * tier.slot_bytes + HEADER_BYTES + 2 * tier.layer_bytes + 1)
        assert tier.read_layer(source, 2, (pool_bytes[2, 0, 0], pool_bytes[2, 1, 0])) == (
            "checksum mismatch"
        )
        # its own CRC holds; one buffer for K and V is read alike
        assert tier.read_layer(source, 1, (pool_bytes[1, :, 0].copy(),)) is None
        tier.unpin([source], {source.key: "checksum mismatch"})
        assert not tier.contains(a) and tier.stats.num_corrupt_blocks == 1
        assert not tier._pins
    finally:
        tier.close()
