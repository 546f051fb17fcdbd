"""The engine/connector seam: plain data to the worker side, transfer results applied by
the step, one output path, and one `request_finished` for every finish.

Engine-level tests drive `LLMEngine` with a scripted connector, numbered as steps.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.sampling import SamplingParams
from kvduplex.engine.connector import KVConnector
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.engine import RequestOutput
from kvduplex.engine.metrics import EngineMetrics
from kvduplex.engine.request import FinishReason
from kvduplex.engine.request import RemoteKVSpec
from kvduplex.engine.request import Request
from kvduplex.engine.request import RequestStatus
from kvduplex.engine.scheduler_output import KVConnectorMetadata
from kvduplex.engine.scheduler_output import KVFirstToken
from kvduplex.engine.scheduler_output import KVReceived
from kvduplex.engine.scheduler_output import KVReceiveFailed
from kvduplex.engine.scheduler_output import KVSendCancelled
from kvduplex.engine.scheduler_output import KVSendEnded
from kvduplex.engine.scheduler_output import KVTransferResult
from kvduplex.engine.scheduler_output import RemoteKVAllocation
from kvduplex.engine.scheduler_output import SchedulerOutput
from kvduplex.kvflow.connectors import RemoteKVLoads
from kvduplex.kvflow.push_prefill import PushPlan
from kvduplex.model.loader import LoadedModel
from tests.unit.flow_common import GREEDY
from tests.unit.flow_common import PROMPT
from tests.unit.flow_common import _reference
from tests.unit.flow_common import tiny as tiny  # the module-scoped model fixture
from tests.unit.flow_sim import Sim

PLAIN = (int, float, str, bool, bytes, type(None))


def assert_plain(obj: object, path: str = "out") -> None:
    """`obj` is built of plain values, containers and dataclasses: no `Request` (nor any
    other live object) anywhere inside it."""
    assert not isinstance(obj, Request), f"{path} is a live Request"
    if isinstance(obj, PLAIN):
        return
    if isinstance(obj, list | tuple | set | frozenset):
        for i, item in enumerate(obj):
            assert_plain(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            assert_plain(key, f"{path} key")
            assert_plain(value, f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            assert_plain(getattr(obj, f.name), f"{path}.{f.name}")
    else:
        raise AssertionError(f"{path} is a {type(obj).__name__}, not plain data")


class ScriptedConnector(KVConnector):
    """Records what the engine hands each hook; reports the results a test queues."""

    def __init__(self) -> None:
        self.outputs: list[SchedulerOutput] = []
        self.worker_metas: list[KVConnectorMetadata | None] = []
        self.loads: list[RemoteKVAllocation] = []
        self.results: list[KVTransferResult] = []
        self.finished: list[tuple[str, FinishReason, RequestStatus]] = []
        self.hold: set[str] = set()

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata | None:
        self.outputs.append(out)
        return RemoteKVLoads([], list(out.remote_kv_allocated)) if out.remote_kv_allocated else None

    def request_finished(self, request: Request, reason: FinishReason) -> bool:
        self.finished.append((request.request_id, reason, request.status))
        return request.request_id in self.hold or super().request_finished(request, reason)

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        self.worker_metas.append(meta)
        if isinstance(meta, RemoteKVLoads):
            self.loads.extend(meta.pull)

    def layer_hook(self, meta: KVConnectorMetadata | None) -> Callable[[int], None] | None:
        self.worker_metas.append(meta)
        return None

    def get_finished(self) -> list[KVTransferResult]:
        results, self.results = self.results, []
        return results

    def has_pending_work(self) -> bool:
        return bool(self.results)


def make_engine(tiny: LoadedModel, num_blocks: int = 64) -> tuple[LLMEngine, ScriptedConnector]:
    cfg = EngineConfig(
        model=ModelLoadConfig(model="tiny"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    engine = LLMEngine(cfg, loaded=tiny)
    engine.connector = conn = ScriptedConnector()
    return engine, conn


def outputs_of(outs: list[RequestOutput], rid: str) -> list[RequestOutput]:
    return [o for o in outs if o.request_id == rid]


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    by_id: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            by_id.setdefault(o.request_id, []).append(o)
    return by_id


# ---- plain data ----


def test_scheduler_output_and_worker_metadata_are_plain_data(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's output, and what each connector's worker side got, on both ends of a
    real push (and a remote-KV admission with a prefix hit on D): no Request inside."""
    s = Sim(tiny, monkeypatch)
    seen: list[object] = []
    for engine in (s.p, s.d):
        schedule = engine.scheduler.schedule
        hooks = engine.connector

        def recording(schedule: Callable[[], SchedulerOutput] = schedule) -> SchedulerOutput:
            out = schedule()
            seen.append(out)
            return out

        def worker(meta: KVConnectorMetadata | None, hook=hooks.start_load_kv) -> None:  # type: ignore[no-untyped-def]
            seen.append(meta)
            hook(meta)

        engine.scheduler.schedule = recording  # type: ignore[method-assign]
        hooks.start_load_kv = worker  # type: ignore[method-assign]

    s.push_decode("plain")
    s.push_prefill("plain")
    s.run(lambda: s.finished("d-plain") and s.finished("plain"))
    assert s.outputs["d-plain"] == _reference(tiny)
    s.assert_clean()
    outs = [o for o in seen if isinstance(o, SchedulerOutput)]
    assert any(o.remote_kv_allocated for o in outs), "D allocated blocks for the pushed prompt"
    plans = [m for m in seen if isinstance(m, PushPlan)]
    assert any(p.xids for p in plans), "P planned pushes"
    assert any(isinstance(m, RemoteKVLoads) and m.push for m in seen)
    for i, obj in enumerate(seen):
        assert_plain(obj, f"seen[{i}]")
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_every_step_hands_its_worker_side_only_the_metadata(tiny: LoadedModel) -> None:
    engine, conn = make_engine(tiny)
    engine.add_request(Request("a", PROMPT, GREEDY))
    engine.add_request(Request("r", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xr")))
    engine.step()
    (out,) = conn.outputs
    assert [seq.request_id for seq in out.seqs] == ["a"]
    (alloc,) = out.remote_kv_allocated
    assert alloc.request_id == "r" and alloc.transfer_id == "xr"
    assert alloc.num_prompt_tokens == len(PROMPT) and len(alloc.block_ids) == 5
    assert isinstance(out.kv_connector_metadata, RemoteKVLoads)
    assert conn.worker_metas == [out.kv_connector_metadata] * 2  # start_load_kv, layer_hook
    assert_plain(out)


# ---- transfer results: applied by the step ----


def test_received_kv_and_its_first_token_come_out_of_the_next_step(tiny: LoadedModel) -> None:
    engine, conn = make_engine(tiny)
    req = engine.add_request(Request("r", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xr")))
    # 1. Admission: blocks for the whole prompt, nothing to compute yet.
    assert engine.step() == [] and [a.request_id for a in conn.loads] == ["r"]
    # 2. The worker side saw the KV arrive: nothing changes before the next step.
    conn.results.append(KVReceived("r", 42, num_remote_cached_tokens=4, num_remote_kv_bytes=99))
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV and engine.has_unfinished()
    # 3. The step applies it and returns the first token at once, before any forward.
    num_scheduled = len(conn.outputs)
    (first,) = outputs_of(engine.step(), "r")
    assert first.new_token_ids == [42] and len(conn.outputs) == num_scheduled
    assert req.num_remote_cached_tokens == 4 and req.num_remote_kv_bytes == 99
    assert first.num_remote_kv_bytes == 99 and first.num_prompt_computed_here == 0
    # 4. The next step decodes on.
    (second,) = outputs_of(engine.step(), "r")
    assert len(second.new_token_ids) == 1 and not second.finished
    rest = drain(engine)["r"]
    assert rest[-1].finished and req.num_output_tokens == GREEDY.max_tokens
    assert engine.block_pool.stats().num_in_use == 0


def test_the_gauges_tell_requests_waiting_for_blocks_from_those_holding_them_for_remote_kv(
    tiny: LoadedModel,
) -> None:
    engine, conn = make_engine(tiny, num_blocks=8)  # one prompt's 5 blocks, not two
    registry = CollectorRegistry()
    EngineMetrics(registry).bind_engine(engine)

    def gauges() -> tuple[float | None, ...]:
        names = ("waiting_for_remote_kv", "waiting", "running")
        return tuple(registry.get_sample_value(f"kvduplex_num_requests_{n}") for n in names)

    engine.add_request(Request("r", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xr")))
    other = list(reversed(PROMPT))  # no prefix of r's
    engine.add_request(Request("s", other, GREEDY, remote_kv=RemoteKVSpec("xs")))
    engine.step()
    assert gauges() == (1.0, 1.0, 0.0)  # r holds its blocks, s waits for blocks
    conn.results.append(KVReceived("r", 42, num_remote_cached_tokens=0, num_remote_kv_bytes=1))
    engine.step()
    assert gauges() == (0.0, 1.0, 1.0)
    for _ in range(4 * GREEDY.max_tokens):  # r finishes, its blocks free, s is admitted
        if not engine.scheduler.num_waiting:
            break
        engine.step()
    assert gauges() == (1.0, 0.0, 0.0)
    conn.results.append(KVReceived("s", 42, num_remote_cached_tokens=0, num_remote_kv_bytes=1))
    drain(engine)
    assert gauges() == (0.0, 0.0, 0.0)


def test_a_receive_that_failed_prefills_here(tiny: LoadedModel) -> None:
    engine, conn = make_engine(tiny)
    engine.add_request(Request("r", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xr")))
    engine.step()
    # 1. The sender's first token is known, then the receive fails: the prompt is
    #    computed here and continues from that token.
    conn.results += [KVFirstToken("r", 42), KVReceiveFailed("r", discard_blocks=True)]
    got = [t for o in drain(engine)["r"] for t in o.new_token_ids]
    assert got[0] == 42 and len(got) == GREEDY.max_tokens
    # 2. Without a first token, the tokens are the colocated ones.
    engine.add_request(Request("q", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xq")))
    engine.step()
    conn.results.append(KVReceiveFailed("q", discard_blocks=False))
    assert [t for o in drain(engine)["q"] for t in o.new_token_ids] == _reference(tiny)
    assert engine.block_pool.stats().num_in_use == 0


def test_a_result_for_an_aborted_request_is_dropped(tiny: LoadedModel) -> None:
    engine, conn = make_engine(tiny)
    engine.add_request(Request("r", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xr")))
    engine.step()
    conn.results.append(KVReceived("r", 42, 0, 0))
    assert engine.abort_request("r")
    # The abort's output is the request's only one, from the next step.
    (out,) = outputs_of(engine.step(), "r")
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
    assert not engine.has_unfinished()
    assert engine.block_pool.stats().num_in_use == 0


def test_a_prefills_ended_push_frees_its_held_blocks_at_the_next_step(tiny: LoadedModel) -> None:
    """Prefill's side: the worker reports a push cancelled or ended as plain records;
    only the next step changes requests (held blocks freed, a computing prefill stopped)."""
    engine, conn = make_engine(tiny)
    conn.hold.add("pushed")
    drain_one(engine, Request("pushed", PROMPT, GREEDY))
    in_use = engine.block_pool.stats().num_in_use
    # 1. Cancelled after its prefill finished: its WRITEs may still land, blocks stay held.
    conn.results.append(KVSendCancelled("pushed"))
    assert engine.step() == [] and engine.scheduler.num_held == 1
    assert engine.block_pool.stats().num_in_use == in_use
    # 2. Nothing can land any more: freed by the next step, not before.
    conn.results.append(KVSendEnded("pushed"))
    assert engine.scheduler.num_held == 1
    engine.step()
    assert engine.scheduler.num_held == 0 and engine.block_pool.stats().num_in_use == 0
    # 3. A push that ends (or is cancelled) while its prefill computes stops the prefill.
    for rid, result in (("ended", KVSendEnded("ended")), ("cancelled", KVSendCancelled("cancelled"))):
        long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(rid, PROMPT, long))
        engine.step()
        conn.results.append(result)
        (out,) = outputs_of(engine.step(), rid)
        assert out.finished and out.finish_reason == "abort"
        assert conn.finished[-1][:2] == (rid, FinishReason.ABORT)
    assert not engine.has_unfinished() and engine.block_pool.stats().num_in_use == 0


# ---- request_finished ----


def test_request_finished_once_for_every_finish(tiny: LoadedModel) -> None:
    engine, conn = make_engine(tiny)
    ref = _reference(tiny)
    text = "".join(o.new_text for o in drain_one(engine, Request("t", PROMPT, GREEDY)))
    conn.finished.clear()
    engine.add_request(Request("length", PROMPT, GREEDY))
    stop = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=(ref[1],))
    engine.add_request(Request("stop", PROMPT, stop))
    stop_text = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=(text[2:4],))
    engine.add_request(Request("stop_string", PROMPT, stop_text))
    engine.add_request(Request("running", PROMPT, GREEDY))
    engine.add_request(Request("remote", PROMPT, GREEDY, remote_kv=RemoteKVSpec("xr")))
    engine.step()
    assert engine.abort_request("running") and engine.abort_request("remote")
    engine.add_request(Request("queued", PROMPT, GREEDY))
    assert engine.abort_request("queued")  # never scheduled
    engine.drop_unadded(Request("unadded", PROMPT, GREEDY))  # never reached the engine
    drain(engine)
    got = {rid: (reason, status) for rid, reason, status in conn.finished}
    assert len(conn.finished) == len(got), f"a request finished twice: {conn.finished}"
    abort = (FinishReason.ABORT, RequestStatus.FINISHED_ABORTED)
    assert got == {
        "length": (FinishReason.LENGTH, RequestStatus.FINISHED_LENGTH),
        "stop": (FinishReason.STOP, RequestStatus.FINISHED_STOPPED),
        "stop_string": (FinishReason.STOP, RequestStatus.FINISHED_STOPPED),
        "running": abort,
        "remote": abort,
        "queued": abort,
        "unadded": abort,
    }
    assert engine.block_pool.stats().num_in_use == 0


def test_request_finished_decides_whether_blocks_stay_held(tiny: LoadedModel) -> None:
    engine, conn = make_engine(tiny)
    conn.hold.add("kept")
    drain_one(engine, Request("kept", PROMPT, GREEDY))
    assert engine.scheduler.num_held == 1 and engine.block_pool.stats().num_in_use > 0
    assert engine.scheduler.release_held("kept")
    # The default keeps what was added with hold_blocks_on_finish, never an abort.
    drain_one(engine, Request("flag", PROMPT, GREEDY, hold_blocks_on_finish=True))
    assert engine.scheduler.release_held("flag")
    engine.add_request(Request("aborted", PROMPT, GREEDY, hold_blocks_on_finish=True))
    engine.step()
    engine.abort_request("aborted")
    assert engine.scheduler.num_held == 0
    assert engine.block_pool.stats().num_in_use == 0


def test_a_failing_finish_hook_frees_the_blocks(tiny: LoadedModel) -> None:
    engine, conn = make_engine(tiny)

    def broken(request: Request, reason: FinishReason) -> bool:
        raise RuntimeError("hook bug")

    conn.request_finished = broken  # type: ignore[method-assign]
    outs = drain_one(engine, Request("r", PROMPT, GREEDY, hold_blocks_on_finish=True))
    assert outs[-1].finished and engine.scheduler.num_held == 0
    assert engine.block_pool.stats().num_in_use == 0


def drain_one(engine: LLMEngine, req: Request) -> list[RequestOutput]:
    engine.add_request(req)
    return drain(engine).get(req.request_id, [])


@pytest.mark.parametrize("num_steps", [1, 3])
def test_abort_output_waits_for_the_step(tiny: LoadedModel, num_steps: int) -> None:
    """Between steps an abort changes no output list but the next step's."""
    engine, _ = make_engine(tiny)
    engine.add_request(Request("a", PROMPT, GREEDY))
    for _ in range(num_steps):
        engine.step()
    engine.abort_request("a")
    assert engine.has_unfinished()
    (out,) = outputs_of(engine.step(), "a")
    assert out.finish_reason == "abort" and out.num_output_tokens == num_steps
    assert not engine.has_unfinished()
