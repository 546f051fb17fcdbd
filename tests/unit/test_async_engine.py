"""The engine thread's front: failures are seen, a dead engine fails every caller at
once, health is progress, and an engine that cannot admit anything does not spin."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from kvduplex.common.config import Environment
from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.async_engine import IDLE_WAIT_S
from kvduplex.engine.async_engine import AsyncEngine
from kvduplex.engine.commands import EngineCommand
from kvduplex.engine.commands import EngineDeadError
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.request import Request
from kvduplex.instance.config import ServerConfig
from kvduplex.instance.server import Instance
from kvduplex.instance.server import InstanceParts
from kvduplex.instance.server import build_instance
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import load_model
from tests.support.engine_inbox import watch_inbox

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class _Crash(BaseException):
    """Not an Exception: raised in the engine thread, it ends the loop (as a bug would)."""


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(ModelLoadConfig(model="tiny", seed=0))


@pytest.fixture
def engine(tiny: LoadedModel) -> Iterator[AsyncEngine]:
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32))
    a = AsyncEngine(LLMEngine(cfg, loaded=tiny))
    a.start()
    try:
        yield a
    finally:
        a.shutdown()


class LogSeen(logging.Handler):
    """Sets `seen` once a record whose message holds every one of `parts` is logged."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if all(part in record.getMessage() for part in self.parts):
            self.seen.set()


class StallGate:
    """A `LoopGate`: while `is_stalling` is set, each iteration stops at its start until
    `release` is set; `began` is set at every iteration's start, `stalled` once one
    stopped (at `stalled_at`, on the monotonic clock). The test sets `release` before
    its engine shuts down."""

    def __init__(self) -> None:
        self.is_stalling = threading.Event()
        self.release = threading.Event()
        self.began = threading.Event()
        self.stalled = threading.Event()
        self.stalled_at = 0.0

    def __call__(self, stopping: threading.Event) -> None:
        self.began.set()
        if not self.is_stalling.is_set():
            return
        self.stalled_at = time.monotonic()
        self.stalled.set()
        self.release.wait(10)


def block_the_loop(a: AsyncEngine, gate: threading.Event, *, crash: bool = False) -> None:
    """Hold the engine thread in a call until `gate` is set (then end the loop if `crash`);
    returns once the thread is inside it."""
    inside = threading.Event()

    def hold(_e: LLMEngine) -> None:
        inside.set()
        gate.wait(10)
        if crash:
            raise _Crash("a bug in the engine thread")

    a.call(hold)
    assert inside.wait(5)


def engine_thread_cpu_s(a: AsyncEngine) -> float | None:
    """CPU seconds the engine thread has used (Linux; None elsewhere)."""
    stat = Path(f"/proc/self/task/{a._thread.native_id}/stat")  # the engine's own thread
    if not stat.exists():
        return None
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def collect(a: AsyncEngine, req: Request) -> list[RequestOutput]:
    return [out async for out in a.generate(req)]


# ---------------------------------------------------------------- calls are seen


def _fails(xid: str, _e: LLMEngine) -> None:
    raise ValueError(f"no job {xid}")


