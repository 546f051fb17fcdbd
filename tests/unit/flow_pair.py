"""Two engines (P and D) in one process, wired with the flows of their roles as
instances wire them, joined by the in-process transport. Shared by the flow tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.kvflow.connectors import FlowTiming
from kvduplex.kvflow.connectors import decode_flows
from kvduplex.kvflow.connectors import prefill_flows
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from kvduplex.transport.base import Post
from kvduplex.transport.notify import NotificationPump
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
PROMPT = list(range(1, 19))  # 18 tokens: 5 blocks, the last one partial


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


def _engine(tiny: LoadedModel, budget: int = 256) -> LLMEngine:
    cfg = EngineConfig(
        cache=CacheConfig(block_size=BS, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
    )
    return LLMEngine(cfg, loaded=tiny)


def _reference(
    tiny: LoadedModel, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY
) -> list[int]:
    engine = _engine(tiny)
    engine.add_request(Request("ref", prompt, params))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert len(out) == params.max_tokens  # every reference ignores EOS
    return out


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def landing_problems(engine: AsyncEngine, post: Post) -> list[str]:
    """Where a late transfer is about to land on ``engine``'s pool (its target blocks),
    what is wrong: a block free, in the prefix cache, or owned by a request other than
    one still waiting for remote KV (the one that registered it). Empty: reserved."""
    nb = engine.core.layout.num_blocks
    idx = post.remote if post.handle.op is TransferOp.WRITE else post.local
    blocks = {int(i) % nb for i in idx}
    xid = post.handle.xid

    def check(e: LLMEngine) -> list[str]:
        problems = []
        for b in sorted(blocks):
            if e.block_pool.ref_count(b) < 1:
                problems.append(f"{xid}: block {b} is free")
            if e.block_pool.key_of(b) is not None:
                problems.append(f"{xid}: block {b} is in the prefix cache")
        sched = e.scheduler
        for req in [*sched._requests.values(), *sched._held.values()]:
            if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV and (
                shared := blocks & set(req.block_ids)
            ):
                problems.append(f"{xid}: blocks {sorted(shared)} belong to {req.request_id}")
        return problems

    return engine.call(check).result(10)


class Starved:
    """Every free or cached block of an engine, taken: its engine thread runs (ticks,
    messages), but admits nothing until `end` gives them back (a busy instance)."""

    def __init__(self, engine: AsyncEngine) -> None:
        def take(e: LLMEngine) -> list[int]:
            st = e.block_pool.stats()
            blocks = e.kv_manager.try_allocate_blocks(st.num_free + st.num_cached)
            assert blocks is not None
            return blocks

        self.engine = engine
        self.blocks: list[int] | None = engine.call(take).result(5)

    def end(self) -> None:
        blocks, self.blocks = self.blocks, None
        if blocks is not None:
            self.engine.call(lambda e: e.kv_manager.release_blocks(blocks)).result(5)


class Pair:
    """P and D engines joined by an in-process fabric; ``with Pair(tiny) as s`` closes them."""

    def __init__(
        self, tiny: LoadedModel, wait_s: float = 5.0, p_budget: int = 256,
        transfer_timeout_s: float = 5.0, quarantine_s: float = 0.5,
    ) -> None:  # fmt: skip
        self.p, self.d = _engine(tiny, p_budget), _engine(tiny)
        self.fabric = fabric = InProcessFabric()
        self.tp: InProcessTransport = fabric.endpoint(self.p.kv_pool, self.p.layout)
        self.td: InProcessTransport = fabric.endpoint(self.d.kv_pool, self.d.layout)
        self.d_peer = self.tp.connect(self.td.local_metadata())  # P writes into D
        self.p_peer = self.td.connect(self.tp.local_metadata())  # D notifies P
        self.ap, self.ad = AsyncEngine(self.p), AsyncEngine(self.d)
        self.pumps = [NotificationPump(self.tp, 0.01), NotificationPump(self.td, 0.01)]
        timing = FlowTiming(
            wait_s=wait_s, transfer_timeout_s=transfer_timeout_s, quarantine_s=quarantine_s
        )
        self.pf = prefill_flows(
            self.tp, self.ap, self.pumps[0], timing, {self.td.engine_id: self.d_peer}.get
        )
        self.df = decode_flows(
            self.td, self.ad, self.pumps[1], timing, {self.tp.engine_id: self.p_peer}.get,
            release=lambda _url, _xid: None,
        )  # fmt: skip
        self.sender = self.pf.sender
        self.push = self.df.push
        for pump in self.pumps:
            pump.start()
        self.ap.start()
        self.ad.start()

    async def prefill(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = FIRST
    ) -> list[int]:
        out: list[int] = []
        async for o in self.ap.generate(
            Request(xid, prompt, params, hold_blocks_on_finish=True), on_admit=lambda: self.sender.expect(xid, self.d_peer, len(prompt))
        ):  # fmt: skip
            out.extend(o.new_token_ids)
        return out

    async def decode(
        self, xid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY
    ) -> list[int]:
        await asyncio.wrap_future(self.push.submit(PushSpec(xid, self.p_peer, "http://p", f"d-{xid}")))
        out: list[int] = []
        async for o in self.ad.generate(Request(f"d-{xid}", prompt, params, remote_kv=RemoteKVSpec(xid))):
            out.extend(o.new_token_ids)
        return out

    def in_use(self, engine: AsyncEngine) -> int:
        return engine.call(lambda e: e.block_pool.stats().num_in_use).result(5)

    def assert_clean(self) -> None:
        for engine in (self.ap, self.ad):
            _wait_for(lambda engine=engine: self.in_use(engine) == 0, "pools to empty")  # type: ignore[misc]
            engine.call(lambda e: e.check_integrity()).result(5)

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pump in self.pumps:
            pump.close()
        self.ap.shutdown()
        self.ad.shutdown()
        self.sender.close()
        self.df.sender.close()
        self.pf.io.close()
        self.df.io.close()
