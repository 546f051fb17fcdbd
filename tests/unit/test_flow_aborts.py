"""Aborts at every moment of a push or a pull: the engine tells the connector
(`request_finished`, also for a request that never reached the scheduler), the peer stops
its part, and afterwards every flow table is empty and both pools are clean."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.kvflow.push_decode import PushSpec
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_pair import GREEDY
from tests.unit.flow_pair import PROMPT
from tests.unit.flow_pair import Pair
from tests.unit.flow_pair import _reference
from tests.unit.flow_pair import _wait_for
from tests.unit.flow_pair import tiny as tiny  # the module-scoped model fixture
from tests.unit.test_pull_connector import Setup as PullSetup

LONG = PROMPT * 4  # 72 tokens: 18 steps of 4 tokens on P with p_budget=4


def _tables_empty(s: Pair) -> None:
    def empty() -> bool:
        p = s.ap.call(lambda _e: s.pf.tables()).result(5)
        d = s.ad.call(lambda _e: s.df.tables()).result(5)
        return all(v == 0 for k, v in {**p, **d}.items() if not k.endswith("tombstones"))

    _wait_for(empty, "every flow table to empty")


async def _cancel_when(task: asyncio.Task[list[int]], cond: object, what: str) -> None:
    await asyncio.to_thread(_wait_for, cond, what)  # type: ignore[arg-type]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_decode_aborted_while_waiting_for_pushed_kv_stops_the_prefill(tiny: LoadedModel) -> None:
    with Pair(tiny, p_budget=4) as s:

        async def run() -> None:
            p = asyncio.create_task(s.prefill("xa", LONG))
            d = asyncio.create_task(s.decode("xa", LONG))
            await _cancel_when(d, lambda: s.sender.stats.num_writes >= 1, "the first WRITEs")
            assert await p == [], "P's prefill was stopped before its first token"

        asyncio.run(run())
        assert s.sender.stats.num_failed == 1
        assert s.push.stats.num_fallbacks == 0, "an abort is no fallback"
        _tables_empty(s)
        s.assert_clean()


def test_decode_aborted_before_admission_tells_prefill(tiny: LoadedModel) -> None:
    """D's request is queued behind a long one when its client leaves: its spec goes,
    and P, told at once, never computes the prompt."""
    with Pair(tiny) as s:
        s.push.submit(PushSpec("xb", s.p_peer, "http://p", "d-xb")).result(5)
        s.ad.call(lambda _e: s.df.push.on_aborted("xb")).result(5)
        assert s.push.num_specs() == 0
        _wait_for(lambda: s.sender.tables()["send_cancelled_tombstones"] == 1, "P to hear it")

        async def late_prefill() -> list[int]:
            return await s.prefill("xb")

        try:
            out = asyncio.run(late_prefill())
        except ValueError:
            out = []
        assert out == [], "P refuses a prefill its decode already gave up"
        _tables_empty(s)
        s.assert_clean()


def test_prefill_aborted_mid_prefill_lets_decode_compute_at_once(tiny: LoadedModel) -> None:
    with Pair(tiny, p_budget=4, wait_s=30) as s:

        async def run() -> list[int]:
            p = asyncio.create_task(s.prefill("xc", LONG))
            d = asyncio.create_task(s.decode("xc", LONG))
            await _cancel_when(p, lambda: s.sender.stats.num_writes >= 1, "the first WRITEs")
            return await d

        assert asyncio.run(run()) == _reference(tiny, LONG)
        assert s.push.stats.num_fallbacks == 1, "well before D's 30 s wait"
        _tables_empty(s)
        s.assert_clean()


def test_a_request_that_never_reached_the_engine_drops_its_push_spec(tiny: LoadedModel) -> None:
    with Pair(tiny) as s:
        s.push.submit(PushSpec("xd", s.p_peer, "http://p", "d-xd")).result(5)
        req = Request("d-xd", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xd"))
        s.ad.call(lambda e: e.drop_unadded(req)).result(5)
        assert s.push.num_specs() == 0
        _tables_empty(s)


def test_pull_spec_of_an_aborted_request_releases_prefills_lease(tiny: LoadedModel) -> None:
    s = PullSetup(tiny)
    try:
        spec = s.prefill("xe")
        spec.request_id = "xe"
        s.conn.submit(spec).result(5)
        req = Request("xe", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xe"))
        s.ad.call(lambda e: e.drop_unadded(req)).result(5)
        assert s.conn.num_specs() == 0
        _wait_for(lambda: s.released == [("http://p", "xe")], "the lease's release")
    finally:
        s.ad.shutdown()


def test_pull_spec_whose_request_never_arrives_is_swept(tiny: LoadedModel) -> None:
    s = PullSetup(tiny, deadline_s=0.2)
    try:
        spec = s.prefill("xf")
        spec.request_id = "xf"
        s.conn.submit(spec).result(5)
        s.pump.start()
        _wait_for(lambda: s.conn.num_specs() == 0, "the orphan spec to go")
        _wait_for(lambda: s.released == [("http://p", "xf")], "the lease's release")
    finally:
        s.pump.close()
        s.ad.shutdown()


def test_prefill_aborted_before_its_job_refuses_the_acknowledged_registration(
    tiny: LoadedModel,
) -> None:
    """D registered first (P acknowledged it and kept it for the job to come); P's request
    is then dropped before its job began: D hears KVFailed at once, not after its wait."""
    with Pair(tiny, wait_s=30) as s:

        async def run() -> list[int]:
            d = asyncio.create_task(s.decode("xg"))
            await asyncio.to_thread(
                _wait_for, lambda: s.sender.tables()["send_early_registrations"] == 1,
                "D's registration to reach P",
            )  # fmt: skip
            req = Request("xg", PROMPT, GREEDY)
            s.ap.call(lambda e: e.drop_unadded(req)).result(5)
            return await asyncio.wait_for(d, 10)  # well before D's 30 s wait

        assert asyncio.run(run()) == _reference(tiny)
        assert s.push.stats.num_fallbacks == 1
        _tables_empty(s)
        s.assert_clean()


def test_a_spec_registered_on_admit_goes_with_a_request_that_never_reached_the_engine(
    tiny: LoadedModel,
) -> None:
    """Decode registers a request's spec as its ``on_admit``; a client that leaves while
    the request is queued for the engine still has it registered and then dropped with
    the request (a pull's lease is released at once, as before the spec moved there)."""
    with Pair(tiny) as s:
        gate = threading.Event()
        s.ad.call(lambda _e: gate.wait(10))  # the engine thread is busy
        ran: list[str] = []
        spec = PushSpec("xq", s.p_peer, "http://p", "d-xq")

        def admit() -> None:
            s.push.register(spec)
            ran.append(spec.xid)

        async def leave() -> None:
            req = Request("d-xq", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xq"))
            outputs = s.ad.generate(req, on_admit=admit)
            first = asyncio.ensure_future(outputs.__anext__())
            await asyncio.sleep(0.05)
            first.cancel()  # the client leaves before the engine takes the request
            await asyncio.gather(first, return_exceptions=True)
            await outputs.aclose()  # type: ignore[attr-defined]

        asyncio.run(leave())
        gate.set()
        _wait_for(lambda: ran == ["xq"], "the spec registered as the request is dropped")
        assert s.ad.call(lambda _e: s.push.num_specs()).result(5) == 0
        _tables_empty(s)
