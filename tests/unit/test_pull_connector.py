"""PullConnector over the in-process transport: READ, failure fallback, abort mid-READ."""

from __future__ import annotations

import asyncio

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.kvflow.connectors import FlowTiming
from kvduplex.kvflow.connectors import decode_flows
from kvduplex.kvflow.pull import PullSpec
from kvduplex.model.loader import LoadedModel
from kvduplex.transport.notify import NotificationPump
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport
from tests.unit.flow_pair import BS
from tests.unit.flow_pair import GREEDY
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture


def _engine(tiny: LoadedModel) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=64))
    return LLMEngine(cfg, loaded=tiny)


def _run(engine: LLMEngine, rid: str, params: SamplingParams, hold: bool = False) -> list[int]:
    engine.add_request(Request(rid, PROMPT, params, hold_blocks_on_finish=hold))
    out: list[int] = []
    while (req := engine.scheduler.get_request(rid)) is not None and not req.is_finished:
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert out and (len(out) == params.max_tokens or not params.ignore_eos)
    return out


class Setup:
    def __init__(self, tiny: LoadedModel, deadline_s: float = 5.0) -> None:
        self.p, self.d = _engine(tiny), _engine(tiny)
        fabric = InProcessFabric()
        self.tp: InProcessTransport = fabric.endpoint(self.p.kv_pool, self.p.layout)
        self.td: InProcessTransport = fabric.endpoint(self.d.kv_pool, self.d.layout)
        self.peer = self.td.connect(self.tp.local_metadata())
        self.released: list[tuple[str, str]] = []
        self.ad = AsyncEngine(self.d)
        timing = FlowTiming(wait_s=deadline_s, transfer_timeout_s=deadline_s, quarantine_s=1.0)
        self.pump = NotificationPump(self.td, 0.01)  # started by the tests that need ticks
        flows = decode_flows(
            self.td, self.ad, self.pump, timing, lambda _e: None,
            release=lambda u, x: self.released.append((u, x)),
        )  # fmt: skip
        self.conn = flows.pull
        self.ad.start()

    def prefill(self, xid: str) -> PullSpec:
        _run(self.p, xid, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold=True)
        req = self.p.scheduler.get_request(xid)
        assert req is not None
        return PullSpec(
            xid, self.peer, "http://p", list(req.block_ids), req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )  # fmt: skip

    async def decode(self, xid: str) -> list[int]:
        return (await self.decode_outputs(xid))[0]

    async def decode_outputs(self, xid: str) -> tuple[list[int], RequestOutput]:
        out: list[int] = []
        last = None
        async for o in self.ad.generate(Request(xid, PROMPT, GREEDY, remote_kv=RemoteKVSpec(xid))):
            out.extend(o.new_token_ids)
            last = o
        assert last is not None
        return out, last

    def close(self) -> None:
        self.ad.shutdown()
        self.conn.close()


def test_pull_reads_prefill_blocks_and_matches_local(tiny: LoadedModel) -> None:
    s = Setup(tiny)
    try:
        expected = _run(_engine(tiny), "ref", GREEDY)
        s.conn.submit(s.prefill("x1")).result(5)
        assert asyncio.run(s.decode("x1")) == expected
        assert s.conn.stats.num_pulled_blocks == 5 and s.conn.stats.num_failed == 0
        assert s.released == [("http://p", "x1")]
    finally:
        s.close()
    s.d.check_integrity()
    assert s.d.block_pool.stats().num_in_use == 0


def test_failed_read_falls_back_to_local_prefill(tiny: LoadedModel) -> None:
    s = Setup(tiny)
    try:
        expected = _run(_engine(tiny), "ref", GREEDY)
        s.conn.submit(s.prefill("x2")).result(5)
        s.td.fail_next("boom")
        assert asyncio.run(s.decode("x2")) == expected
        assert s.conn.stats.num_failed == 1 and s.conn.stats.num_pulled_blocks == 0
        assert s.released == [("http://p", "x2")]
    finally:
        s.close()


def test_abort_during_read_keeps_targets_until_it_ends(tiny: LoadedModel) -> None:
    s = Setup(tiny, deadline_s=60)  # the READ ends when the test disconnects, not at a deadline
    try:
        s.conn.submit(s.prefill("x3")).result(5)
        s.td.hang_next()

        def read_in_flight() -> bool:
            return s.ad.call(lambda e: e.connector.has_pending_work()).result(5)

        async def start_then_leave() -> None:
            task = asyncio.ensure_future(s.decode("x3"))
            await asyncio.to_thread(_wait_for, read_in_flight, "the READ to be posted")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(start_then_leave())
        # The abort reached the engine (the call queues behind it); the READ may still
        # land, so its targets stay allocated.
        gone, in_use = s.ad.call(
            lambda e: (e.scheduler.get_request("x3") is None, e.block_pool.stats().num_in_use)
        ).result(5)
        assert gone and in_use == 5 and read_in_flight()
        s.td.disconnect(s.peer)  # the hung READ fails now
        _wait_for(lambda: not read_in_flight(), "the READ to end")
        assert s.ad.call(lambda e: e.block_pool.stats().num_in_use).result(5) == 0
        assert s.conn.stats.num_failed == 1
        s.ad.call(lambda e: e.check_integrity()).result(5)
    finally:
        s.close()


def test_cached_tokens_are_prefills_prefix_hits(tiny: LoadedModel) -> None:
    """D computed nothing: the usage it reports counts what P served from its cache."""
    s = Setup(tiny)
    try:
        _run(s.p, "warm", SamplingParams(max_tokens=1, temperature=0.0))  # P caches PROMPT's blocks
        spec = s.prefill("x3")
        assert spec.num_cached_tokens == 16  # 4 full blocks of 4; the partial one is computed
        s.conn.submit(spec).result(5)
        _, last = asyncio.run(s.decode_outputs("x3"))
        assert last.num_cached_tokens == 16 and last.num_local_cached_tokens == 0
    finally:
        s.close()
