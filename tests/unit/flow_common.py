"""What the flow tests share: the tiny model, its engines and their colocated answers,
a starved pool, and the check of where a late transfer lands."""

from __future__ import annotations

import pytest

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import KVTierKind
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from kvduplex.transport.base import Post
from kvduplex.transport.protocol import TransferOp

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
PROMPT = list(range(1, 19))  # 18 tokens: 5 blocks, the last one partial


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


def _engine(tiny: LoadedModel, budget: int = 256, tier_blocks: int = 0) -> LLMEngine:
    """An engine of 64 blocks; with `tier_blocks`, a host KV tier of that many below it."""
    tier = KVTierKind.HOST if tier_blocks else KVTierKind.NONE
    cfg = EngineConfig(
        cache=CacheConfig(block_size=BS, num_blocks=64, kv_tier=tier, kv_tier_blocks=tier_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
    )
    return LLMEngine(cfg, loaded=tiny)


def _reference(
    tiny: LoadedModel, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY
) -> list[int]:
    """The colocated greedy answer to ``prompt``."""
    engine = _engine(tiny)
    engine.add_request(Request("ref", prompt, params))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert len(out) == params.max_tokens  # every reference ignores EOS
    return out


class Starved:
    """Every free or cached block of ``engine``, taken: it steps (ticks, messages) but
    admits nothing until `end` gives them back (a busy instance)."""

    def __init__(self, engine: LLMEngine) -> None:
        st = engine.block_pool.stats()
        self.engine = engine
        self.blocks = engine.kv_manager.try_allocate_blocks(st.num_free + st.num_cached)
        assert self.blocks is not None

    def end(self) -> None:
        blocks, self.blocks = self.blocks, None
        if blocks is not None:
            self.engine.kv_manager.release_blocks(blocks)


def landing_problems(engine: LLMEngine, post: Post) -> list[str]:
    """Where a late transfer is about to land on ``engine``'s pool, what is wrong: a
    target block free, in the prefix cache, or owned by a request other than one still
    waiting for remote KV. Empty: reserved."""
    nb = engine.layout.num_blocks
    idx = post.remote if post.handle.op is TransferOp.WRITE else post.local
    blocks = {int(i) % nb for i in idx}
    xid = post.handle.xid
    problems = []
    for b in sorted(blocks):
        if engine.block_pool.ref_count(b) < 1:
            problems.append(f"{xid}: block {b} is free")
        if engine.block_pool.key_of(b) is not None:
            problems.append(f"{xid}: block {b} is in the prefix cache")
    sched = engine.scheduler
    for req in [*sched._requests.values(), *sched._held.values()]:
        if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV and (
            shared := blocks & set(req.block_ids)
        ):
            problems.append(f"{xid}: blocks {sorted(shared)} belong to {req.request_id}")
    return problems


__all__ = [
    "BS", "FIRST", "GREEDY", "PROMPT", "Starved", "_engine", "_reference", "landing_problems",
    "tiny",
]  # fmt: skip