def test_a_failing_call_is_logged_with_its_name_and_the_engine_goes_on(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    logged = LogSeen("_fails('xid-7')", "no job xid-7")
    log = logging.getLogger()  # after caplog's handler: it has the record once `seen` is set
    log.addHandler(logged)
    try:
        with caplog.at_level(logging.ERROR, logger="kvduplex.engine.async_engine"):
            fut = engine.call(functools.partial(_fails, "xid-7"))  # dropped by the caller
            with pytest.raises(ValueError, match="no job xid-7"):
                fut.result(5)
            # The done-callback may log just after result() returned.
            assert logged.seen.wait(5), "the failed call was not logged"
    finally:
        log.removeHandler(logged)
    lines = [r.getMessage() for r in caplog.records]
    assert any("_fails('xid-7')" in line and "no job xid-7" in line for line in lines)
    assert engine.call(lambda e: e.block_pool.stats().total).result(5) == 32
    assert engine.is_healthy


def test_run_in_engine_hands_the_error_to_its_caller_without_logging(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="no job xid-8"):
            await engine.run_in_engine(functools.partial(_fails, "xid-8"))

    with caplog.at_level(logging.ERROR, logger="kvduplex.engine.async_engine"):
        asyncio.run(main())
    assert not caplog.records


# ------------------------------------------------------- a dead engine fails all


def test_a_crashed_loop_fails_every_stream_and_queued_call_at_once(engine: AsyncEngine) -> None:
    gate = threading.Event()
    block_the_loop(engine, gate, crash=True)

    async def main() -> None:
        stream = asyncio.ensure_future(collect(engine, Request("r-in-flight", [5, 6, 7], GREEDY)))
        await asyncio.sleep(0)  # let it queue its add
        queued = [engine.call(lambda e: e.block_pool.stats()) for _ in range(3)]
        gate.set()
        with pytest.raises(EngineDeadError, match="a bug in the engine thread"):
            await asyncio.wait_for(stream, 5)
        for fut in queued:
            with pytest.raises(EngineDeadError):
                fut.result(5)

    asyncio.run(main())
    assert not engine.is_running and not engine.is_healthy
    assert "a bug in the engine thread" in (engine.problem() or "")
    later = engine.call(lambda e: 1)
    assert later.done() and isinstance(later.exception(), EngineDeadError)

    async def submit_after() -> None:
        with pytest.raises(EngineDeadError):
            await collect(engine, Request("r-after", [5, 6, 7], GREEDY))
        with pytest.raises(EngineDeadError):
            await engine.run_in_engine(lambda e: 1)

    asyncio.run(submit_after())


def test_shutdown_fails_queued_and_later_calls(tiny: LoadedModel) -> None:
    a = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=16)), loaded=tiny))
    queued = a.call(lambda e: 1)  # not started: it waits in the inbox
    a.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        queued.result(1)
    assert isinstance(a.call(lambda e: 1).exception(0), EngineDeadError)


def test_the_gate_holds_each_iteration_and_lets_go_at_shutdown(tiny: LoadedModel) -> None:
    """`LoopGate`'s contract: called before the inbox is drained, so a call waits while it
    blocks; its `stopping` event is set by `shutdown`, which then ends at once."""
    hold = threading.Event()
    holding = threading.Event()
    release = threading.Event()
    calls: list[Future[int]] = []
    done_when_released: list[bool] = []

    def gate(stopping: threading.Event) -> None:
        if not hold.is_set():
            return
        holding.set()
        if not release.is_set():  # the first hold: until the test releases it
            release.wait(10)
            done_when_released.append(calls[0].done())  # seen on the engine thread
        else:  # the second: until shutdown
            stopping.wait(10)

    hold.set()
    core = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=16)), loaded=tiny)
    a = AsyncEngine(core, gate=gate)
    a.start()
    try:
        assert holding.wait(5), "the gate never held the loop"
        held = a.call(lambda e: 1)
        calls.append(held)
        assert not held.done()
        hold.clear()
        release.set()  # the call waited all the time the gate held the loop
        assert held.result(5) == 1
        assert done_when_released == [False]
        holding.clear()
        hold.set()  # the next iteration holds until shutdown sets `stopping`
        a.call(lambda e: 2)  # wakes the loop
        assert holding.wait(5), "the gate never held the loop again"
        started = time.monotonic()
    finally:
        release.set()
        a.shutdown()
    assert time.monotonic() - started < 2.0
    assert not a.is_running


@pytest.fixture
def instance() -> Iterator[Instance]:
    cfg = EngineConfig(model=ModelLoadConfig(model="tiny"), cache=CacheConfig(kv_cache_mb=16))
    inst = build_instance(cfg, ServerConfig(port=0), Environment())
    try:
        yield inst
    finally:
        inst.shutdown()


def test_every_route_answers_503_within_a_second_of_the_engine_dying(
    instance: Instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0}
    gate = threading.Event()
    block_the_loop(instance.async_engine, gate, crash=True)

    async def main() -> None:
        queued: list[EngineCommand] = []
        both_sent = asyncio.Event()

        def seen(command: EngineCommand) -> None:  # on this loop: the routes run on it
            queued.append(command)
            if len(queued) == 2:
                both_sent.set()

        watch_inbox(monkeypatch, instance.async_engine, seen)
        transport = httpx.ASGITransport(app=instance.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            # Requests in flight, each waiting on the engine (a call, or a stream).
            stats = asyncio.ensure_future(http.get("/internal/kv/stats"))
            completion = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await asyncio.wait_for(both_sent.wait(), 5)  # both wait in the engine's inbox
            gate.set()
            died = time.monotonic()
            answers = list(await asyncio.wait_for(asyncio.gather(stats, completion), 5))
            answers.append(await http.post("/v1/completions", json=body))
            answers.append(await http.post("/v1/completions", json={**body, "stream": True}))
            answers.append(await http.get("/v1/models"))
            answers.append(await http.get("/internal/kv/stats"))
            assert time.monotonic() - died < 1.0
            for resp in answers:
                assert resp.status_code == 503, (resp.request.url, resp.text)
                err = resp.json()["error"]
                assert err["code"] == "engine_dead" and err["type"] == "server_error"
                assert "a bug in the engine thread" in err["message"]
            health = await http.get("/health")
            assert health.status_code == 503
            assert "a bug in the engine thread" in health.json()["reason"]
            assert (await http.get("/metrics")).status_code == 200

    asyncio.run(main())


# ---------------------------------------------------------- health is progress


def test_health_turns_503_while_the_loop_is_stalled_and_200_once_it_goes_on() -> None:
    cfg = EngineConfig(
        model=ModelLoadConfig(model="tiny"), cache=CacheConfig(kv_cache_mb=16),
        scheduler=SchedulerConfig(engine_stall_timeout_s=0.5),
    )  # fmt: skip
    gate = StallGate()
    inst = build_instance(cfg, ServerConfig(port=0), Environment(), InstanceParts(loop_gate=gate))
    engine = inst.async_engine
    try:
        http = TestClient(inst.app)
        # Idle for longer than the limit (and than one idle wait): still healthy.
        idle_until = time.monotonic() + max(1.0, IDLE_WAIT_S) + 0.2
        while time.monotonic() < idle_until:
            assert http.get("/health").status_code == 200
            time.sleep(0.05)
        gate.is_stalling.set()
        queued = engine.call(lambda e: e.block_pool.stats().total)  # wakes the loop: it stalls
        assert gate.stalled.wait(5), "the loop never reached the gate"
        # The stall under test, past the 0.5 s limit: counted from the iteration's start,
        # which is no later than the gate's.
        time.sleep(max(0.0, gate.stalled_at + 0.6 - time.monotonic()))
        assert http.get("/health").status_code == 503
        reason = http.get("/health").json()["reason"]
        assert "no progress" in reason and "limit 0.5 s" in reason
        assert not engine.is_healthy and engine.is_running  # stalled, not dead
        assert not queued.done()
        gate.is_stalling.clear()
        gate.began.clear()
        gate.release.set()
        assert queued.result(5) > 0
        engine.wake()  # the next iteration begins at once
        assert gate.began.wait(5), "the loop never went on"
        assert http.get("/health").status_code == 200
    finally:
        gate.release.set()
        inst.shutdown()


# ------------------------------------------------------------- no busy stepping


def test_a_request_that_cannot_be_admitted_waits_without_spinning(engine: AsyncEngine) -> None:
    def take_every_block(e: LLMEngine) -> list[int]:
        st = e.block_pool.stats()
        ids = e.kv_manager.try_allocate_blocks(st.num_free + st.num_cached)
        assert ids is not None
        return ids

    held = engine.call(take_every_block).result(5)
    results: list[list[RequestOutput]] = []
    done = threading.Event()
    added = threading.Event()

    async def generate() -> list[RequestOutput]:
        req = Request("r-waits", [5, 6, 7, 8, 9], GREEDY)
        return [out async for out in engine.generate(req, on_admit=added.set)]

    def client() -> None:
        results.append(asyncio.run(generate()))
        done.set()

    threading.Thread(target=client, daemon=True).start()
    assert added.wait(5), "the request never reached the engine"
    # Commands run in order: this call's comes after the add that `on_admit` preceded.
    assert engine.call(lambda e: e.scheduler.num_waiting).result(5) == 1
    before, cpu_before = engine.num_iterations, engine_thread_cpu_s(engine)
    time.sleep(1.0)  # the period over which the loop's iterations are counted
    spun = engine.num_iterations - before
    assert spun < 20, f"{spun} loop iterations in 1 s while nothing could be admitted"
    if cpu_before is not None:
        cpu_s = (engine_thread_cpu_s(engine) or 0.0) - cpu_before
        assert cpu_s < 0.05, f"the engine thread used {cpu_s:.2f} s of CPU in 1 s of waiting"
    assert not done.is_set()
    released_at = time.monotonic()
    engine.call(lambda e: e.kv_manager.release_blocks(held))
    assert done.wait(5), "the request was not admitted once blocks were free"
    assert time.monotonic() - released_at < 2.0
    outs = results[0]
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == GREEDY.max_tokens
